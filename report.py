"""
Compare train.py runs: one markdown table of the modes, and with --out the figures behind it.

    python report.py out/study/*                          # print the table
    python report.py out/study/* --out=results/study      # + table.md, val_loss.png, max_weight.png, heatmap_*.png
    python report.py out/convert_* --recover_pct=1        # runs fine-tuned from a checkpoint: + the conversion table
    python report.py out/study/L24/* --save_runs=results/runs   # + results/runs/L24/<run>.json, readable in their
    python report.py results/runs/L24/*.json                    # place once the run folders are gone
    python report.py results/runs/*/*.json --out=results/study_all --no-figures    # table.md only

Each RUN is a train.py out_dir: log.jsonl (the numbers and the commit) and ckpt (the settings, and the final
weights for the routing measurement), or a run saved by --save_runs (the same without the weights, the routing
already measured): results/runs holds the CPU study's, so its tables can be remade and extended. Runs whose settings differ only in `seed` (and `out_dir`,
`wandb_run_name`) are one group: a row of the table gives the mean +- the sample standard deviation over
its seeds. Below it, seed by seed (a seed fixes the batches): each mode against `standard` of the same settings,
and each depth (width) against the next smaller depth (width) of the same mode and settings; then which machines made the runs,
with a warning for the seeds paired across two (runs on different CPUs are not bit-equal). The figures (matplotlib, imported
only with --out):
  val_loss.png     validation loss against step, one color per group (thin: each seed; thick: their mean)
  max_weight.png   the papers' sharpness figure: the mean over tokens of the largest routing weight at
                   each sublayer, by depth, one curve per routed group (mean over seeds)
  paired.png       where the groups vary in depth (or else in training length): each mode's final val loss
                   minus standard's of the same seed, against layers (or training tokens)
  claims.png       the paired table as a figure: each claim's seeds, mean and 95% interval, one panel per family
  heatmap_*.png    per routed group: the mean weight of each source (E, then sublayer outputs or
                   blocks) at each routing site (mean over seeds)
"""
import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import scipy.optimize
import scipy.stats
import torch

from checks import InvalidValue, Missing
from checkpoints import trained_checkpoint
from data import load_meta
from model import RESIDUAL_MODES
from runs import read_log, read_state

# Settings that name or label a run without changing what it computes: runs differing only in these are seeds
# of one experiment. `seed` sets the initial weights and the data order (data.ShardLoader).
PER_RUN = ('seed', 'out_dir', 'wandb_run_name')
# Settings of how a run executes, not of what it computes (and which runs of older code may not have recorded):
# left out when runs are grouped and compared.
EXECUTION = ('compile', 'compile_regional', 'log_interval', 'ddp_timeout_s', 'wandb_log', 'wandb_project')
# Settings that belong to a residual mode: a mode's baseline is the standard run that agrees on everything else.
MODE_KEYS = ('residual', 'variant', 'n_blocks', 'res_gate', 'routing_learning_rate', 'freeze_base')
# Settings tuned per mode (study v2: each mode at its own best learning rate): left out when a mode is paired with its
# baseline, which must then be the only standard group that agrees on everything else.
TUNED = ('learning_rate', 'min_lr')
# The 2x2 that model.py's two switches span: (a, b, what a - b isolates), paired seed by seed like the modes.
CONTRASTS = (('delta_attnres', 'full_attnres', 'add − replace, sublayer sources'),
             ('delta_block', 'attnres', 'add − replace, block sources'),
             ('full_attnres', 'attnres', 'sublayer − block sources, replace'),
             ('delta_attnres', 'delta_block', 'sublayer − block sources, add'))
ALPHA = 0.05    # a claim is better or worse when its Holm-corrected paired-t p is below this (results/README.md)
POWER = 0.8     # the chance of finding a true effect that the "smallest detectable effect" lines are computed for


def load_run(path):
    """A train.py out_dir, or a run saved by --save_runs (RUN.json) -> {'dir', 'config', 'val': {step: val_loss},
    'train': [log records of train steps], 'records', 'routing', 'commits', 'seconds'}."""
    if str(path).endswith('.json'):
        saved = json.loads(Path(path).read_text())
        return make_run(saved['dir'], saved['config'], saved['records'], saved['seconds'],
                        routing=saved['routing'], routing_batches=saved['routing_batches'])
    run_dir = Path(path)
    log = run_dir / 'log.jsonl'
    if not log.is_file():
        raise Missing(f"{run_dir} is not a train.py out_dir (log.jsonl is missing) nor a run saved by "
                                f"--save_runs (RUN.json)")
    ckpt = trained_checkpoint(str(run_dir))
    records = read_log(str(log))   # (a last line cut short by a full disk is dropped, with a note)
    config = read_state(ckpt)['config']     # the settings: the checkpoint's state.json
    # its wall time, where the script that ran it wrote one (results/study_runs.sh: OUT_DIR/seconds)
    seconds = float((run_dir / 'seconds').read_text()) if (run_dir / 'seconds').is_file() else None
    return make_run(str(run_dir), config, records, seconds)


def make_run(run_dir, config, records, seconds, routing=None, routing_batches=None):
    val = {r['step']: r['val_loss'] for r in records if 'val_loss' in r}
    if not val:
        raise InvalidValue(f"{run_dir} has no evaluation yet (no val_loss record)")
    config = {'variant': 'paper', **config}   # runs from before the setting existed ran the papers' definitions
    # the loss on the whole val split at the end (train.py's final_eval), or else the last evaluation
    whole = [r['final_val_loss'] for r in records if 'final_val_loss' in r]
    # which code made it: the provenance record of each start and restart (none in runs from before it existed)
    commits = {commit_of(r['provenance']) for r in records if 'provenance' in r} or {'unknown'}
    # and which machine: runs.py records it from 2026-12-02 on (earlier runs: None)
    machines = {machine_of(r['provenance'], config) for r in records if 'provenance' in r} or {None}
    return dict(dir=run_dir, config=config, val=val, final=whole[-1] if whole else val[max(val)], whole_split=bool(whole),
                train=[r for r in records if 'tok_per_s' in r], records=records,
                routing=routing, routing_batches=routing_batches, commits=commits, machines=machines, seconds=seconds)


def save_run(run, folder):
    """The run as one JSON file, FOLDER/<its folder's parent>/<its folder>.json, which load_run reads back: what the
    tables and figures need (settings, log, measured routing, wall time) without the checkpoint, so that results
    outlive the run folders and a study can be continued in a later sitting. The log keeps the routing summary of
    its last logged step only (routing_from_log's); the numbers are as logged, so a table made from saved runs
    equals the one made from their folders."""
    last = max((i for i, r in enumerate(run['records']) if r.get('routing')), default=None)
    records = [{k: v for k, v in r.items() if k != 'routing' or i == last} for i, r in enumerate(run['records'])]
    path = Path(folder) / Path(run['dir']).parent.name / f"{Path(run['dir']).name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = dict(dir=str(run['dir']), config=run['config'], seconds=run['seconds'], records=records,
                 routing=run['routing'], routing_batches=run['routing_batches'])
    path.write_text(json.dumps(saved, separators=(',', ':')) + '\n')
    return path


def commit_of(provenance):
    if provenance.get('commit') is None:
        return 'unknown'
    return provenance['commit'][:10] + ('+dirty' if provenance.get('dirty') else '')


