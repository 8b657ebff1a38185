"""Tests of report.py: on tiny train.py runs (2 modes x 2 seeds) and on hand-written logs."""
import importlib.util
import json
import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch

import report
from data import ShardLoader
from test_train import corpus, train, train_defaults, write_checkpoint  # noqa: F401 (corpus: the fixture)

MODES, SEEDS = ('standard', 'delta_block'), (1, 2)


@pytest.fixture(scope='module')
def runs(corpus, tmp_path_factory):
    """out_dirs of train.py runs, {(mode, seed): path}: 3 layers (Delta Block over 2 blocks), 6 steps."""
    root = tmp_path_factory.mktemp('runs')
    todo = {(m, s): root / f'{m}-{s}' for m in MODES for s in SEEDS}
    with ThreadPoolExecutor(2) as pool:   # two processes at a time: the machine has 2 cores
        list(pool.map(lambda k: train(corpus, todo[k], f'--residual={k[0]}', f'--seed={k[1]}', '--n_layer=3',
                                      '--max_iters=6', '--lr_decay_iters=6', '--eval_interval=3'), todo))
    return todo


def read_log(path):
    return [json.loads(line) for line in (Path(path) / 'log.jsonl').read_text().splitlines()]


def parse(printed):
    """The first markdown table of the output -> [{column: cell}]."""
    lines = [l for l in printed.split('\n\n')[0].splitlines() if l.startswith('|')]
    cells = [[c.strip() for c in l.strip('|').split('|')] for l in lines]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def spread(values, digits):
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def is_png(path, min_bytes=10_000):
    data = Path(path).read_bytes()
    return data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > min_bytes


def test_table_equals_the_logs_and_plots_are_written(runs, corpus, tmp_path, capsys):
    pytest.importorskip('matplotlib')
    import matplotlib.image
    out = tmp_path / 'report'
    # the standard runs first: a run without routing next to routed ones must not stop the routing figures
    report.main([str(runs[k]) for k in sorted(runs)] + ['--out', str(out), '--batches=3'])
    printed = capsys.readouterr().out
    rows = {r['mode']: r for r in parse(printed)}
    assert set(rows) == set(MODES)                  # seeds grouped, modes not
    ppl = {}
    for mode, row in rows.items():
        logs = [read_log(runs[mode, s]) for s in SEEDS]
        final = [[r for r in log if 'final_val_loss' in r][-1] for log in logs]     # the whole val split at the end
        assert [r['step'] for r in final] == [6, 6]
        ppl[mode] = [math.exp(r['final_val_loss']) for r in final]
        assert (row['seeds'], row['steps'], row['variant'], row['layers×width']) == ('2', '6', 'paper', '3×32')
        assert row['val loss'] == spread([r['final_val_loss'] for r in final], 4)
        assert row['val ppl'] == spread(ppl[mode], 2)
        tok_s = [np.mean([r['tok_per_s'] for r in log if 'tok_per_s' in r][1:]) for log in logs]
        assert row['tok/s'] == f"{np.mean(tok_s):,.0f}"
        assert row['mem GiB'] == f"{np.mean([max(r['mem_gib'] for r in log if 'mem_gib' in r) for log in logs]):.2f}"
    assert rows['standard']['Δ% ppl vs standard'] == '—' and rows['standard']['max weight'] == '—'
    delta = 100 * (statistics.fmean(ppl['delta_block']) / statistics.fmean(ppl['standard']) - 1)
    assert rows['delta_block']['Δ% ppl vs standard'] == f"{delta:+.2f}"

    # routing: each seed's final checkpoint, one forward over its first 3 val batches at once
    from checkpoints import load_model
    x = torch.cat([torch.from_numpy(x) for x, _ in ShardLoader(str(corpus / 'tiny'), 'val', 4, 32).val_batches(3)])
    overall, deep = [], []
    for s in SEEDS:
        model, _ = load_model('resume', str(runs['delta_block', s]))
        with torch.no_grad():
            _, _, stats = model.eval()(x, stats=True)
        # 6 sublayer sites; the first routes over E alone; Delta Block has no 'final' site
        assert list(stats) == [f'layers.{i}.{k}' for i in range(3) for k in ('attn', 'mlp')]
        mw = [stats[site]['max_weight'].item() for site in list(stats)[1:]]
        overall.append(np.mean(mw))
        deep.append(np.mean(mw[-1:]))                 # the deepest third of 5 sites: the last one
    assert rows['delta_block']['max weight'] == spread(overall, 3)
    assert rows['delta_block']['max weight, deep third'] == spread(deep, 3)
    # its floor: 3 layers in 2 blocks of 2, so the last site (layers.2.mlp) mixes E, block 0 and the open block 1
    assert rows['delta_block']['uniform 1/N, deep third'] == f"{1 / 3:.3f}"
    assert 'on 3 val batches' in printed

    # table.md: a header line with the command, machine and date, then what was printed
    header, rest = (out / 'table.md').read_text().split('\n\n', 1)
    assert header.startswith('Made by `python report.py ') and f"--out {out}" in header
    assert 'CPUs' in header and f"torch {torch.__version__}" in header and 'UTC' in header
    assert rest.strip() == printed.strip()
    pngs = sorted(p.name for p in out.glob('*.png'))
    assert pngs == ['heatmap_delta_block.png', 'max_weight.png', 'val_loss.png']   # no heatmap for standard
    for png in pngs:
        assert is_png(out / png)
        img = matplotlib.image.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img[..., :3].std() > 0.05   # not blank


