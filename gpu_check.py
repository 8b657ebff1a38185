"""
GPU readiness in one command, within a lent GPU's few minutes: is this CUDA machine ready for the paper's runs?

    python gpu_check.py                  # every stage, one after another, each with its own deadline
    python gpu_check.py --dry_run        # the stages, their commands and deadlines, without running them (any machine)
    python gpu_check.py --budget=900     # more time in all (the deadlines scale with it)

The stages, in the order a first 8xH100 run would meet them:
  tests        pytest -k cuda: the model on the GPU, compiled with inductor, BF16, bench.py's GPU columns;
  compile_*    train.py at the 220m shape, compiled, BF16 autocast, on the offline demo data, for each routed mode
               one after another (each alone on the GPU: its first-step time is its compile time), with an
               evaluation at the start and the end;
  ddp, fsdp    torchrun with NCCL over every GPU present (one GPU is a world of one), DDP and then FSDP2 with its
               BF16 mixed-precision policy, a tiny model for a few steps;
  resume       a run killed with SIGKILL after its first checkpoint, continued with --init_from=auto: its losses
               must equal the uninterrupted run's (within 1e-4: GPU kernels need not be bitwise deterministic);
  bench        bench.py at the 220m shape (delta_block, delta_attnres against standard): tok/s and peak memory.
Each stage prints its time as it ends. A stage that the remaining time cannot reach says NOT REACHED, and one cut
off by its deadline NOT FINISHED (with how far it got): neither is a failure; at the end one screen of verdicts,
and the exit status is 1 only if a stage FAILED. On a machine without
CUDA (and without --dry_run) it prints SKIPPED. Logs: out/gpu_check/<time>/<stage>.log and .err.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

ROUTED = ['delta_block', 'delta_attnres', 'attnres', 'full_attnres']
STEPS = 20
COMPILED = [f'--max_iters={STEPS}', f'--lr_decay_iters={STEPS}', '--warmup_iters=5', f'--eval_interval={STEPS}',
            '--eval_iters=4', '--log_interval=5', '--gradient_accumulation_steps=2', '--dataset=demo',
            '--compile=True', '--dtype=bfloat16', '--final_eval=False']
TINY = ['config/delta_block_tiny.py', '--device=cuda', '--dtype=bfloat16', '--compile=False', '--log_interval=1',
        '--eval_iters=8', '--final_eval=False']
# the share of the budget each stage may use at most (the compile stages: each); they sum to about 1
SHARE = {'tests': 0.15, 'compile': 0.13, 'ddp': 0.06, 'fsdp': 0.06, 'resume': 0.08, 'bench': 0.13}


def stages(py, out, gpus):
    """[(name, share of the budget, command or a function, what passing means)], in order."""
    torchrun = [py, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={gpus}']
    accum = f'--gradient_accumulation_steps={2 * gpus}'
    plan = [('tests', SHARE['tests'], [py, '-m', 'pytest', '-q', '-k', 'cuda'], 'every CUDA test passes')]
    plan += [(f'compile_{m}', SHARE['compile'],
              [py, 'train.py', f'config/{m}_220m.py', *COMPILED, f'--out_dir={out}/{m}'],
              'compiles, trains, and the val loss falls') for m in ROUTED]
    plan += [('ddp', SHARE['ddp'], [*torchrun, 'train.py', *TINY, '--max_iters=10', '--lr_decay_iters=10',
                                     '--eval_interval=10', accum, f'--out_dir={out}/ddp'], 'NCCL DDP trains'),
             ('fsdp', SHARE['fsdp'], [*torchrun, 'train.py', *TINY, '--max_iters=10', '--lr_decay_iters=10',
                                      '--eval_interval=10', accum, '--fsdp=True', f'--out_dir={out}/fsdp'],
              'NCCL FSDP2 trains')]
    plan += [('resume', SHARE['resume'], resume, 'killed and continued: the same losses'),
             ('bench', SHARE['bench'], [py, 'bench.py', 'config/delta_block_220m.py',
                                        '--residual=delta_block,delta_attnres', '--json'], 'measures every row')]
    return plan


def run(name, cmd, deadline, out):
    """cmd until `deadline` (time.time()): its exit status, or 'timeout'; stdout/stderr to out/name.log, .err."""
    with open(os.path.join(out, f'{name}.log'), 'w') as o, open(os.path.join(out, f'{name}.err'), 'w') as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, text=True, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)     # torchrun's workers and compile workers too
            proc.wait()
            return 'timeout'


def tail(out, name, n=2):
    """The last n lines of a stage's error output (or of its output, where it wrote no errors)."""
    texts = [open(os.path.join(out, f'{name}.{ext}')).read() for ext in ('err', 'log')
             if os.path.exists(os.path.join(out, f'{name}.{ext}'))]
    lines = [l for l in (texts[0] or texts[-1] if texts else '').splitlines() if l.strip()]
    return ' | '.join(lines[-n:])


def records(path):
    path = os.path.join(path, 'log.jsonl')
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []


def resume(py, out, deadline):
    """The uninterrupted run, then the same run killed (SIGKILL) after its step-10 checkpoint and continued."""
    args = [py, 'train.py', *TINY, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10']
    if (rc := run('resume_full', args + [f'--out_dir={out}/full'], deadline, out)) != 0:
        return rc, 'the uninterrupted run: ' + tail(out, 'resume_full')
    killed = os.path.join(out, 'killed')
    with open(os.path.join(out, 'resume_killed.log'), 'w') as o:
        proc = subprocess.Popen(args + [f'--out_dir={killed}'], stdout=o, stderr=subprocess.STDOUT)
        while not os.path.exists(os.path.join(killed, 'step_000010', 'state.json')) and proc.poll() is None:
            if time.time() > deadline:
                proc.kill()
                return 'timeout', ''
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    if (rc := run('resume', args + [f'--out_dir={killed}', '--init_from=auto'], deadline, out)) != 0:
        return rc, 'the continued run: ' + tail(out, 'resume')
    full, cont = ({r['step']: r['loss'] for r in records(d) if 'loss' in r} for d in (f'{out}/full', killed))
    worst = max(abs(full[s] - cont.get(s, float('inf'))) for s in full)
    return (0 if worst < 1e-4 else 1), f"largest loss difference {worst:.1e} over {len(full)} steps"


def verdict(name, rc, note, out):
    """One line for a stage that ran: (passed?, line)."""
    if rc == 'timeout':     # slow is not broken: the last lines say how far it got
        return True, f"NOT FINISHED by its deadline; it had reached: {tail(out, name)}"
    if rc != 0:
        return False, f"FAILED ({rc}) {note or tail(out, name)}"
    if name.startswith('compile_'):
        recs = records(os.path.join(out, name[len('compile_'):]))
        val = {r['step']: r['val_loss'] for r in recs if 'val_loss' in r}
        first = re.search(r'first step took ([\d.]+) s', open(os.path.join(out, f'{name}.log')).read())
        last = [r for r in recs if 'loss' in r][-1:] or [{}]
        ok = 0 in val and STEPS in val and val[STEPS] < val[0]
        mfu = f"{100 * last[0]['mfu']:.1f}%" if last[0].get('mfu') is not None else '-'
        return ok, (f"val loss {val.get(0, float('nan')):.3f} -> {val.get(STEPS, float('nan')):.3f}"
                    f"{'' if ok else ' (NOT LOWER)'} | first step (compile) {first[1] if first else '?'} s"
                    f" | {last[0].get('tok_per_s', 0):,.0f} tok/s | mfu {mfu} | peak {last[0].get('mem_gib', 0):.1f} GiB")
    if name == 'bench':
        rows = json.loads(open(os.path.join(out, 'bench.log')).read())['rows']
        return True, ' | '.join(f"{r['mode']} {r['tok_per_s']:,.0f} tok/s = {r['tok_per_s_ratio']:.2f}x std, peak "
                                f"{(r['peak_bytes'] or 0) / 2**30:.1f} GiB" for r in rows)
    if name == 'tests':
        return True, (open(os.path.join(out, 'tests.log')).read().strip().splitlines() or ['no output'])[-1]
    return True, note or 'ok'


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].strip())
    parser.add_argument('--budget', type=float, default=480, help='seconds for all stages (default 480: 8 minutes)')
    parser.add_argument('--dry_run', action='store_true', help='print the stages, commands and deadlines only')
    args = parser.parse_args()
    import torch    # (after --help: importing torch takes seconds)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    out = os.path.join('out', 'gpu_check', time.strftime('%Y%m%d-%H%M%S'))
    py = sys.executable
    plan = stages(py, out, gpus)
    if args.dry_run:
        at = 0.0
        print(f"gpu_check --dry_run: {len(plan)} stages in a budget of {args.budget:.0f} s ({gpus} GPU(s) here)")
        for name, share, cmd, means in plan:
            at += share * args.budget
            what = ' '.join(cmd) if isinstance(cmd, list) else f'{cmd.__name__}(): {cmd.__doc__.strip()}'
            print(f"  {name:<22} at most {share * args.budget:4.0f} s (ends by {at:4.0f} s)  pass: {means}\n"
                  f"  {'':<22} {what}")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu_check: SKIPPED: no CUDA device (torch {torch.__version__}); run it on the GPU machine")
        return 0
    os.makedirs(out)
    t0 = time.time()
    end = t0 + args.budget
    if not os.path.exists(os.path.join('data', 'demo', 'meta.json')):
        if run('prepare_demo', [py, 'prepare_fineweb.py', '--demo'], t0 + 120, out) != 0:
            sys.exit(f"gpu_check: preparing the demo data failed: {tail(out, 'prepare_demo')}")
    lines, failed = [], False
    for name, share, cmd, means in plan:
        left = end - time.time()
        if left < 0.5 * share * args.budget:       # too little time for this stage to mean anything
            lines.append(f"{name:<22} NOT REACHED ({max(0, left):.0f} s left of the budget)")
            print(f"[{time.time() - t0:4.0f} s] {name}: not reached", flush=True)
            continue
        start = time.time()
        print(f"[{start - t0:4.0f} s] {name} (at most {min(left, share * args.budget):.0f} s) ...", flush=True)
        deadline = start + min(left, share * args.budget)
        rc, note = cmd(py, out, deadline) if callable(cmd) else (run(name, cmd, deadline, out), '')
        ok, line = verdict(name, rc, note, out)
        failed |= not ok
        lines.append(f"{name:<22} {'' if not ok or line.startswith('NOT') else 'ok    '}{line} "
                     f"({time.time() - start:.0f} s)")
        print(f"[{time.time() - t0:4.0f} s] {name}: {'ok' if ok else 'FAILED'} ({time.time() - start:.0f} s)",
              flush=True)
    print(f"\n# gpu_check on {gpus} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.time() - t0:.0f} s of a {args.budget:.0f} s budget; logs in {out}/")
    print('\n'.join(lines))
    partial = any(' NOT ' in line for line in lines)
    print('FAILED' if failed else 'PASSED, except the stages NOT REACHED / NOT FINISHED' if partial else 'PASSED')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