def machine_of(provenance, config):
    """The GPU a run computed on, or its CPU (model and vector ISA); None where the log did not record it. Runs on
    different CPUs are not bit-equal (runs.cpu_name), so seeds paired across machines differ by more than the modes."""
    if str(config.get('device', 'cpu')).startswith('cuda'):
        return provenance.get('device')
    return provenance.get('cpu')


def group_runs(runs):
    """[{'config': the settings without PER_RUN, 'runs': [...]}], in the order groups first appear."""
    groups = {}
    for run in runs:
        # 'resume' and 'auto' continue a run from scratch that stopped: the same experiment
        cfg = {**run['config'], 'init_from': run['config']['init_from'] if is_conversion(run['config']) else 'scratch'}
        key = tuple(sorted((k, v) for k, v in cfg.items() if k not in PER_RUN + EXECUTION))
        groups.setdefault(key, dict(config=dict(key), runs=[]))['runs'].append(run)
    return list(groups.values())


def is_conversion(config):
    """Initialised from a pretrained checkpoint directory (train.py's init_from), not from scratch."""
    return config['init_from'] not in ('scratch', 'resume', 'auto')


# -----------------------------------------------------------------------------
# routing: {site: {'max_weight': mean over tokens of max_i alpha_i, 'weights': mean alpha_i per source}}

def routing_from_log(run):
    """The routing of the last logged step: one training micro-batch, weights as they were before the last update."""
    last = [r['routing'] for r in run['records'] if r.get('routing')]
    return last[-1] if last else None


@torch.no_grad()
def stats_from_model(model, batches):
    """The mean of forward(stats=True) over equally sized batches of token ids."""
    model.eval()
    total = {}
    for x in batches:
        _, _, stats = model(x, stats=True)
        for site, s in stats.items():
            acc = total.setdefault(site, {'max_weight': 0.0, 'weights': 0.0})
            acc['max_weight'] += s['max_weight'].item() / len(batches)
            acc['weights'] += s['weights'].double().cpu().numpy() / len(batches)
    return {site: {'max_weight': a['max_weight'], 'weights': a['weights'].tolist()} for site, a in total.items()}


def routing_from_val(run, batches, data_root=None, device='cpu'):
    """The final checkpoint's routing on `batches` val batches of the run's own dataset (spread over the split)."""
    from data import ShardLoader
    from checkpoints import load_model
    cfg = run['config']
    data_dir = os.path.join(data_root or cfg['data_root'], cfg['dataset'])
    if not os.path.isdir(data_dir):
        raise Missing(f"{run['dir']} was trained on {data_dir}, which is not here: pass --data_root=<folder "
                                f"holding {cfg['dataset']}/> or --routing=log")
    model, _ = load_model('resume', str(run['dir']))
    loader = ShardLoader(data_dir, 'val', cfg['batch_size'], cfg['block_size'])
    xs = [torch.from_numpy(x).to(device) for x, _ in loader.val_batches(batches)]
    return stats_from_model(model.to(device), xs)


def depth_sites(stats):
    """The sublayer sites with more than one source, in depth order. Left out: the first sublayer, which
    routes over E alone (weight 1 by definition, as train.py's routing_summary leaves it out), and the
    replacement modes' 'final' site, which the Delta modes do not have (like is compared with like)."""
    return [s for s in stats if s != 'final' and len(stats[s]['weights']) > 1]