def test_saved_runs_make_the_same_table_without_their_folders(runs, tmp_path, capsys):
    dirs = [str(runs[k]) for k in sorted(runs)]
    report.main(dirs + ['--batches=3', f'--save_runs={tmp_path / "saved"}'])
    from_dirs = capsys.readouterr().out
    # FOLDER/<parent>/<run>.json, one per run; the log without the per-step routing, except its last
    saved = {k: tmp_path / 'saved' / runs[k].parent.name / f'{runs[k].name}.json' for k in runs}
    for k, path in saved.items():
        run = json.loads(path.read_text())
        log = read_log(runs[k])
        routed = k[0] != 'standard'
        assert run['dir'] == str(runs[k]) and run['config']['seed'] == k[1]
        assert run['routing_batches'] == (3 if routed else None) and (run['routing'] is not None) == routed
        assert [{f: v for f, v in r.items() if f != 'routing'} for r in run['records']] == \
               [{f: v for f, v in r.items() if f != 'routing'} for r in log]
        with_routing = [r['routing'] for r in run['records'] if r.get('routing')]
        assert with_routing == ([[r for r in log if r.get('routing')][-1]['routing']] if routed else [])
    report.main([str(p) for p in saved.values()] + ['--batches=3', f'--out={tmp_path / "table"}', '--no-figures'])
    assert capsys.readouterr().out == from_dirs        # the same table: nothing read from the folders
    assert [p.name for p in (tmp_path / 'table').iterdir()] == ['table.md']     # --no-figures: no PNGs
    assert (tmp_path / 'table' / 'table.md').read_text().split('\n\n', 1)[1].strip() == from_dirs.strip()
    with pytest.raises(SystemExit, match='measured on 3 val batches, not --batches=8'):
        report.main([str(p) for p in saved.values()])


