"""Tests of runs.py through train.py as a cluster runs it: torchrun with gloo ranks on CPU, processes killed with
SIGKILL at a step and in the middle of a save, a full disk, another number of processes on resume, and the results
compared with an uninterrupted run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import REPO, TINY, checkpoint, corpus, losses, train, val_losses  # noqa: F401 (corpus: the fixture)

# 8 steps, evaluated and saved every 3; a global batch of 2 micro-batches however many processes share it
RUN = ['--max_iters=8', '--lr_decay_iters=8', '--eval_interval=3', '--gradient_accumulation_steps=2',
       '--ddp_timeout_s=20']

# train.py under torchrun; rank 1 of the first attempt kills itself (SIGKILL: no cleanup, like an OOM kill or a lost
# node) at its KILL_STEP-th optimizer step or, with KILL_SAVE=n, while writing its shards of the n-th checkpoint
KILLER = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
import data, torch.distributed.checkpoint.filesystem as fs
first = os.environ.get('RANK') == '1' and os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
calls = {'step': 0, 'save': 0}
step, write = data.ShardLoader.train_batches, fs.FileSystemWriter.write_data
def train_batches(self):
    calls['step'] += 1
    if first and calls['step'] == int(os.environ.get('KILL_STEP', 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self)
def write_data(self, plan, planner):
    calls['save'] += 1
    if first and calls['save'] == int(os.environ.get('KILL_SAVE', 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    return write(self, plan, planner)
data.ShardLoader.train_batches, fs.FileSystemWriter.write_data = train_batches, write_data
sys.argv = ['train.py'] + sys.argv[2:]
runpy.run_path('train.py', run_name='__main__')
"""