def sharpness(stats):
    """(mean max weight over depth_sites, the same over the deepest third of them, and there the mean of 1/N: the
    max weight of a uniform mix over each site's N sources, the floor that a routing with no preference sits on)."""
    sites = depth_sites(stats)
    mw = [stats[s]['max_weight'] for s in sites]
    deep = slice(-max(1, len(mw) // 3), None)
    return (float(np.mean(mw)), float(np.mean(mw[deep])),
            float(np.mean([1 / len(stats[s]['weights']) for s in sites][deep])))


def mean_stats(all_stats):
    """Per site, the mean over seeds of max_weight and of each source's weight."""
    return {site: {'max_weight': float(np.mean([s[site]['max_weight'] for s in all_stats])),
                   'weights': np.mean([s[site]['weights'] for s in all_stats], axis=0).tolist()}
            for site in all_stats[0]}


# -----------------------------------------------------------------------------
# the tables

def spread(values, digits):
    """'mean ± sample std' (the mean alone for one value)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def settings(group, varying):
    """'key=value ...' of the varying settings that apply to this group's mode (paths by their last part, floats to 6
    significant digits: a rate computed as lr / 10 reads 0.0003, not 0.00030000000000000003)."""
    cfg = group['config']
    short = lambda v: Path(v).name if isinstance(v, str) and os.sep in v else f"{v:.6g}" if isinstance(v, float) else v
    return ' '.join(f"{k}={short(cfg.get(k))}" for k in varying if applies(k, cfg['residual']))


def applies(key, residual):
    """Whether a setting changes what a run of this residual mode computes."""
    granularity, mixing = RESIDUAL_MODES[residual]
    if key == 'n_blocks':
        return granularity == 'block'
    if key == 'res_gate':
        return mixing == 'add'
    return key not in MODE_KEYS or granularity is not None


def summarize(group):
    """The numbers of one row: per seed, then mean (and spread) over seeds."""
    runs = group['runs']
    final = [r['final'] for r in runs]
    tok_s = [np.mean([t['tok_per_s'] for t in r['train'][1:]]) for r in runs if len(r['train']) > 1]
    mem = [max(t['mem_gib'] for t in r['train']) for r in runs if r['train']]
    routed = [r['routing'] for r in runs if r['routing']]
    return dict(steps=sorted({max(r['val']) for r in runs}), loss=final, ppl=[math.exp(v) for v in final],
                tok_s=float(np.mean(tok_s)) if tok_s else None, mem=float(np.mean(mem)) if mem else None,
                sharp=[sharpness(s) for s in routed], stats=mean_stats(routed) if routed else None)


def baseline_of(group, groups):
    """The standard group that agrees with this one on every setting outside MODE_KEYS (same shape, data, schedule),
    its learning rate aside if there is only one such group (each mode at its own tuned rate); None if none or several."""
    same = lambda g, skip: all(g['config'].get(k) == v for k, v in group['config'].items() if k not in skip)
    standard = [g for g in groups if g['config']['residual'] == 'standard']
    exact = [g for g in standard if same(g, MODE_KEYS)]
    tuned = [g for g in standard if same(g, MODE_KEYS + TUNED)]
    return exact[0] if exact else tuned[0] if len(tuned) == 1 else None


def main_table(groups, varying):
    rows = []
    for g in groups:
        s, cfg, ref = g['summary'], g['config'], baseline_of(g, groups)
        delta = ('—' if ref is g or ref is None else
                 f"{100 * (statistics.fmean(s['ppl']) / statistics.fmean(ref['summary']['ppl']) - 1):+.2f}")
        sharp = ['—'] * 3 if not s['sharp'] else [spread([x[i] for x in s['sharp']], 3) for i in (0, 1)] + \
            [f"{s['sharp'][0][2]:.3f}"]
        rows.append([cfg['residual'], cfg['variant'], f"{cfg['n_layer']}×{cfg['n_embd']}", str(len(g['runs'])),
                     '/'.join(map(str, s['steps'])), spread(s['loss'], 4), spread(s['ppl'], 2), delta,
                     '—' if s['tok_s'] is None else f"{s['tok_s']:,.0f}", '—' if s['mem'] is None else f"{s['mem']:.2f}",
                     *sharp, ', '.join(sorted(set().union(*(r['commits'] for r in g['runs']))))]
                    + ([settings(g, varying)] if varying else []))
    head = ['mode', 'variant', 'layers×width', 'seeds', 'steps', 'val loss', 'val ppl', 'Δ% ppl vs standard',
            'tok/s', 'mem GiB', 'max weight', 'max weight, deep third', 'uniform 1/N, deep third', 'commit'] \
        + (['settings'] if varying else [])
    return markdown(head, rows)


def seed_diffs(group, ref):
    """{seed: final val loss of this group's run - that of ref's run with the same seed}: a seed fixes the initial
    weights and the data order, so the two runs saw the same batches (at any depth: the batches do not depend on
    the model)."""
    ref_by_seed = {r['config']['seed']: r['final'] for r in ref['runs']}
    return {r['config']['seed']: r['final'] - ref_by_seed[r['config']['seed']]
            for r in group['runs'] if r['config']['seed'] in ref_by_seed}


def cross_machine(group, ref):
    """[(seed, this run's machines, ref's)] of the seeds whose two runs computed on different known machines."""
    ref_by_seed = {r['config']['seed']: r['machines'] for r in ref['runs']}
    pairs = [(r['config']['seed'], r['machines'], ref_by_seed.get(r['config']['seed'], {None})) for r in group['runs']]
    return [(seed, mine, theirs) for seed, mine, theirs in pairs if None not in mine | theirs and mine != theirs]


def paired_diffs(group, groups):
    """seed_diffs against the standard run with the same settings; empty without one."""
    ref = baseline_of(group, groups)
    return {} if ref is None or ref is group else seed_diffs(group, ref)


# The two scale axes of a study: the settings that change together along each (the first one orders the sizes).
AXES = {'depth': ('n_layer',), 'width': ('n_embd', 'n_head', 'n_kv_head', 'intermediate_size')}


def smaller_of(group, groups, axis):
    """The group of the same mode and settings that is the next size down along axis (AXES), or None; its learning
    rate aside if that size has only one such group (each size at its own tuned rate)."""
    cfg, keys = group['config'], AXES[axis]
    below = lambda skip: [g for g in groups if g['config'][keys[0]] < cfg[keys[0]]
                          and all(g['config'].get(k) == v for k, v in cfg.items() if k not in skip)]
    exact, tuned = below(keys), below(keys + TUNED)
    if exact:
        return max(exact, key=lambda g: g['config'][keys[0]])
    largest = max((g['config'][keys[0]] for g in tuned), default=None)
    at = [g for g in tuned if g['config'][keys[0]] == largest]
    return at[0] if len(at) == 1 else None


def holm(p):
    """Holm's step-down correction of a family of p-values: the k-th smallest times (m - k + 1), kept monotone."""
    adjusted, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(sorted(range(len(p)), key=p.__getitem__)):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def power_of(effect, sd, n, alpha):
    """The chance that a two-sided paired t over n seeds at level alpha finds a true mean difference `effect` when
    the per-seed differences spread with standard deviation sd (the noncentral t distribution)."""
    if sd == 0:     # differences without spread: any true effect is found, none is "found" at the test's level
        return 1.0 if effect else alpha
    df, shift = n - 1, abs(effect) / sd * math.sqrt(n)
    crit = scipy.stats.t.ppf(1 - alpha / 2, df)
    wrong_sign = scipy.stats.nct.cdf(-crit, df, shift)     # below alpha / 2; scipy gives NaN for some large shifts
    return scipy.stats.nct.sf(crit, df, shift) + (0.0 if math.isnan(wrong_sign) else wrong_sign)


def detectable(sd, n, alpha, power=POWER):
    """The smallest true effect that n paired seeds find with this power at level alpha."""
    if sd == 0:
        return 0.0
    return scipy.optimize.brentq(lambda e: power_of(e, sd, n, alpha) - power, 1e-9 * sd, 1e3 * sd)


def seeds_needed(effect, sd, alpha, power=POWER, most=10_000):
    """The fewest paired seeds that find a true effect of this size with this power at level alpha."""
    return next((n for n in range(2, most) if power_of(effect, sd, n, alpha) >= power), None)


def family_spread(pairs):
    """A family's claims with 3 seeds or more -> (their per-seed differences, the pooled SD of those (each claim's own
    variance, weighted by its degrees of freedom), the fewest seeds of a claim, Holm's strictest level: ALPHA over
    the number of claims, the level the family's smallest p must pass); None where no claim has 3 seeds."""
    tested = [[diffs[s] for s in diffs] for _, diffs in pairs if len(diffs) > 2]
    if not tested:
        return None
    sd = math.sqrt(sum((len(x) - 1) * statistics.variance(x) for x in tested) / sum(len(x) - 1 for x in tested))
    return tested, sd, min(map(len, tested)), ALPHA / len(tested)


def family_power(pairs, effect=None, unit='token'):
    """One line under a family's table: the pooled SD of its claims, the smallest effect its seeds detect with POWER at
    Holm's strictest level, and with `effect` the seeds that would detect that. None where no claim has 3 seeds."""
    if not (fam := family_spread(pairs)):
        return None
    tested, sd, n, alpha = fam
    line = (f"Power: the {len(tested)} claims' paired differences spread with a pooled SD of {sd:.4f} nats per {unit}; "
            f"with {n} seeds a claim finds a true effect of {detectable(sd, n, alpha):.4f} or more with "
            f"{POWER:.0%} power at Holm's strictest level ({ALPHA:g}/{len(tested)} = {alpha:.4f}), and smaller ones "
            f"less often: a claim \"inside the noise\" cannot tell an effect below that from none.")
    if effect:   # every claim should reach the power: from the claim whose differences spread the most
        worst = max(statistics.stdev(x) for x in tested)
        need = seeds_needed(effect, worst, alpha)
        line += (f" An effect of {effect:g}: power {power_of(effect, sd, n, alpha):.0%} with {n} seeds at the pooled "
                 f"SD; {POWER:.0%} for every claim needs {need if need else 'more than 10,000'} seeds at that level "
                 f"(from the largest claim SD, {worst:.4f}).")
    return line


def paired_rows(pairs, verdicts=True, margin=None):
    """Rows of (label, {seed: difference}): the differences per seed, their mean and 95% paired-t interval, the
    two-sided paired-t p (raw and Holm-corrected over the rows, one family) and the verdict: better (negative) or
    worse where the corrected p is below ALPHA, otherwise inside the noise (verdicts=False: intervals only). With a
    margin m, a claim that is neither is "equivalent within ±m" where its 1 - 2 ALPHA (90%) paired-t interval lies
    inside (-m, +m) (two one-sided tests at ALPHA), else "cannot tell"."""
    rows, tests = [], []
    for label, diffs in pairs:
        d = [diffs[s] for s in sorted(diffs)]
        t = scipy.stats.ttest_1samp(d, 0.0) if len(d) > 2 else None
        tests.append(t)
        ci = t.confidence_interval(1 - ALPHA) if t else None
        rows.append([label, ', '.join(str(s) for s in sorted(diffs)), ' '.join(f"{x:+.4f}" for x in d),
                     f"{statistics.fmean(d):+.4f}", f"[{ci.low:+.4f}, {ci.high:+.4f}]" if t else '—',
                     f"{t.pvalue:.3f}" if t else '—'])
    tested = [i for i, t in enumerate(tests) if t]
    corrected = dict(zip(tested, holm([tests[i].pvalue for i in tested])))
    for i, row in enumerate(rows):
        if verdicts:
            p = corrected.get(i)
            row += ['—' if p is None else f"{p:.3f}",
                    'fewer than 3 seeds' if p is None else ('better' if tests[i].statistic < 0 else 'worse')
                    if p < ALPHA else 'inside the noise' if margin is None else equivalence(tests[i], margin)]
    return rows


def equivalence(test, margin):
    """The verdict of a claim that is neither better nor worse, given an equivalence margin (paired_rows)."""
    ci = test.confidence_interval(1 - 2 * ALPHA)
    inside = -margin < ci.low and ci.high < margin
    return (f"equivalent within ±{margin:g}" if inside else "cannot tell") + f" (90%: [{ci.low:+.4f}, {ci.high:+.4f}])"


PAIRED_HEAD = ['seeds', 'Δ val loss per seed', 'mean', '95% interval', 'p']


def families(groups, claims=None):
    """[(standard group, [(claim, {seed: difference})])]: each mode against the standard group of the same settings,
    and the 2x2 contrasts; the claims against one standard group are one family (Holm). claims: only these, as
    (first mode, second mode) pairs, e.g. {('delta_attnres', 'standard')} (a study's pre-registered contrasts)."""
    wanted = lambda a, b: claims is None or (a, b) in claims
    out = []
    for ref in [g for g in groups if g['config']['residual'] == 'standard']:
        mine = [g for g in groups if g is not ref and baseline_of(g, groups) is ref]
        pairs = [(g['label'], d) for g in mine if wanted(g['config']['residual'], 'standard')
                 and (d := seed_diffs(g, ref))]
        paper = {g['config']['residual']: g for g in mine if g['config']['variant'] == 'paper'}
        pairs += [(f"{a} − {b} ({what})", d) for a, b, what in CONTRASTS
                  if a in paper and b in paper and wanted(a, b) and (d := seed_diffs(paper[a], paper[b]))]
        if pairs:
            out.append((ref, pairs))
    return out


def paired_table(groups, effect=None, unit='token', margin=None, claims=None):
    """The families' claims, seed by seed, one table per family, each with its power line."""
    tables = []
    for _, pairs in families(groups, claims):
        tables.append(markdown(['claim', *PAIRED_HEAD, 'p, Holm', 'verdict'], paired_rows(pairs, margin=margin)))
        if line := family_power(pairs, effect, unit):
            tables[-1] += '\n\n' + line
    return '\n\n'.join(tables) or None


def scale_table(groups, axis):
    """Each group against the same mode and settings one size smaller along axis (depth or width), seed by seed:
    does the larger model do better?"""
    pairs = []
    for g in groups:
        if (ref := smaller_of(g, groups, axis)) and (d := seed_diffs(g, ref)):
            pairs.append((f"{g['label']} − {ref['config']['n_layer']}×{ref['config']['n_embd']}", d))
    head = 'run − shallower' if axis == 'depth' else 'run − narrower'
    return markdown([head, *PAIRED_HEAD], paired_rows(pairs, verdicts=False)) if pairs else None


def grid_table(groups):
    """The learning-rate grid: each mode's final val loss (mean over its seeds) at each peak learning rate, and the
    best -> (markdown, {mode: best lr}, [modes whose best is at an edge of their grid])."""
    by_mode = {}
    for g in groups:
        cfg = g['config']
        mode = cfg['residual'] + ('' if cfg['variant'] == 'paper' else f" ({cfg['variant']})")
        by_mode.setdefault(mode, {})[cfg['learning_rate']] = g['summary']['loss']
    lrs = sorted({lr for m in by_mode.values() for lr in m})
    rows, best, edges = [], {}, []
    for mode, losses in by_mode.items():
        mean = {lr: statistics.fmean(v) for lr, v in losses.items()}
        best[mode] = min(mean, key=mean.get)
        # means over different seeds do not compare (a seed moves the loss as much as a rate does): no pick until
        # every rate of the mode has run on the same number of seeds
        complete = len({len(v) for v in losses.values()}) == 1
        if best[mode] in (min(mean), max(mean)) or not complete:
            edges.append(mode)
        rows.append([mode] + [('—' if lr not in mean else f"**{mean[lr]:.4f}**" if lr == best[mode] else
                               f"{mean[lr]:.4f}") + (f" ({len(losses[lr])})" if lr in losses and len(losses[lr]) > 1 else '')
                              for lr in lrs] + [f"{best[mode]:g}" + ('' if mode not in edges else ' (edge)' if complete
                                                                      else ' (incomplete: seeds differ by rate)')])
    best = {mode: lr for mode, lr in best.items() if len({len(v) for v in by_mode[mode].values()}) == 1}
    return markdown(['mode', *[f"lr {lr:g}" for lr in lrs], 'best'], rows), best, edges


def conversion_table(groups, baseline, pct):
    """Runs initialised from a pretrained checkpoint: the loss at step 0, at the end, and when it is back
    within pct% of the pretrained model's (that of the standard fine-tune at step 0, or --baseline)."""
    rows, pretrained = [], {}
    for g in groups:
        init = g['config']['init_from']
        if init not in pretrained:
            ref = [x for x in groups if x['config']['init_from'] == init and x['config']['residual'] == 'standard'
                   and all(0 in r['val'] for r in x['runs'])]
            pretrained[init] = baseline if baseline is not None else \
                statistics.fmean(r['val'][0] for r in ref[0]['runs']) if ref else None
        ref = pretrained[init]
        steps = sorted(set.intersection(*(set(r['val']) for r in g['runs'])))  # the steps every seed evaluated
        curve = {t: statistics.fmean(r['val'][t] for r in g['runs']) for t in steps}
        back = '—' if ref is None else next((str(t) for t in steps if curve[t] <= ref * (1 + pct / 100)),
                                             f"not by {steps[-1]}")
        per_seed = ' '.join(f"{r['val'][0]:.4f}" for r in sorted(g['runs'], key=lambda r: r['config']['seed'])) \
            if 0 in curve else '—'
        rows.append([g['label'], g['config']['residual'], str(g['config']['res_gate']), str(len(g['runs'])),
                     '—' if 0 not in curve else f"{curve[0]:.6f}", per_seed, f"{curve[steps[-1]]:.6f} (step {steps[-1]})",
                     back])
    head = ['run', 'mode', 'res_gate', 'seeds', 'val loss at step 0', 'step 0, per seed', 'final val loss',
            f'back within {pct:g}% of the pretrained loss at step']
    return markdown(head, rows), pretrained


def machine_lines(runs, groups):
    """Which machines made the runs, and a warning for the pairs of the paired tables that cross machines: one per
    comparison and pair of machines, naming its seeds (a whole part run on another CPU type gives one line, not five)."""
    count = Counter(m for r in runs for m in r['machines']).most_common()
    lines = ['Machines (from the logs): ' + '; '.join(f"{m or 'not recorded'}: {n} run{'s' * (n > 1)}" for m, n in count)
             + '.']
    for g in groups:
        for ref in (baseline_of(g, groups), *(smaller_of(g, groups, axis) for axis in AXES)):
            if ref is None or ref is g:
                continue
            crossing = {}     # (this run's machines, ref's) -> seeds
            for seed, mine, theirs in cross_machine(g, ref):
                crossing.setdefault((', '.join(sorted(mine)), ', '.join(sorted(theirs))), []).append(seed)
            for (mine, theirs), seeds in crossing.items():
                which = (f"seed {seeds[0]} of {g['label']} ran on {mine} and its pair" if len(seeds) == 1 else
                         f"seeds {', '.join(map(str, seeds))} of {g['label']} ran on {mine} and their pairs")
                lines += ['', f"**Warning:** {which} in {ref['label']} on {theirs}: runs on different machines are "
                          f"not bit-equal, so {'this difference is' if len(seeds) == 1 else 'these differences are'} "
                          "partly the machines'."]
    return lines


def markdown(head, rows):
    return '\n'.join('| ' + ' | '.join(r) + ' |' for r in [head, ['---'] * len(head)] + rows)


# -----------------------------------------------------------------------------
# the figures

def token_unit(groups, data_root=None, unit=None):
    """What the losses are nats per: `unit` where given (--unit), else 'byte' where every run is byte-level (the
    demo corpus: a token is a byte, so its losses are per byte, not comparable with GPT-2 tokens' without a
    conversion), else 'token'. A run's tokenizer is the one its log's first record names (train.py writes it); for
    runs from before that, the one its dataset's meta.json on this machine names."""
    if unit:
        return unit
    def tokenizer(run):
        if recorded := next((r['tokenizer'] for r in run['records'] if 'tokenizer' in r), None):
            return recorded
        cfg = run['config']
        try:
            return load_meta(os.path.join(data_root or cfg.get('data_root', 'data'), str(cfg.get('dataset'))))['tokenizer']
        except (Missing, InvalidValue):
            return None     # not recorded, and the dataset is not on this machine: the unit is unknown, say 'token'
    return 'byte' if all(tokenizer(r) == 'byte' for g in groups for r in g['runs']) else 'token'


def wrap(text, width):
    """A figure title broken into lines that fit (matplotlib cuts a long one off at the figure's edge)."""
    return '\n'.join(textwrap.fill(line, width) for line in text.split('\n'))


def seeds(group):
    n = len(group['runs'])
    return f"{n} seed{'s' * (n != 1)}"


def pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def plot_val_loss(groups, path, pretrained, unit='token'):
    """All runs, full length and the second half (where the modes separate) zoomed in."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, g in enumerate(groups):
        color = f'C{i % 10}'
        steps = sorted(set.intersection(*(set(r['val']) for r in g['runs'])))
        for ax in axes:
            for r in g['runs']:
                ax.plot(sorted(r['val']), [r['val'][t] for t in sorted(r['val'])], color=color, lw=0.7, alpha=0.4)
            ax.plot(steps, [np.mean([r['val'][t] for r in g['runs']]) for t in steps], color=color, lw=1.8,
                    label=f"{g['label']} ({seeds(g)})")
    last = max(max(r['val']) for g in groups for r in g['runs'])
    tail = [v for g in groups for r in g['runs'] for t, v in r['val'].items() if t >= last / 2]
    axes[1].set_xlim(last / 2, last * 1.01)
    axes[1].set_ylim(min(tail) - 0.02 * np.ptp(tail), max(tail) + 0.02 * np.ptp(tail) + 1e-6)
    for ref in {v for v in pretrained.values() if v is not None}:
        for ax in axes:
            ax.axhline(ref, color='k', ls='--', lw=0.8)
    for ax, title in zip(axes, ('validation loss', 'second half, zoomed')):
        ax.set_xlabel('step')
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f'val loss (nats per {unit})')
    axes[0].legend(fontsize=7)
    fig.suptitle(shape_and_budget(groups), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def shape_and_budget(groups):
    """'12×64, T=256, 4.1M tokens' for the figures' titles: the shapes and budgets the groups span."""
    tokens = lambda c: c['max_iters'] * c['batch_size'] * c['block_size'] * c['gradient_accumulation_steps']
    shapes = sorted({f"{g['config']['n_layer']}×{g['config']['n_embd']}" for g in groups}, key=lambda x: tuple(map(int, x.split('×'))))
    budget = sorted({(g['config']['block_size'], tokens(g['config'])) for g in groups})
    return f"{', '.join(shapes)}; " + ', '.join(f"T={t}, {n / 1e6:.2f}M training tokens" for t, n in budget)


def plot_max_weight(groups, path):
    """The papers' sharpness figure, one panel per routed group: the mean max routing weight at each sublayer site by
    depth (thin: each seed; thick: their mean), and dashed the floor 1/N that a uniform mix over the site's N sources
    would give (a site cannot be less concentrated than that)."""
    routed = [g for g in groups if g['summary']['stats']]
    plt = pyplot()
    cols = min(3, len(routed))
    fig, axes = plt.subplots(math.ceil(len(routed) / cols), cols, figsize=(4.2 * cols, 3.2 * math.ceil(len(routed) / cols)),
                             sharex=True, sharey=True, squeeze=False)
    for ax, g in zip(axes.flat, routed):
        stats = g['summary']['stats']
        sites = depth_sites(stats)
        depth = [2 * int(s.split('.')[1]) + (s.endswith('mlp')) for s in sites]   # sublayer index: 2*layer + (mlp)
        for r in g['runs']:
            if r['routing']:
                ax.plot(depth, [r['routing'][s]['max_weight'] for s in sites], color='C0', lw=0.7, alpha=0.5)
        ax.plot(depth, [stats[s]['max_weight'] for s in sites], color='C0', lw=1.8, marker='o', ms=3,
                label=f"mean of {seeds(g)}")
        ax.plot(depth, [1 / len(stats[s]['weights']) for s in sites], 'k--', lw=0.9, label='uniform mix, 1/N')
        ax.set_title(g['label'], fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(routed):]:
        ax.axis('off')
    for ax in axes[-1]:
        ax.set_xlabel('sublayer depth (attention, MLP, ...)')
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[:, 0]:
        ax.set_ylabel('mean max routing weight')
    fig.suptitle(f"How concentrated the routing is ({shape_and_budget(groups)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_paired(groups, path, unit='token'):
    """The paired difference against standard (mean over seeds, each seed a dot) as a function of depth or else of
    training tokens, whichever the groups vary: one line per mode (and width, or depth). False if neither varies."""
    tokens = lambda c: c['max_iters'] * c['batch_size'] * c['block_size'] * c['gradient_accumulation_steps']
    widths = len({g['config']['n_embd'] for g in groups}) > 1      # then one line per mode and width
    axes = (('layers', lambda c: c['n_layer'], lambda c: (f"width {c['n_embd']}",) * widths),
            ('training tokens', tokens, lambda c: (f"{c['n_layer']} layers",)))
    for label, x_of, more in axes:
        lines = {}
        for g in groups:
            if diffs := paired_diffs(g, groups):
                cfg = g['config']
                name = ', '.join((cfg['residual'] + ('' if cfg['variant'] == 'paper' else f" ({cfg['variant']})"),
                                  *more(cfg)))
                lines.setdefault(name, []).append((x_of(cfg), list(diffs.values())))
        if not any(len({x for x, _ in pts}) > 1 for pts in lines.values()):
            continue
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = sorted({x for pts in lines.values() for x, _ in pts})
        for i, (name, pts) in enumerate(sorted(lines.items())):
            pts.sort()
            orig = [x for x, _ in pts]
            color = f'C{i % 10}'
            dodge = (i - (len(lines) - 1) / 2) * 0.012 * (1 if label == 'training tokens' else max(xs) - min(xs))
            pts = [(x * (1 + dodge) if label == 'training tokens' else x + dodge, d) for x, d in pts]   # side by side
            # a line only between neighbouring values of the axis: a mode not run at some depth is a gap, not a slope
            start = 0
            for k in range(1, len(pts) + 1):
                if k == len(pts) or xs.index(orig[k]) != xs.index(orig[k - 1]) + 1:
                    ax.plot([x for x, _ in pts[start:k]], [np.mean(d) for _, d in pts[start:k]], color=color,
                            marker='o', label=name if start == 0 else None)
                    start = k
            for x, d in pts:
                ax.scatter([x] * len(d), d, color=color, s=8, alpha=0.5)
                if len(d) > 2:      # the 95% paired-t interval of the mean
                    ci = scipy.stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
                    ax.vlines(x, ci.low, ci.high, color=color, lw=2, alpha=0.6)
        ax.axhline(0, color='k', lw=0.8)
        ax.set_xscale('log' if label == 'training tokens' else 'linear')
        ax.set_xlabel(label)
        ax.set_ylabel(f'final val loss minus standard, same seed\n(nats per {unit})')
        ax.set_title(wrap(f'Each mode minus standard, same seed, by {label} (below 0: better; bars: 95% paired-t)\n'
                          f'{shape_and_budget(groups)}', 80), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return True
    return False


def plot_claims(groups, path, effect=None, unit='token', claims=None):
    """The paired table as a figure, one panel per family: each claim's per-seed differences (dots), their mean and
    95% paired-t interval (bar), red where the verdict is better or worse; dotted, ± the smallest effect the family's
    seeds detect (its power line), and shaded ± `effect` where given. Conversion runs (fine-tuned from a checkpoint)
    are left to plot_conversion. False if no claim has 3 seeds."""
    fams = [(ref, pairs, paired_rows(pairs)) for ref, pairs in families(groups, claims)
            if not is_conversion(ref['config'])]
    fams = [f for f in fams if any(len(d) > 2 for _, d in f[1])]
    if not fams:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(len(fams), 1, figsize=(8, 0.45 * sum(len(p) for _, p, _ in fams) + 2.1 * len(fams)),
                             squeeze=False, sharex=True)
    for ax, (ref, pairs, rows) in zip(axes[:, 0], fams):
        for y, ((label, diffs), row) in enumerate(zip(pairs, rows)):
            d = [diffs[s] for s in sorted(diffs)]
            color = 'C3' if row[-1] in ('better', 'worse') else 'C0'
            ax.scatter(d, [y] * len(d), color=color, s=12, alpha=0.6)
            if len(d) > 2:
                ci = scipy.stats.ttest_1samp(d, 0.0).confidence_interval(1 - ALPHA)
                ax.hlines(y, ci.low, ci.high, color=color, lw=2.5)
            ax.plot([np.mean(d)], [y], marker='|', color='k', ms=12)
        ax.axvline(0, color='k', lw=0.8)
        _, sd, n, alpha = family_spread(pairs)
        mde = detectable(sd, n, alpha)
        for x in (-mde, mde):
            ax.axvline(x, color='k', ls=':', lw=1, label=f'± {mde:.3f}: the smallest effect these seeds detect '
                       f'({POWER:.0%} power, Holm)' if x > 0 else None)
        if effect:
            ax.axvspan(-effect, effect, color='C2', alpha=0.15, label=f'± {effect:g}: the effect asked about')
        # below the tick labels and the x label, a fixed half inch under the axis whatever the panel's height
        under = plt.matplotlib.transforms.offset_copy(ax.transAxes, fig=fig, y=-0.5, units='inches')
        ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, 0), bbox_transform=under)
        ax.set_yticks(range(len(pairs)), [textwrap.fill(label, 45) for label, _ in pairs], fontsize=7)
        ax.set_ylim(len(pairs) - 0.5, -0.5)      # the first claim on top, each half a row from the frame
        ax.grid(axis='x', alpha=0.3)
        ax.set_xlabel(f'final val loss difference, same seed, in nats per {unit} (below 0: the first is better)',
                      fontsize=8)
        ax.set_title(wrap(f"Against {ref['label']} ({shape_and_budget([ref])}, {seeds(ref)})\nseeds: dots; mean: |; "
                          f"bar: 95% paired-t interval; red: better or worse after Holm", 90), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_conversion(groups, path, pretrained, unit='token'):
    """Runs converted from a pretrained checkpoint: what the conversion does at once (each seed's val loss at step 0
    minus the pretrained model's: the jump) and what remains at the end (each seed's final val loss minus the standard
    fine-tune's of the same seed), one row per group, on a scale that shows a jump of 1 beside differences of 0.001.
    False without conversion runs that evaluated step 0."""
    conv = [g for g in groups if is_conversion(g['config']) and all(0 in r['val'] for r in g['runs'])]
    if not conv:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.2 + 0.42 * len(conv)), sharey=True)
    for y, g in enumerate(conv):
        ref = pretrained.get(g['config']['init_from'])
        std = [x for x in conv if x['config']['residual'] == 'standard'
               and x['config']['init_from'] == g['config']['init_from']]
        for ax, d in ((axes[0], [r['val'][0] - ref for r in g['runs']] if ref is not None else []),
                      (axes[1], list(seed_diffs(g, std[0]).values()) if std and std[0] is not g else [])):
            if d:
                ax.scatter(d, [y] * len(d), color='C0', s=12, alpha=0.6)
                ax.plot([np.mean(d)], [y], marker='|', color='k', ms=12)
    for ax, title in zip(axes, ('at step 0: val loss minus the pretrained model\'s (the jump)',
                                'at the end: final val loss minus the standard fine-tune\'s, same seed')):
        ax.axvline(0, color='k', lw=0.8)
        ax.set_xscale('symlog', linthresh=0.01)   # linear within ±0.01, logarithmic beyond
        ax.grid(axis='x', alpha=0.3)
        ax.set_title(wrap(title, 55), fontsize=8)
        ax.set_xlabel(f'nats per {unit} (linear within ±0.01, log beyond)', fontsize=8)
    axes[0].set_yticks(range(len(conv)), [textwrap.fill(g['label'], 40) for g in conv], fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(wrap(f"Conversion ({shape_and_budget(conv)}): seeds: dots; mean: |", 100), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_heatmap(title, stats, path):
    plt = pyplot()
    sites = list(stats)
    n_src = max(len(stats[s]['weights']) for s in sites)
    grid = np.full((len(sites), n_src), np.nan)       # NaN: this site does not see that source yet
    for r, s in enumerate(sites):
        w = stats[s]['weights']
        grid[r, :len(w)] = w
    fig, ax = plt.subplots(figsize=(max(5.0, 2.5 + 0.4 * n_src), 1.5 + 0.3 * len(sites)))
    im = ax.imshow(grid, cmap='viridis', vmin=0, vmax=1, aspect='auto')
    if grid.size <= 400:   # small enough to print the numbers
        for (r, c), w in np.ndenumerate(grid):
            if not np.isnan(w):
                ax.text(c, r, f'{w:.2f}', ha='center', va='center', fontsize=6, color='w' if w < 0.6 else 'k')
    ax.set_yticks(range(len(sites)), sites, fontsize=7)
    ax.set_xticks(range(n_src), ['E'] + [str(i) for i in range(1, n_src)], fontsize=7)
    ax.set_xlabel('source: E, then sublayer outputs or blocks\n(block modes as in the paper: the last one a site sees is the open block)', fontsize=7)
    ax.set_ylabel('routing site')
    ax.set_title(wrap(f'mean routing weights: {title}', 60), fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_routing(runs, how, batches, data_root, device):
    """Each routed run's routing statistics ('routing'), from its log or measured on val batches."""
    routed = [r for r in runs if r['config']['residual'] != 'standard']
    for i, run in enumerate(routed):
        if how == 'log':
            run['routing'], run['routing_batches'] = routing_from_log(run), None
        elif run['routing'] is not None:    # a saved run: measured when it was saved
            if run['routing_batches'] != batches:
                raise SystemExit(f"{run['dir']}: its saved routing is " + (
                    "the logged one: use --routing=log" if run['routing_batches'] is None else
                    f"measured on {run['routing_batches']} val batches, not --batches={batches}"))
        else:
            print(f"routing of {run['dir']} on {batches} val batches ({i + 1}/{len(routed)})", file=sys.stderr)
            run['routing'] = routing_from_val(run, batches, data_root, device)
            run['routing_batches'] = batches


# -----------------------------------------------------------------------------

MAIN_CAPTION = (
    "Final validation loss and perplexity: on the whole val split where the run measured it at its end (train.py's "
    "final_eval), else its last evaluation; mean ± sample standard deviation over seeds; Δ%: of the mean perplexity "
    "against the standard run of the same shape and settings. tok/s: the mean of the logged throughput, the first log "
    "record (warm-up, compilation) left out; mem: the peak logged (GPU: max allocated; CPU: the process's max RSS). "
    "Max weight: the mean over tokens of the largest routing weight, averaged over the sublayer sites that have more "
    "than one source, and over the deepest third of them; measured with {how}; mean ± std over seeds. Uniform 1/N: "
    "what a uniform mix would give there (the mean over the deepest third of 1/N, N a site's sources).")
PAIRED_CAPTION = (
    "Δ: the final val loss of the claim's first run minus its second's with the same seed (the same batches; the "
    "same initial weights only in runs of code from commit 75ef817 on, model.query: before it, a routed mode drew its "
    "queries from the random generator and every later tensor differed); negative: the first is better. 95% interval "
    "and p: paired t over the seeds; the claims of one table are one family, their p Holm-corrected. Verdict: better "
    f"or worse where the corrected p is below {ALPHA}; otherwise inside the noise: this many seeds cannot tell (the "
    "power line says what they could have found).")
MARGIN_CAPTION = (" With an equivalence margin of ±{m:g} (--margin), a claim neither better nor worse is "
                  "equivalent within ±{m:g} where its 90% paired-t interval (shown) lies inside (−{m:g}, +{m:g}): two "
                  "one-sided tests at 0.05; otherwise cannot tell.")
SCALE_CAPTION = ("Δ: the final val loss minus that of the same mode and settings at the next smaller {axis}, with the "
                 "same seed (the same batches); negative: the {larger} model is better. Intervals and raw p, no verdict.")
GRID_CAPTION = ("Final val loss at each peak learning rate (mean over the grid's seeds, their number in brackets where "
                "more than one), the best in bold; '(edge)': the best is the grid's smallest or largest rate, so the "
                "grid should be extended; '(incomplete)': its rates ran on different numbers of seeds, so no pick yet. "
                "The chosen rates: best_lr.txt (with --out; no line for an incomplete mode).")


def tables(runs, groups, args, unit='token'):
    """The report's markdown: the main table, the paired and depth tables (or the learning-rate grid), the wall time,
    the machines and commits, the conversion table -> (text, pretrained losses, {mode: best lr} or None)."""
    how = (f"forward passes of each run's final checkpoint on {args.batches} val batches of its dataset"
           if args.routing == 'val' else "the last logged training step of each run (one micro-batch)")
    varying = varying_settings(groups)
    text, best = [main_table(groups, varying), '', MAIN_CAPTION.format(how=how)], None
    if args.grid:
        grid, best, edges = grid_table(groups)
        text += ['', '### Learning-rate grid', '', grid, '', GRID_CAPTION]
    else:
        paired = paired_table(groups, args.effect, unit, args.margin, args.claims)
        caption = PAIRED_CAPTION + (MARGIN_CAPTION.format(m=args.margin) if args.margin else '')
        for title, table, caption in (('Paired, seed by seed', paired, caption),
                                      ('Deeper against shallower, seed by seed', scale_table(groups, 'depth'),
                                       SCALE_CAPTION.format(axis='depth', larger='deeper')),
                                      ('Wider against narrower, seed by seed', scale_table(groups, 'width'),
                                       SCALE_CAPTION.format(axis='width', larger='wider'))):
            if table:
                text += ['', f'### {title}', '', table, '', caption]
    timed = [r['seconds'] for r in runs if r['seconds'] is not None]
    if timed:
        text += ['', f"Wall time: {len(timed)} of the {len(runs)} runs recorded theirs (OUT_DIR/seconds), "
                 f"{sum(timed) / 3600:.2f} h in all ({statistics.fmean(timed) / 60:.1f} min per run on average)."]
    text += [''] + machine_lines(runs, groups) + commit_warnings(groups)
    conv, pretrained = [g for g in groups if is_conversion(g['config'])], {}
    if conv:
        table, pretrained = conversion_table(conv, args.baseline, args.recover_pct)
        text += ['', '### Conversion', '', table, '',
                 'Pretrained val loss: ' + '; '.join(f"{k}: {'unknown' if v is None else f'{v:.4f}'}"
                                                     for k, v in pretrained.items())
                 + (' (--baseline)' if args.baseline is not None else ' (the standard fine-tune at step 0)')
                 + '. Steps: of the mean curve over seeds, at the evaluation steps.']
    return '\n'.join(text), pretrained, best


def varying_settings(groups):
    """The settings that tell groups apart, beyond the table's columns (mode, variant, shape); the heads and the
    SwiGLU width too where the shape column determines them (they change with the width)."""
    values = lambda k, gs: {repr(g['config'].get(k)) for g in gs}
    shapes = {(g['config']['n_layer'], g['config']['n_embd']) for g in groups}
    by_shape = lambda k: all(len(values(k, [g for g in groups if (g['config']['n_layer'], g['config']['n_embd']) == sh])) == 1
                             for sh in shapes)
    return sorted(k for k in set().union(*(g['config'] for g in groups))
                  if k not in ('residual', 'variant', 'n_layer', 'n_embd') and len(values(k, groups)) > 1
                  and not (k in AXES['width'] and by_shape(k)))


def commit_warnings(groups):
    """A warning for each group whose runs come from more than one commit, naming the seeds of each commit."""
    lines = []
    for g in groups:
        if len(set().union(*(r['commits'] for r in g['runs']))) == 1:
            continue
        seeds = {}      # the commits of a run (more than one where it restarted from other code) -> its seeds
        for r in sorted(g['runs'], key=lambda r: r['config']['seed']):
            seeds.setdefault(', '.join(sorted(r['commits'])), []).append(r['config']['seed'])
        lines += ['\n' + f"**Warning:** the runs of {g['label']} come from different commits: "
                  + '; '.join(f"{c} (seed{'s' * (len(s) > 1)} {seed_ranges(s)})" for c, s in seeds.items())
                  + '. Their spread may be the code\'s, not the seeds\'.']
    return lines


def seed_ranges(seeds):
    """[0, 1, 2, 3, 7] -> '0-3, 7'"""
    runs = []
    for s in seeds:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ', '.join(f"{a}-{b}" if b > a + 1 else f"{a}, {b}" if b > a else f"{a}" for a, b in runs)


def make_groups(runs):
    """The runs grouped by settings (seeds together), in order of shape and mode, each with its summary and label."""
    order = list(RESIDUAL_MODES)
    groups = sorted(group_runs(runs), key=lambda g: (g['config']['n_layer'], g['config']['n_embd'],
                                                     order.index(g['config']['residual']), g['config']['variant'],
                                                     g['config'].get('learning_rate', 0)))
    varying = varying_settings(groups)
    shapes = len({(g['config']['n_layer'], g['config']['n_embd']) for g in groups}) > 1
    for g in groups:
        cfg = g['config']
        g['summary'] = summarize(g)
        g['label'] = ' '.join([cfg['residual']] + [f"({cfg['variant']})"] * (cfg['variant'] != 'paper')
                              + [f"{cfg['n_layer']}×{cfg['n_embd']}"] * shapes + [settings(g, varying)]).strip()
    return groups


def write_out(out, text, groups, pretrained, best, argv, figures, effect=None, unit='token', claims=None):
    """table.md (with the command, machine and time that made it), best_lr.txt for a grid, and the figures."""
    out.mkdir(parents=True, exist_ok=True)
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ''
    header = (f"Made by `python {shlex.join(['report.py', *argv])}` on {platform.platform()} ({os.cpu_count()} CPUs"
              f"{gpu}), torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.")
    (out / 'table.md').write_text(header + '\n\n' + text + '\n')
    written = ['table.md']
    if best:
        (out / 'best_lr.txt').write_text(''.join(f"{mode} {lr:g}\n" for mode, lr in best.items() if ' ' not in mode))
        written.append('best_lr.txt')
    if figures:
        written.append('val_loss.png')
        plot_val_loss(groups, out / 'val_loss.png', pretrained, unit)
        if plot_paired(groups, out / 'paired.png', unit):
            written.append('paired.png')
        if plot_claims(groups, out / 'claims.png', effect, unit, claims):
            written.append('claims.png')
        if plot_conversion(groups, out / 'conversion.png', pretrained, unit):
            written.append('conversion.png')
        if any(g['summary']['stats'] for g in groups):
            written.append('max_weight.png')
            plot_max_weight(groups, out / written[-1])
        for g in groups:
            if g['summary']['stats']:
                written.append(f"heatmap_{re.sub(r'[^A-Za-z0-9.-]+', '_', g['label']).strip('_')}.png")
                shape = f"{g['config']['n_layer']} layers × width {g['config']['n_embd']}"
                plot_heatmap(f"{g['label']} ({shape}), mean of {seeds(g)}", g['summary']['stats'], out / written[-1])
    print(f"wrote {', '.join(written)} to {out}", file=sys.stderr)


def claim_pairs(text):
    """'a-b,c-d' -> {('a', 'b'), ('c', 'd')} (--claims): claims the paired table makes, a mode against standard or one
    of CONTRASTS, written as their modes joined by '-'."""
    known = {(m, 'standard') for m in RESIDUAL_MODES if m != 'standard'} | {(a, b) for a, b, _ in CONTRASTS}
    pairs = {tuple(c.strip().split('-')) for c in text.split(',') if c.strip()}
    if not pairs or not pairs <= known:
        raise argparse.ArgumentTypeError(f"expected claims from {', '.join(sorted('-'.join(k) for k in known))}, "
                                         f"joined by commas; got {text!r}")
    return pairs


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('runs', nargs='+', metavar='RUN', help='train.py out_dirs (log.jsonl and ckpt), or runs saved by '
                                                       '--save_runs (RUN.json)')
    ap.add_argument('--save_runs', metavar='FOLDER', help="also save each run as FOLDER/<its folder's parent>/<its "
                    "folder>.json (settings, log, measured routing, wall time: no weights), readable here in its place")
    ap.add_argument('--out', help='folder to write table.md and the PNGs to (needs matplotlib)')
    ap.add_argument('--figures', action=argparse.BooleanOptionalAction, default=True,
                    help='with --out: the PNGs too (--no-figures: table.md only, e.g. the totals of a whole study)')
    ap.add_argument('--grid', action='store_true', help="the runs are a learning-rate grid: a table of each mode's "
                    "final val loss by learning rate instead of the paired tables, and (with --out) best_lr.txt")
    ap.add_argument('--routing', choices=['val', 'log'], default='val',
                    help="val: forward passes of each final checkpoint on its dataset's val batches; "
                         "log: the last logged training step (no model or data needed)")
    ap.add_argument('--batches', type=int, default=8, help='val batches (of the run\'s batch_size x block_size) for --routing=val')
    ap.add_argument('--data_root', help="where the runs' datasets are (default: each run's own data_root)")
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu', help='for --routing=val')
    ap.add_argument('--baseline', type=float, help="the pretrained model's val loss, for the conversion table "
                                                   "(default: the standard fine-tune's loss at step 0)")
    ap.add_argument('--margin', type=float, help="an equivalence margin m: a claim neither better nor worse is "
                    "'equivalent within ±m' where its 90%% paired-t interval lies inside (-m, +m), else 'cannot tell'")
    ap.add_argument('--claims', type=claim_pairs, help="the paired claims to test, and Holm over, e.g. "
                    "'delta_attnres-standard,delta_attnres-full_attnres' (default: every mode against standard and "
                    "the 2x2 contrasts)")
    ap.add_argument('--unit', choices=['byte', 'token'], help="what the losses are nats per (default: 'byte' where "
                    "every run's tokenizer is byte-level, from its log or its dataset's meta.json, else 'token')")
    ap.add_argument('--effect', type=float, help="an effect size (a difference of final val loss) to ask about: the "
                    "seeds each family needs to detect it, and a band of ± it in claims.png")
    ap.add_argument('--recover_pct', type=float, default=1.0, help='conversion: "recovered" = within this %% of the baseline')
    return ap.parse_args(argv)


def main(argv=None):
    argv = argv if argv is not None else sys.argv[1:]
    args = parse_args(argv)
    if args.out and args.figures:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("report.py --out draws the figures with matplotlib: pip install matplotlib") from None
    try:
        runs = [load_run(d) for d in args.runs]
        measure_routing(runs, args.routing, args.batches, args.data_root, args.device)
    except (ValueError, FileNotFoundError) as e:   # a missing, damaged or refused run or checkpoint: its message
        raise SystemExit(f"report.py: error: {e}") from None
    if args.save_runs:
        saved = [save_run(r, args.save_runs) for r in runs]
        print(f"saved {len(saved)} runs to {args.save_runs}", file=sys.stderr)
    groups = make_groups(runs)
    unit = token_unit(groups, args.data_root, args.unit)
    text, pretrained, best = tables(runs, groups, args, unit)
    print(text)
    if args.out:
        write_out(Path(args.out), text, groups, pretrained, best, argv, args.figures, args.effect, unit, args.claims)


if __name__ == '__main__':
    main()
