"""
GPU readiness in one command: is this CUDA machine ready for the paper's runs? Deadlines keep it under 8 minutes.

    python gpu_check.py

1. the CUDA tests (pytest -k cuda: the model on the GPU, compiled with inductor, and bench.py's GPU columns);
2. train.py, compiled with BF16, at the 220m shape on the offline demo data (prepared if missing) for a few dozen
   steps with an evaluation at the start and the end, for standard, delta_block and delta_attnres (side by side:
   compilation is mostly CPU work, so the three overlap);
3. the 220m bench rows: python bench.py config/delta_block_220m.py --residual=delta_block,delta_attnres (alone on
   the GPU: its throughput and memory columns are the numbers to report).
Then one summary; the exit status is 0 only if everything passed. On a machine without CUDA it prints SKIPPED and
does nothing. Runs go to out/gpu_check/<time>/ (a fresh folder every time), each part's output to <part>.log and
<part>.err there.
"""
import json
import os
import subprocess
import sys
import time

import torch

MODES = ['standard', 'delta_block', 'delta_attnres']
STEPS = 30
TRAIN = [f'--max_iters={STEPS}', f'--lr_decay_iters={STEPS}', '--warmup_iters=10', f'--eval_interval={STEPS}',
         '--eval_iters=8', '--log_interval=10', '--gradient_accumulation_steps=4', '--dataset=demo',
         '--compile=True', '--dtype=bfloat16', '--wandb_log=False']
DEADLINE = 330     # seconds after the start for the tests and training runs; the bench rows then get 150 more

if not torch.cuda.is_available():
    print(f"gpu_check: SKIPPED: no CUDA device (torch {torch.__version__}); run it on the GPU machine")
    sys.exit(0)
out = os.path.join('out', 'gpu_check', time.strftime('%Y%m%d-%H%M%S'))
os.makedirs(out)
t_start = time.time()


def start(name, cmd):
    """Start cmd in the background; its stdout goes to out/name.log, its stderr to out/name.err."""
    print(f"[{time.time() - t_start:4.0f} s] {name}: {' '.join(cmd)}", flush=True)
    files = [open(os.path.join(out, f'{name}.{ext}'), 'w') for ext in ('log', 'err')]
    return name, subprocess.Popen(cmd, stdout=files[0], stderr=files[1], text=True), files


def finish(job, deadline):
    """Wait for a job until `deadline` seconds after the start: its exit status, or 'timeout'."""
    name, proc, files = job
    try:
        rc = proc.wait(timeout=max(1.0, t_start + deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = 'timeout'
    for f in files:
        f.close()
    print(f"[{time.time() - t_start:4.0f} s] {name}: {'ok' if rc == 0 else f'FAILED ({rc})'}", flush=True)
    return rc


def read(name, ext='log'):
    with open(os.path.join(out, f'{name}.{ext}')) as f:
        return f.read()


def tail(name, n=3):
    """The last n lines of a job's error output (or of its output, where it wrote no errors)."""
    lines = [l for l in (read(name, 'err') or read(name)).splitlines() if l.strip()]
    return ' | '.join(lines[-n:])


py = sys.executable
if not os.path.exists(os.path.join('data', 'demo', 'meta.json')):
    if finish(start('prepare_demo', [py, 'prepare_fineweb.py', '--demo']), 120) != 0:
        sys.exit(f"gpu_check: preparing the demo data failed: {tail('prepare_demo')}")
jobs = [start('pytest_cuda', [py, '-m', 'pytest', '-q', '-k', 'cuda'])]
jobs += [start(f'train_{m}', [py, 'train.py', f'config/{m}_220m.py', *TRAIN, f'--out_dir={out}/{m}']) for m in MODES]
rcs = {job[0]: finish(job, DEADLINE) for job in jobs}
rcs['bench'] = finish(start('bench', [py, 'bench.py', 'config/delta_block_220m.py',
                                      '--residual=delta_block,delta_attnres', '--json']), DEADLINE + 150)

# -----------------------------------------------------------------------------
summary, ok = [], all(rc == 0 for rc in rcs.values())
pytest_last = read('pytest_cuda').strip().splitlines()[-1:] or ['no output']
summary.append(f"CUDA tests: {pytest_last[0] if rcs['pytest_cuda'] == 0 else 'FAILED: ' + tail('pytest_cuda')}")
for m in MODES:
    name = f'train_{m}'
    path = os.path.join(out, m, 'log.jsonl')
    records = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    val = {r['step']: r['val_loss'] for r in records if 'val_loss' in r}
    train = [r for r in records if 'loss' in r]
    if rcs[name] != 0 or set(val) != {0, STEPS} or not train:
        ok = False
        summary.append(f"train {m:<14} FAILED: {tail(name)}")
        continue
    learned = val[STEPS] < val[0]
    ok &= learned
    last = train[-1]
    mfu = f"{100 * last['mfu']:.1f}%" if last['mfu'] is not None else '-'
    summary.append(f"train {m:<14} val loss {val[0]:.3f} -> {val[STEPS]:.3f}{'' if learned else ' (NOT LOWER)'} | "
                   f"{last['tok_per_s']:,.0f} tok/s (3 runs share the GPU) | mfu {mfu} | "
                   f"peak {last['mem_gib']:.1f} GiB")
if rcs['bench'] == 0:
    bench = json.loads(read('bench'))
    for r in bench['rows']:
        mfu = f"{100 * r['mfu']:.1f}%" if r['mfu'] is not None else '-'
        peak = f"{r['peak_bytes'] / 2**30:.1f} GiB = {r['peak_ratio']:.2f}x std" if r['peak_bytes'] else '-'
        summary.append(f"bench {r['mode']:<14} {r['tok_per_s']:,.0f} tok/s = {r['tok_per_s_ratio']:.2f}x std | "
                       f"peak {peak} | mfu {mfu}")
else:
    summary.append(f"bench FAILED: {tail('bench')}")
print(f"\n# gpu_check on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
      f"{time.time() - t_start:.0f} s; logs in {out}/")
print('\n'.join(summary))
print('PASSED' if ok else 'FAILED')
sys.exit(0 if ok else 1)