def torchrun(corpus, out_dir, *args, restarts=0, env=None, nproc=2, check=True, wrapper=KILLER):
    """train.py (through KILLER, or another wrapper's text) under torchrun, as a job script would start it."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
           f'--max-restarts={restarts}', str(Path(out_dir).parent / 'killer.py'), str(out_dir),
           *TINY, '--dataset=tiny', f'--data_root={corpus}', f'--out_dir={out_dir}',
           *args]
    Path(out_dir).parent.joinpath('killer.py').write_text(wrapper)     # beside out_dir, not in it
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'OMP_NUM_THREADS': '1', **(env or {})})
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = Path(out_dir) / 'log.jsonl'
    return p, [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []



def test_a_killed_rank_restarts_or_requeues_and_continues_exactly(corpus, tmp_path):
    _, full = torchrun(corpus, tmp_path / 'full', *RUN, '--init_from=auto')
    assert sorted(losses(full)) == list(range(1, 9))

    # (a) torchrun restarts the workers with the same command; --init_from=auto continues from step 3
    p, restarted = torchrun(corpus, tmp_path / 'a', *RUN, '--init_from=auto', restarts=1, env={'KILL_STEP': '5'})
    assert f"resumed from {tmp_path}/a/ckpt (step 3)" in p.stdout
    assert losses(restarted) == losses(full) and val_losses(restarted) == val_losses(full)   # bit for bit
    starts = [r['provenance'] for r in restarted if 'provenance' in r]
    assert [r['step'] for r in restarted if 'provenance' in r] == [0, 3] and starts[0]['world_size'] == 2

    # (b) killed while writing its shards of the step-6 checkpoint: the job fails, the step-3 checkpoint is intact,
    # and the same command run again (a requeue) finishes the run with the same losses
    p, _ = torchrun(corpus, tmp_path / 'b', *RUN, '--init_from=auto', env={'KILL_SAVE': '2'}, check=False)
    assert p.returncode != 0 and os.readlink(tmp_path / 'b' / 'ckpt') == 'step_000003'
    assert checkpoint(tmp_path / 'b')['iter_num'] == 3 and list((tmp_path / 'b').glob('step_000006.tmp'))
    p, requeued = torchrun(corpus, tmp_path / 'b', *RUN, '--init_from=auto')
    assert losses(requeued) == losses(full) and val_losses(requeued) == val_losses(full)
    assert sorted(f.name for f in (tmp_path / 'b').iterdir()) == ['.lock', 'best', 'ckpt', 'log.jsonl', 'step_000008']

    # a different command pointed at the run is not a restart: refused, naming what differs
    p, _ = torchrun(corpus, tmp_path / 'b', *RUN, '--init_from=auto', '--learning_rate=0.5', check=False)
    assert p.returncode != 0 and "init_from='auto'" in p.stderr and "'learning_rate': (0.01, 0.5)" in p.stderr


def test_resume_on_another_number_of_processes(corpus, tmp_path):
    # DCP reshards: FSDP2 on 2 processes -> 1 process, and 1 process -> FSDP2 on 2 processes
    _, one = train(corpus, tmp_path / 'one', *RUN)
    torchrun(corpus, tmp_path / 'two_one', *RUN[1:], '--max_iters=3', '--fsdp=True')
    assert sorted(f.name for f in (tmp_path / 'two_one' / 'ckpt').glob('*.distcp')) == ['__0_0.distcp', '__1_0.distcp']
    _, two_one = train(corpus, tmp_path / 'two_one', *RUN, '--init_from=resume')
    train(corpus, tmp_path / 'one_two', *RUN[1:], '--max_iters=3')
    _, one_two = torchrun(corpus, tmp_path / 'one_two', *RUN, '--init_from=resume', '--fsdp=True')
    for run in (two_one, one_two):
        assert sorted(losses(run)) == list(range(1, 9))
        for step, loss in losses(one).items():
            assert losses(run)[step] == pytest.approx(loss, rel=1e-5)


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(corpus, tmp_path):
    disk = tmp_path / 'disk'
    disk.mkdir()
    # room for the log and one checkpoint (~0.7 MB) but not a second one beside it
    mount = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1100k', 'tmpfs', str(disk)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:
        out = disk / 'run'
        p, records = train(corpus, out, *RUN, check=False)
        assert p.returncode == 1 and 'Traceback' not in p.stderr
        assert p.stderr.startswith(f"step 6: could not write the checkpoint into {out} (")
        assert "MiB free there, less than the last checkpoint's 0.7 MiB: the disk is full)" in p.stderr, p.stderr
        assert f"The checkpoints are untouched: {out}/ckpt (step 3)" in p.stderr
        assert checkpoint(out)['iter_num'] == 3 and not list(out.glob('*.tmp'))
    finally:
        subprocess.run(['umount', str(disk)])


def test_eval_iters_below_the_number_of_processes_is_refused(corpus, tmp_path):
    p, _ = torchrun(corpus, tmp_path / 'run', *RUN, '--eval_iters=1', check=False)
    assert p.returncode != 0
    assert "error: eval_iters=1: expected >= the number of processes, 2 (every rank evaluates a batch)" in p.stderr
    assert 'ZeroDivisionError' not in p.stderr


def test_provenance_in_the_log_and_the_checkpoint(corpus, tmp_path):
    p, records = train(corpus, tmp_path / 'run', '--max_iters=2', '--eval_interval=2')
    first = records[0]
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert first['step'] == 0 and first['provenance']['commit'] == commit
    # dirty: the changed tracked files, results/ aside (the study scripts append to it while their runs train)
    changed = subprocess.run(['git', 'diff', '--name-only', 'HEAD'], cwd=REPO, capture_output=True, text=True).stdout
    assert first['provenance']['dirty'] == [f for f in changed.split() if not f.startswith('results/')]
    import torch
    assert first['provenance']['torch'] == torch.__version__ and first['provenance']['world_size'] == 1
    assert first['provenance']['cpu'].endswith(', ' + torch.backends.cpu.get_cpu_capability())
    assert first['provenance']['argv'][0].endswith('train.py') and f'--out_dir={tmp_path}/run' in first['provenance']['argv']
    assert checkpoint(tmp_path / 'run')['provenance'] == first['provenance']


# a library function that fails (a bug, not a user's mistake) inside sample.py and bench.py
BUG = """
import os, runpy, sys, torch
sys.path.insert(0, os.getcwd())
import model
def broken(*a, **k):
    raise ValueError('a bug deep in a library')
def hacked(*a, **k):    # a ValueError raised in a file of this repo: someone hacking model.py
    model.GPTConfig(n_layer=-1)