def fake_run(path, seed, val, config=None, routing=None, commit='0123456789abcdef', cpu=None):
    """An out_dir as train.py writes it, with hand-picked numbers: the provenance record, eval records
    {step: val_loss}, a train record after every eval (tok/s 1000 * step, memory 1 GiB) and a checkpoint that holds
    the settings only."""
    path.mkdir(parents=True)
    cfg = {**train_defaults(), **(config or {}), 'seed': seed, 'out_dir': str(path), 'device': 'cpu'}
    records = [dict(step=0, provenance=dict(commit=commit, dirty=False, **({'cpu': cpu} if cpu else {})))]
    for step, loss in val.items():
        records.append(dict(step=step, val_loss=loss, val_ppl=math.exp(loss), val_tokens=100))
        records.append(dict(step=step + 1, loss=loss, tok_per_s=1000.0 * (step + 1), mem_gib=1.0, routing=routing or {}))
    (path / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    write_checkpoint(path / 'step_000000', {}, {}, config=cfg)
    return str(path)


def test_grouping_and_conversion_table(tmp_path, capsys):
    plots = importlib.util.find_spec('matplotlib') is not None
    pretrained = tmp_path / 'qwen3'   # fine-tuned runs: init_from is a checkpoint directory
    conv = dict(init_from=str(pretrained), n_layer=4)
    route = {'layers.0.attn': dict(max_weight=1.0, weights=[1.0]),
             'layers.0.mlp': dict(max_weight=0.9, weights=[0.5, 0.5]),
             'layers.1.attn': dict(max_weight=0.7, weights=[0.2, 0.3, 0.5])}
    dirs = [fake_run(tmp_path / 'std1', 1, {0: 3.0, 100: 2.9, 200: 2.8}, conv),
            fake_run(tmp_path / 'std2', 2, {0: 3.0, 100: 2.92, 200: 2.82}, conv),
            fake_run(tmp_path / 'gate1', 1, {0: 3.0, 100: 2.95, 200: 2.85},
                     {**conv, 'residual': 'delta_block', 'res_gate': True}, route),
            fake_run(tmp_path / 'nogate', 1, {0: 3.5, 100: 3.05, 200: 3.02}, {**conv, 'residual': 'delta_block'}, route),
            fake_run(tmp_path / 'attnres', 1, {0: 4.0, 100: 3.5, 200: 3.2}, {**conv, 'residual': 'attnres'}, route),
            # from scratch, two learning rates: two groups, and the lr is shown
            fake_run(tmp_path / 'a1', 1, {0: 5.0, 10: 4.0}, dict(learning_rate=1e-3)),
            # a run continued after a stop (init_from='auto') is one more seed of the same experiment
            fake_run(tmp_path / 'a2', 2, {0: 5.0, 10: 4.2}, dict(learning_rate=1e-3, init_from='auto')),
            fake_run(tmp_path / 'b1', 1, {0: 5.0, 10: 3.9}, dict(learning_rate=2e-3))]
    report.main(dirs + ['--routing=log'])
    printed = capsys.readouterr().out
    rows = parse(printed)
    # by shape (the fine-tunes have 4 layers, the scratch runs train.py's default 12), then mode
    assert [r['mode'] for r in rows] == ['standard', 'attnres', 'delta_block', 'delta_block', 'standard', 'standard']
    by = {(r['mode'], r['settings']): r for r in rows}
    std = by['standard', 'init_from=qwen3 learning_rate=0.0006']
    assert std['seeds'] == '2' and std['val loss'] == spread([2.8, 2.82], 4) and std['layers×width'] == '4×768'
    gate = by['delta_block', 'init_from=qwen3 learning_rate=0.0006 res_gate=True']
    assert gate['Δ% ppl vs standard'] == f"{100 * (math.exp(2.85) / statistics.fmean([math.exp(2.8), math.exp(2.82)]) - 1):+.2f}"
    # routing from the log: sites with one source left out; deep third of 2 sites = the last one
    assert gate['max weight'] == f"{(0.9 + 0.7) / 2:.3f}" and gate['max weight, deep third'] == '0.700'
    assert std['tok/s'] == f"{np.mean([101000, 201000]):,.0f}"    # the first train record left out
    assert by['standard', 'init_from=scratch learning_rate=0.001']['seeds'] == '2'
    assert by['standard', 'init_from=scratch learning_rate=0.002']['val loss'] == '3.9000'

    conversion = printed.split('### Conversion')[1]
    table = {r['run']: r for r in parse(conversion.strip())}
    assert len(table) == 4
    base = '4×768 init_from=qwen3 learning_rate=0.0006'   # labels: the shape too, as shapes differ
    assert table[f'delta_block {base} res_gate=True']['val loss at step 0'] == '3.000000'
    assert table[f'standard {base}']['step 0, per seed'] == '3.0000 3.0000' and \
        table[f'attnres {base}']['step 0, per seed'] == '4.0000'
    # recovery: the first step within 1% of the pretrained loss (3.0: the standard fine-tune at step 0)
    col = 'back within 1% of the pretrained loss at step'
    assert table[f'standard {base}'][col] == '0'
    assert table[f'delta_block {base} res_gate=False'][col] == '200'      # 3.02 <= 3.03
    assert table[f'attnres {base}'][col] == 'not by 200'
    assert table[f'attnres {base}']['final val loss'] == '3.200000 (step 200)'
    assert f'{pretrained}: 3.0000 (the standard fine-tune at step 0)' in conversion
    report.main(dirs + ['--routing=log', '--baseline=3.5', '--recover_pct=0'] + ['--out', str(tmp_path / 'fig')] * plots)
    table = {r['run']: r for r in parse(capsys.readouterr().out.split('### Conversion')[1].strip())}
    assert table[f'attnres {base}']['back within 0% of the pretrained loss at step'] == '100'
    if plots:   # one heatmap per routed group, from the logged routing; the conversion's jump and end, seed by seed
        assert len(list((tmp_path / 'fig').glob('heatmap_*.png'))) == 3
        assert is_png(tmp_path / 'fig' / 'conversion.png')
        assert all(is_png(p) for p in (tmp_path / 'fig').glob('*.png'))


def test_errors_name_the_run(tmp_path):
    # one line each (report.py: error: ...), no traceback
    with pytest.raises(SystemExit, match=f'report.py: error: no checkpoint in {tmp_path}'):
        (tmp_path / 'log.jsonl').write_text('')
        report.main([str(tmp_path)])
    run = fake_run(tmp_path / 'r', 1, {0: 3.0}, dict(residual='attnres', data_root=str(tmp_path / 'nowhere')))
    with pytest.raises(SystemExit, match='report.py: error: .*not here: pass --data_root'):
        report.main([run])


def test_the_commit_of_each_group_and_a_warning_when_they_differ(tmp_path, capsys):
    dirs = [fake_run(tmp_path / 's1', 1, {0: 5.0, 10: 4.0}), fake_run(tmp_path / 's2', 2, {0: 5.0, 10: 4.1}),
            fake_run(tmp_path / 'd1', 1, {0: 5.0, 10: 3.9}, dict(residual='delta_block')),
            fake_run(tmp_path / 'd2', 2, {0: 5.0, 10: 3.8}, dict(residual='delta_block'), commit='fedcba9876543210')]
    report.main(dirs + ['--routing=log'])
    printed = capsys.readouterr().out
    rows = {r['mode']: r for r in parse(printed)}
    assert rows['standard']['commit'] == '0123456789'
    assert rows['delta_block']['commit'] == '0123456789, fedcba9876'
    assert ("**Warning:** the runs of delta_block come from different commits: 0123456789 (seed 1); "
            "fedcba9876 (seed 2).") in printed
    assert report.seed_ranges([0, 1, 2, 3, 5, 6, 8, 10, 11, 12]) == '0-3, 5, 6, 8, 10-12'
    assert report.seed_ranges([4]) == '4'
    assert printed.count('**Warning:**') == 1


def test_the_machines_and_one_warning_per_comparison_and_pair_of_machines(tmp_path, capsys):
    # seed 0: attnres on another CPU than its standard; seed 1: all on one; a 4-layer standard of seed 1 on a third
    # CPU (the 12-layer one's shallower pair); a run from before the CPU was recorded pairs with anything
    runs = [('standard', 12, 0, 'A'), ('attnres', 12, 0, 'B'), ('standard', 12, 1, 'A'), ('attnres', 12, 1, 'A'),
            ('standard', 4, 1, 'C'), ('attnres', 12, 2, None), ('standard', 12, 2, 'A'),
            ('attnres', 12, 3, 'B'), ('standard', 12, 3, 'A'), ('attnres', 12, 4, 'C'), ('standard', 12, 4, 'A')]
    dirs = [fake_run(tmp_path / f'{m}{L}_{s}', s, {0: 5.0, 100: 2.0}, dict(residual=m, n_layer=L), cpu=cpu)
            for m, L, s, cpu in runs]
    report.main(dirs + ['--routing=log'])
    printed = capsys.readouterr().out
    # seeds 3 and 4: attnres on B and on C again, against standard on A: one warning per pair of machines, its seeds
    assert 'Machines (from the logs): A: 6 runs; B: 2 runs; C: 2 runs; not recorded: 1 run.' in printed
    assert printed.count('**Warning:**') == 3
    assert ('**Warning:** seeds 0, 3 of attnres 12×768 ran on B and their pairs in standard 12×768 on A: runs on '
            'different machines are not bit-equal, so these differences are partly the machines\'.') in printed
    assert ('**Warning:** seed 4 of attnres 12×768 ran on C and its pair in standard 12×768 on A: runs on different '
            'machines are not bit-equal, so this difference is partly the machines\'.') in printed
    assert '**Warning:** seed 1 of standard 12×768 ran on A and its pair in standard 4×768 on C' in printed


T_975_DF2 = 4.302652729911275     # the 97.5% quantile of Student's t with 2 degrees of freedom (3 seeds)


def paired_t(d):
    """mean, 95% interval and two-sided p of 3 paired differences, by hand: with 2 degrees of freedom the t
    distribution's CDF is 1/2 + t / (2 sqrt(t^2 + 2)), so p = 1 - |t| / sqrt(t^2 + 2)."""
    m, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(3)
    t = m / se
    return m, (m - T_975_DF2 * se, m + T_975_DF2 * se), 1 - abs(t) / math.sqrt(t * t + 2)


def test_paired_differences_against_standard_seed_by_seed(tmp_path, capsys):
    # seeds 0-2 of standard; attnres lower on every seed by far more than the spread, delta_block on two of three;
    # full_attnres has only seeds 1 and 2 (paired with those), one seed of a 4-layer standard has no pair here
    std = {0: 2.00, 1: 2.10, 2: 1.90}
    modes = {'attnres': {0: 1.90, 1: 2.01, 2: 1.79}, 'delta_block': {0: 1.95, 1: 2.12, 2: 1.80},
             'full_attnres': {1: 2.30, 2: 2.05}}
    # (seed 2 of standard ran compiled: how a run executes does not split a group)
    dirs = [fake_run(tmp_path / f'standard{s}', s, {0: 5.0, 100: v}, dict(compile=s == 2)) for s, v in std.items()]
    dirs += [fake_run(tmp_path / f'{m}{s}', s, {0: 5.0, 100: v}, dict(residual=m)) for m, by in modes.items()
             for s, v in by.items()]
    dirs += [fake_run(tmp_path / 'delta4', 0, {0: 5.0, 100: 1.0}, dict(residual='delta_block', n_layer=4))]
    plots = importlib.util.find_spec('matplotlib') is not None
    for i, d in enumerate(dirs[:3]):                                  # wall times where the study script wrote them
        (Path(d) / 'seconds').write_text(f'{60 * (i + 1)}\n')
    report.main(dirs + ['--routing=log'])
    printed = capsys.readouterr().out
    assert 'Wall time: 3 of the 12 runs recorded theirs (OUT_DIR/seconds), 0.10 h in all (2.0 min per run' in printed
    paired = printed.split('### Paired, seed by seed')[1].strip()
    rows = {r['claim'].removesuffix(' 12×768'): r for r in parse(paired)}     # labels carry the shape: two shapes
    # the 4-layer run has no standard to pair; of the 2x2 only delta_block - attnres has both sides (full_attnres -
    # attnres has 2 seeds: no interval)
    contrast = 'delta_block − attnres (add − replace, block sources)'
    assert set(rows) == {'attnres', 'delta_block', 'full_attnres', contrast,
                         'full_attnres − attnres (sublayer − block sources, replace)'}
    d = {'attnres': [1.90 - 2.00, 2.01 - 2.10, 1.79 - 1.90], 'delta_block': [1.95 - 2.00, 2.12 - 2.10, 1.80 - 1.90],
         contrast: [1.95 - 1.90, 2.12 - 2.01, 1.80 - 1.79]}
    stats = {k: paired_t(v) for k, v in d.items()}
    # Holm over the family of three tested claims: the smallest p times 3, the next times 2, the largest times 1
    ranked = sorted(stats, key=lambda k: stats[k][2])
    holm = {}
    for i, k in enumerate(ranked):
        holm[k] = min(1.0, max([(3 - i) * stats[k][2]] + [holm[j] for j in ranked[:i]]))
    for k, (m, (lo, hi), p) in stats.items():
        r = rows[k]
        assert r['Δ val loss per seed'] == ' '.join(f"{x:+.4f}" for x in d[k]) and r['seeds'] == '0, 1, 2'
        assert (r['mean'], r['95% interval'], r['p'], r['p, Holm']) == \
            (f"{m:+.4f}", f"[{lo:+.4f}, {hi:+.4f}]", f"{p:.3f}", f"{holm[k]:.3f}")
    assert holm['attnres'] < 0.05 and rows['attnres']['verdict'] == 'better'
    assert holm['delta_block'] > 0.05 and rows['delta_block']['verdict'] == 'inside the noise'
    assert rows[contrast]['verdict'] == 'inside the noise'
    r = rows['full_attnres']
    assert (r['seeds'], r['mean'], r['95% interval'], r['verdict']) == ('1, 2', '+0.1750', '—', 'fewer than 3 seeds')
    # with a 4-layer standard run the 4-layer delta_block has its pair too, and the groups vary in depth: a figure
    dirs += [fake_run(tmp_path / 'standard4', 0, {0: 5.0, 100: 1.5}, dict(n_layer=4))]
    report.main(dirs + ['--routing=log'] + ['--out', str(tmp_path / 'fig')] * plots)
    rows = {r['claim']: r for r in parse(capsys.readouterr().out.split('seed by seed')[1].strip())}
    assert rows['delta_block 4×768']['Δ val loss per seed'] == '-0.5000'
    assert rows['delta_block 4×768']['verdict'] == 'fewer than 3 seeds'
    if plots:
        assert is_png(tmp_path / 'fig' / 'paired.png')
        assert is_png(tmp_path / 'fig' / 'claims.png')      # the 12-layer family has claims of 3 seeds
    # under the family's table, its power: the pooled SD of the three tested claims, and what 3 seeds detect at
    # Holm's strictest level, 0.05 / 3
    sd = math.sqrt(np.mean([np.var(v, ddof=1) for v in d.values()]))
    line = next(l for l in paired.splitlines() if l.startswith('Power:'))
    assert f"pooled SD of {sd:.4f} nats per token" in line and "(0.05/3 = 0.0167)" in line
    assert f"effect of {report.detectable(sd, 3, 0.05 / 3):.4f} or more" in line


def test_power_agrees_with_the_textbook_and_a_simulation():
    # a one-sample (paired) two-sided t at 5%: an effect of half an SD needs 34 pairs for 80% power (G*Power's table)
    assert report.seeds_needed(0.5, 1.0, 0.05) == 34
    assert report.power_of(0.5, 1.0, 33, 0.05) < 0.8 <= report.power_of(0.5, 1.0, 34, 0.05)
    # the smallest effect 5 seeds detect at Holm's strictest level of 9 claims: simulated, 80% of the tests find it
    sd, n, alpha = 0.0157, 5, 0.05 / 9
    effect = report.detectable(sd, n, alpha)
    draws = np.random.default_rng(0).normal(effect, sd, size=(40_000, n))
    found = (scipy.stats.ttest_1samp(draws, 0.0, axis=1).pvalue < alpha).mean()
    assert abs(found - 0.8) < 0.01, (effect, found)
    # study v3's design (results/README.md, "Pilot, then N"): seeds for 0.008 at 0.025 from a pilot SD of
    # 0.0157 (v2's), 0.010 and 0.0075, and what the cap's 41 seeds detect at v2's SD
    assert [report.seeds_needed(0.008, sd, 0.025) for sd in (0.0157, 0.010, 0.0075)] == [40, 18, 12]
    assert round(report.detectable(0.0157, 41, 0.025), 4) == 0.0078


def test_each_mode_at_its_own_learning_rate_and_the_grid(tmp_path, capsys):
    # a grid: standard and delta_block at three learning rates, one seed; delta_block's best is at the grid's edge
    grid = {('standard', 1.5e-3): 2.05, ('standard', 3e-3): 2.00, ('standard', 6e-3): 2.02,
            ('delta_block', 1.5e-3): 2.10, ('delta_block', 3e-3): 2.03, ('delta_block', 6e-3): 1.99}
    dirs = [fake_run(tmp_path / f'{m}_{lr}', 100, {0: 5.0, 100: v}, dict(residual=m, learning_rate=lr, min_lr=lr / 10))
            for (m, lr), v in grid.items()]
    report.main(dirs + ['--routing=log', '--grid', '--out', str(tmp_path / 'grid'), '--no-figures'])
    rows = {r['mode']: r for r in parse(capsys.readouterr().out.split('### Learning-rate grid')[1].strip())}
    assert rows['standard']['lr 0.003'] == '**2.0000**' and rows['standard']['best'] == '0.003'
    assert rows['delta_block']['lr 0.006'] == '**1.9900**' and rows['delta_block']['best'] == '0.006 (edge)'
    assert (tmp_path / 'grid' / 'best_lr.txt').read_text() == 'standard 0.003\ndelta_block 0.006\n'
    # the verdict runs, each mode at its own rate: paired with the one standard group despite the different rates;
    # the whole-split loss (final_val_loss) is the one compared, not the last evaluation
    dirs = []
    for s, (a, b) in enumerate([(2.00, 1.90), (2.10, 2.01), (1.90, 1.79)]):
        for m, lr, v in (('standard', 3e-3, a), ('delta_block', 6e-3, b)):
            path = fake_run(tmp_path / f'{m}_s{s}', s, {0: 5.0, 100: v + 1}, dict(residual=m, learning_rate=lr, min_lr=lr / 10))
            with open(Path(path) / 'log.jsonl', 'a') as f:
                f.write(json.dumps(dict(step=100, final_val_loss=v, final_val_tokens=1000)) + '\n')
            dirs.append(path)
    report.main(dirs + ['--routing=log'])
    printed = capsys.readouterr().out
    rows = {r['claim']: r for r in parse(printed.split('### Paired, seed by seed')[1].strip())}
    assert [r['Δ val loss per seed'] for r in rows.values()] == ['-0.1000 -0.0900 -0.1100'], rows
    assert {r['mode']: r['val loss'] for r in parse(printed)} == {'standard': spread([2.00, 2.10, 1.90], 4),
                                                                   'delta_block': spread([1.90, 2.01, 1.79], 4)}
    # and at 4 layers, standard at another tuned rate: each depth pairs with the other despite the rates
    for s, v in enumerate([2.10, 2.20, 2.00]):
        dirs.append(fake_run(tmp_path / f'standard4_s{s}', s, {0: 5.0, 100: v},
                             dict(n_layer=4, learning_rate=6e-3, min_lr=6e-4)))
    report.main(dirs + ['--routing=log'])
    rows = parse(capsys.readouterr().out.split('### Deeper against shallower, seed by seed')[1].strip())
    assert [(r['run − shallower'].split(' ')[0], r['Δ val loss per seed']) for r in rows] == \
        [('standard', '-0.1000 -0.1000 -0.1000')]


def test_a_grid_picks_no_rate_from_means_over_different_seeds(tmp_path, capsys):
    # three tuning seeds for delta_block at every rate; standard's 6e-3 lacks seed 102. Over seeds 100-101 alone 6e-3
    # would win (1.95 against 2.00), over all it does not: a mean over fewer seeds is no pick
    loss = {('standard', 3e-3): [2.00, 2.00, 2.00], ('standard', 6e-3): [1.95, 1.95],
            ('delta_block', 3e-3): [2.02, 2.04, 2.00], ('delta_block', 6e-3): [2.00, 2.01, 2.02]}
    dirs = [fake_run(tmp_path / f'{m}_{lr}_{s}', s, {0: 5.0, 100: v}, dict(residual=m, learning_rate=lr, min_lr=lr / 10))
            for (m, lr), vs in loss.items() for s, v in zip((100, 101, 102), vs)]
    report.main(dirs + ['--routing=log', '--grid', '--out', str(tmp_path / 'grid'), '--no-figures'])
    rows = {r['mode']: r for r in parse(capsys.readouterr().out.split('### Learning-rate grid')[1].strip())}
    assert rows['standard']['lr 0.003'] == '2.0000 (3)' and rows['standard']['lr 0.006'] == '**1.9500** (2)'
    assert rows['standard']['best'] == '0.006 (incomplete: seeds differ by rate)'
    assert rows['delta_block']['lr 0.003'] == '2.0200 (3)' and rows['delta_block']['best'] == '0.006 (edge)'
    assert (tmp_path / 'grid' / 'best_lr.txt').read_text() == 'delta_block 0.006\n'


def test_deeper_against_shallower_seed_by_seed(tmp_path, capsys):
    # standard at 4, 12 and 24 layers (seeds 0-2); delta_block at 4 and 24 layers only (its pair skips the missing
    # depth); 24-layer standard lacks seed 2. Intervals and p, no verdicts (results/README.md's rule)
    loss = {('standard', 4): {0: 2.00, 1: 2.10, 2: 1.90}, ('standard', 12): {0: 1.80, 1: 1.95, 2: 1.70},
            ('standard', 24): {0: 1.75, 1: 1.97}, ('delta_block', 4): {0: 2.05, 1: 2.00},
            ('delta_block', 24): {0: 1.85, 1: 2.20}}
    dirs = [fake_run(tmp_path / f'{m}{L}_{s}', s, {0: 5.0, 100: v}, dict(residual=m, n_layer=L))
            for (m, L), by in loss.items() for s, v in by.items()]
    report.main(dirs + ['--routing=log'])
    rows = {r['run − shallower']: r for r in parse(capsys.readouterr().out.split('### Deeper against shallower, seed by seed')[1].strip())}
    assert set(rows) == {'standard 12×768 − 4×768', 'standard 24×768 − 12×768', 'delta_block 24×768 − 4×768'}
    d = [1.80 - 2.00, 1.95 - 2.10, 1.70 - 1.90]
    m, (lo, hi), p = paired_t(d)
    r = rows['standard 12×768 − 4×768']
    assert (r['Δ val loss per seed'], r['mean'], r['95% interval'], r['p']) == \
        (' '.join(f"{x:+.4f}" for x in d), f"{m:+.4f}", f"[{lo:+.4f}, {hi:+.4f}]", f"{p:.3f}")
    assert 'verdict' not in r
    r = rows['standard 24×768 − 12×768']
    assert (r['seeds'], r['Δ val loss per seed'], r['95% interval']) == ('0, 1', '-0.0500 +0.0200', '—')
    assert rows['delta_block 24×768 − 4×768']['Δ val loss per seed'] == '-0.2000 +0.2000'


def test_wider_against_narrower_seed_by_seed(tmp_path, capsys):
    # standard and delta_block at width 768 (12 heads) and 1024 (16 heads, a wider SwiGLU, standard at its own tuned
    # rate): each pairs with its own mode one width down; a 4-layer standard is a depth pair, not a width one
    wide = dict(n_embd=1024, n_head=16, n_kv_head=16, intermediate_size=2816)
    loss = {('standard', 'narrow'): {0: 2.00, 1: 2.10, 2: 1.90}, ('standard', 'wide'): {0: 1.90, 1: 1.95, 2: 1.85},
            ('delta_block', 'narrow'): {0: 1.95, 1: 2.05, 2: 1.85}, ('delta_block', 'wide'): {0: 1.80, 1: 1.98, 2: 1.70}}
    dirs = [fake_run(tmp_path / f'{m}_{w}_{s}', s, {0: 5.0, 100: v},
                     dict(residual=m, **(wide if w == 'wide' else {}),
                          **(dict(learning_rate=3e-4, min_lr=3e-5) if (m, w) == ('standard', 'wide') else {})))
            for (m, w), by in loss.items() for s, v in by.items()]
    dirs += [fake_run(tmp_path / f'standard4_{s}', s, {0: 5.0, 100: 2.2}, dict(n_layer=4)) for s in range(3)]
    report.main(dirs + ['--routing=log'])
    printed = capsys.readouterr().out
    rows = {r['run − narrower']: r for r in parse(printed.split('### Wider against narrower, seed by seed')[1].strip())}
    assert set(rows) == {'standard 12×1024 learning_rate=0.0003 min_lr=3e-05 − 12×768', 'delta_block 12×1024 learning_rate=0.0006 min_lr=6e-05 − 12×768'}
    d = [1.80 - 1.95, 1.98 - 2.05, 1.70 - 1.85]
    m, (lo, hi), p = paired_t(d)
    r = rows['delta_block 12×1024 learning_rate=0.0006 min_lr=6e-05 − 12×768']
    assert (r['Δ val loss per seed'], r['mean'], r['95% interval'], r['p']) == \
        (' '.join(f"{x:+.4f}" for x in d), f"{m:+.4f}", f"[{lo:+.4f}, {hi:+.4f}]", f"{p:.3f}")
    assert rows['standard 12×1024 learning_rate=0.0003 min_lr=3e-05 − 12×768']['Δ val loss per seed'] == \
        '-0.1000 -0.1500 -0.0500'
    depth = parse(printed.split('### Deeper against shallower, seed by seed')[1].strip())
    assert [r['run − shallower'].split(' − ')[1] for r in depth] == ['4×768']


def test_every_committed_table_regenerates(tmp_path, monkeypatch):
    # results/**/table.md: each one's first line is the report.py command that wrote it from committed runs; run
    # again, it must write the same tables (the header line aside: it holds the machine and the time)
    import re
    import shlex
    monkeypatch.chdir(Path(__file__).parent)     # the commands name the runs relative to the repository
    tables = sorted(Path('results').glob('**/table.md'))
    assert tables
    for i, table in enumerate(tables):
        head, body = table.read_text().split('\n', 1)
        argv = shlex.split(re.search(r'^Made by `python report\.py (.*?)` on ', head).group(1))
        out = tmp_path / str(i)
        report.main([a for a in argv if not a.startswith('--out') and a != '--no-figures'] + [f'--out={out}', '--no-figures'])
        assert (out / 'table.md').read_text().split('\n', 1)[1] == body, table


def test_the_loss_unit_comes_from_the_runs_not_from_this_machines_data(runs, corpus, tmp_path):
    # a run's log names its dataset's tokenizer, so a report made where the data is absent (CI, a saved run) still
    # says nats per byte for byte-level runs; runs that recorded none fall back to the dataset's meta.json, then 'token'
    loaded = [report.load_run(runs[k]) for k in sorted(runs)]
    assert all(read_log(runs[k])[0]['tokenizer'] == 'byte' for k in runs)
    groups = report.make_groups(loaded)
    nowhere = tmp_path / 'no_data'
    assert report.token_unit(groups, data_root=nowhere) == 'byte'
    assert report.token_unit(groups, data_root=nowhere, unit='token') == 'token'
    for run in loaded:      # as a run from before the tokenizer was recorded
        run['records'] = [{k: v for k, v in r.items() if k != 'tokenizer'} for r in run['records']]
    assert report.token_unit(groups, data_root=nowhere) == 'token'
    dataset = nowhere / loaded[0]['config']['dataset']
    dataset.mkdir(parents=True)
    (dataset / 'meta.json').write_text((corpus / 'tiny' / 'meta.json').read_text())     # a byte-level dataset's
    assert report.token_unit(groups, data_root=nowhere) == 'byte'


def test_an_equivalence_margin_and_the_claims_a_study_registered(runs, capsys):
    # --margin: a claim that is neither better nor worse is equivalent within ±m exactly where two one-sided t tests
    # at 0.05 both reject (computed here with scipy's one-sided tests, not the interval report.py uses)
    rng = np.random.default_rng(0)
    for center, spread in ((0.001, 0.002), (0.004, 0.003), (0.0, 0.02), (0.006, 0.001), (-0.03, 0.004)):
        d = list(center + spread * rng.standard_normal(6))
        row = report.paired_rows([('claim', dict(enumerate(d)))], margin=0.008)[0]
        lower = scipy.stats.ttest_1samp(d, -0.008, alternative='greater').pvalue
        upper = scipy.stats.ttest_1samp(d, 0.008, alternative='less').pvalue
        if scipy.stats.ttest_1samp(d, 0.0).pvalue < 0.05:
            assert row[-1] in ('better', 'worse')
        elif max(lower, upper) < 0.05:
            assert row[-1].startswith('equivalent within ±0.008 (90%: ['), (center, spread, row[-1])
        else:
            assert row[-1].startswith('cannot tell (90%: ['), (center, spread, row[-1])
    verdicts = [report.paired_rows([('c', dict(enumerate(c + s * rng.standard_normal(6))))], margin=0.008)[0][-1]
                for c, s in ((0.001, 0.002), (0.0, 0.02))]
    assert verdicts[0].startswith('equivalent') and verdicts[1].startswith('cannot tell')   # both kinds were met
    assert report.paired_rows([('c', {0: 0.01, 1: -0.01, 2: 0.02})])[0][-1] == 'inside the noise'    # no margin

    # --claims: only the registered contrasts are tested, and Holm runs over them alone
    groups = report.make_groups([report.load_run(runs[k]) for k in sorted(runs)])
    assert [len(p) for _, p in report.families(groups)] == [1]
    assert [len(p) for _, p in report.families(groups, {('delta_block', 'standard')})] == [1]
    assert report.families(groups, {('delta_attnres', 'standard')}) == []
    assert report.parse_args(['x', '--claims=delta_attnres-standard,delta_attnres-full_attnres']).claims == \
        {('delta_attnres', 'standard'), ('delta_attnres', 'full_attnres')}
    report.main([str(runs[k]) for k in sorted(runs)] + ['--claims=delta_block-standard', '--margin=0.008'])
    assert 'With an equivalence margin of ±0.008 (--margin)' in capsys.readouterr().out
    for wrong in ('delta_attnres-nonsense', 'standard-delta_attnres', 'attnres-delta_attnres'):  # unknown, or no claim
        with pytest.raises(SystemExit):
            report.parse_args(['x', f'--claims={wrong}'])
        assert "expected claims from attnres-standard, delta_attnres-delta_block" in capsys.readouterr().err


def test_study_v3s_number_of_seeds_follows_from_its_pilot():
    # results/study_v3/n_seeds.txt, committed before any verdict run: N is the fewest seeds with 80% power for
    # m = 0.008 nats per byte at Holm's strictest level (0.05 / 2) from the larger of the pilot's two claim SDs, at
    # most what 20 hours of one thread allow at the grid's median run times per arm (results/README.md, study v3).
    # Recomputed here from the saved runs' own numbers, not through report.py's loaders.
    runs = Path(__file__).parent / 'results' / 'runs'
    saved = lambda path: json.loads(path.read_text())
    final = {p.stem: [r['final_val_loss'] for r in saved(p)['records'] if 'final_val_loss' in r][-1]
             for p in (runs / 'v3_pilot').glob('*.json')}
    assert len(final) == 15     # three arms x seeds 200-204
    sd = max(statistics.stdev(final[f'delta_attnres_s{s}'] - final[f'{other}_s{s}'] for s in range(200, 205))
             for other in ('standard', 'full_attnres'))
    minutes = sum(statistics.median(saved(runs / 'v3_grid' / f'{arm}_lr{lr}_s{s}.json')['seconds'] / 60
                                    for lr in ('1.5e-3', '3e-3', '6e-3') for s in (100, 101, 102))
                  for arm in ('standard', 'delta_attnres', 'full_attnres'))
    cap = math.floor(20 * 60 / minutes)
    text = (Path(__file__).parent / 'results' / 'study_v3' / 'n_seeds.txt').read_text()
    n = int(text.split('\n', 1)[0])
    assert n == min(report.seeds_needed(0.008, sd, 0.025), cap)
    assert f'{sd:.4f}' in text and f'{report.detectable(sd, n, 0.025):.4f}' in text


def test_study_v3s_verdict_runs_keep_its_design():
    # the verdict's saved runs, as they come in (results/README.md, study v3): whole seeds among 0 to N-1, each arm at
    # its grid pick, every run from a clean commit whose training code is the design's, each seed's runs on one CPU
    # type (its pairs; the machine may change between seeds: "Across machines")
    runs = Path(__file__).parent / 'results' / 'runs' / 'v3_verdict'
    v3 = Path(__file__).parent / 'results' / 'study_v3'
    n = int((v3 / 'n_seeds.txt').read_text().split('\n', 1)[0])
    picks = {mode: float(lr) for mode, lr in map(str.split, (v3 / 'grid' / 'best_lr.txt').read_text().splitlines())}
    saved = {p.stem: json.loads(p.read_text()) for p in runs.glob('*.json')}
    seeds = {run['config']['seed'] for run in saved.values()}
    assert seeds and seeds <= set(range(n))
    assert sorted(saved) == sorted(f'{arm}_s{s}' for arm in picks for s in seeds)     # whole seeds only
    cpus = {s: set() for s in seeds}
    for name, run in saved.items():
        assert name == f"{run['config']['residual']}_s{run['config']['seed']}"     # the file is the run it names
        assert run['config']['learning_rate'] == picks[run['config']['residual']], name
        assert run['config']['min_lr'] == pytest.approx(picks[run['config']['residual']] / 10)
        for p in (r['provenance'] for r in run['records'] if 'provenance' in r):
            assert p['dirty'] == [], name
            # 6d7e85f fixed N; 961d97f changed report.py's figure layout and results/ only
            assert p['commit'][:7] in ('6d7e85f', '961d97f'), name
            cpus[run['config']['seed']].add(p['cpu'])
    assert all(len(c) == 1 for c in cpus.values()), cpus