torch.manual_seed = hacked if os.environ.get('IN_REPO') else broken
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.parametrize('script', ['sample.py', 'bench.py', 'train.py'])
def test_bugs_keep_their_traceback_and_mistakes_print_one_line(tmp_path, script):
    (tmp_path / 'bug.py').write_text(BUG)
    args = [] if script == 'bench.py' else [f'--out_dir={tmp_path}']
    p = subprocess.run([sys.executable, str(tmp_path / 'bug.py'), script, *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and 'Traceback' in p.stderr and 'ValueError: a bug deep in a library' in p.stderr
    p = subprocess.run([sys.executable, str(tmp_path / 'bug.py'), script, *args], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, 'IN_REPO': '1'})
    assert p.returncode == 1 and 'Traceback' in p.stderr and 'ValueError: n_layer must be a positive' in p.stderr
    p = subprocess.run([sys.executable, script, '--dtype=float8'], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and 'Traceback' not in p.stderr and p.stderr.startswith("error: dtype='float8': expected")


def test_data_preparation_needs_no_torch():
    p = subprocess.run([sys.executable, '-c', "import sys, prepare_fineweb; assert 'torch' not in sys.modules"],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


# train.py under torchrun, counting on every rank the calls that make the host wait for the device (on a GPU) by
# the step they fall in: a call after the k-th step's batches and before the (k+1)-th's belongs to step k
SYNCS = """
import atexit, json, os, runpy, sys, traceback
sys.path.insert(0, os.getcwd())
import torch, data
step, counts = [0], {}
batches = data.ShardLoader.train_batches
def train_batches(self):
    step[0] += 1
    return batches(self)
data.ShardLoader.train_batches = train_batches
def counted(name, real):
    def call(self, *a, **k):
        frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if 'site-packages' not in f.filename), None)
        # (model.py checks the token ids only where they are on the CPU, for free: never on a GPU)
        if self.device.type != 'meta' and not (frame and 'hi >= self.config.vocab_size' in frame.line):
            where = f'{frame.filename.split("/")[-1]}:{frame.lineno} {frame.line}' if frame else '?'
            counts.setdefault(str(step[0]), []).append(f'{name} {where}')
        return real(self, *a, **k)
    return call
for name in ('item', 'tolist', 'cpu', 'numpy', '__bool__', '__float__', '__int__'):
    setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
@atexit.register
def write():
    with open(os.path.join(os.environ['SYNC_DIR'], f"rank{os.environ['RANK']}.json"), 'w') as f:
        json.dump(counts, f)
sys.argv = ['train.py'] + sys.argv[2:]
runpy.run_path('train.py', run_name='__main__')
"""


@pytest.mark.parametrize('parallel', ['ddp', 'fsdp'])
def test_no_host_device_sync_on_a_step_that_does_not_log(corpus, tmp_path, parallel):
    """On a GPU each of these calls waits for all the work queued before it: on a step that does not log, none."""
    p, records = torchrun(corpus, tmp_path / 'run', '--max_iters=8', '--lr_decay_iters=8', '--eval_interval=8',
                          '--log_interval=4', '--gradient_accumulation_steps=2', f'--fsdp={parallel == "fsdp"}',
                          env={'SYNC_DIR': str(tmp_path)}, wrapper=SYNCS)
    for rank in (0, 1):
        counts = json.loads((tmp_path / f'rank{rank}.json').read_text())
        quiet = {k: v for k, v in counts.items() if int(k) in (2, 3, 5, 6, 7)}   # 1: the first step's line
        assert quiet == {}, (rank, quiet)
        assert counts.get('4') and counts.get('8'), counts     # (the count sees the logging steps' reads)
    assert [r['step'] for r in records if 'loss' in r] == [4, 8]


def test_a_long_compile_says_what_it_does_and_how_long_it_took(capsys):
    import time
    from runs import Heartbeat
    with Heartbeat('compiling the training step', every=0.2):
        time.sleep(0.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ['... compiling the training step: 0 s so far'] * 2 and len(lines) == 3
    assert lines[-1].startswith('... compiling the training step: done in ')
    with Heartbeat('compiling the evaluation', on=False, every=0.05):     # (not rank 0, or not compiled)
        time.sleep(0.2)
    with Heartbeat('compiling the evaluation', every=5):                 # quick: nothing to say
        pass
    assert capsys.readouterr().out == ''
