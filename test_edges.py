"""The edges a newcomer and a cluster hit (issue 31): a run stopped by SIGTERM or SIGINT, two runs in one out_dir,
an export that is whole or absent, --help."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from runs import read_state
from test_runs import torchrun
from test_train import REPO, TINY, corpus, losses, train, val_losses  # noqa: F401 (corpus: the fixture)

# 9 steps, evaluated and saved every 4: a signal at step 6 comes mid-interval
RUN = ['--max_iters=9', '--lr_decay_iters=9', '--eval_interval=4', '--gradient_accumulation_steps=2']

# train.py, whose process (SIGNAL_RANK under torchrun) sends itself SIGNAL as its SIGNAL_STEP-th step starts, and
# with SECOND=1 twice more while it writes the checkpoint that follows: at once (the same event delivered twice,
# counted once) and 1.5 s later (the user who presses Ctrl-C again); with TO_AGENT=1 it signals its parent, torchrun
SIGNALLER = """
import os, runpy, signal, sys, time
sys.path.insert(0, os.getcwd())
import data, torch.distributed.checkpoint.filesystem as fs
me = os.environ.get('RANK', '0') == os.environ.get('SIGNAL_RANK', '0')
sig, calls = getattr(signal, os.environ['SIGNAL']), [0]
step, write = data.ShardLoader.train_batches, fs.FileSystemWriter.write_data
def train_batches(self):
    calls[0] += 1
    if me and calls[0] == int(os.environ['SIGNAL_STEP']):
        os.kill(os.getppid() if os.environ.get('TO_AGENT') else os.getpid(), sig)
    return step(self)
def write_data(self, plan, planner):
    if me and calls[0] >= int(os.environ['SIGNAL_STEP']) and os.environ.get('SECOND'):
        os.kill(os.getpid(), sig)
        time.sleep(1.5)
        os.kill(os.getpid(), sig)
    return write(self, plan, planner)
data.ShardLoader.train_batches, fs.FileSystemWriter.write_data = train_batches, write_data
sys.argv = ['train.py'] + sys.argv[2:]
runpy.run_path('train.py', run_name='__main__')
"""


@pytest.fixture(scope='module')
def uninterrupted(corpus, tmp_path_factory):
    _, records = train(corpus, tmp_path_factory.mktemp('full') / 'run', *RUN)
    return records


def signalled(corpus, tmp_path, sig, step, **env):
    wrapper = tmp_path / 'signaller.py'
    wrapper.write_text(SIGNALLER)
    os.environ.update(SIGNAL=sig, SIGNAL_STEP=str(step), **env)
    try:
        return train(corpus, tmp_path / 'run', *RUN, wrapper=wrapper, check=False)
    finally:
        for k in ('SIGNAL', 'SIGNAL_STEP', *env):
            del os.environ[k]


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGINT'])
def test_a_signal_stops_the_run_with_a_checkpoint_and_auto_continues_exactly(corpus, tmp_path, uninterrupted, sig):
    p, _ = signalled(corpus, tmp_path, sig, step=6)
    code = 128 + getattr(signal, sig)
    assert p.returncode == code and 'Traceback' not in p.stderr, p.stderr[-2000:]
    # step 6's batches were taken (the 6th call), that step finishes: the checkpoint is at step 6
    assert f"received {sig}: stopping after this step" in p.stdout
    assert f"step 6: saved {tmp_path}/run/step_000006 (best: step 4, val loss" in p.stdout
    assert f"step 6: stopped by {sig}; continue with the same command and --init_from=auto" in p.stdout
    assert os.readlink(tmp_path / 'run' / 'ckpt') == 'step_000006'
    assert os.readlink(tmp_path / 'run' / 'best') == 'step_000004'   # saved without an evaluation: not the best
    p, records = train(corpus, tmp_path / 'run', *RUN, '--init_from=auto')
    assert 'resumed from' in p.stdout and '(step 6)' in p.stdout
    assert losses(records) == losses(uninterrupted) and val_losses(records) == val_losses(uninterrupted)


def test_a_second_signal_stops_at_once_and_the_last_checkpoint_stays(corpus, tmp_path, uninterrupted):
    p, _ = signalled(corpus, tmp_path, 'SIGTERM', step=6, SECOND='1')
    assert p.returncode == -signal.SIGTERM      # killed by the signal itself, mid-save
    assert os.readlink(tmp_path / 'run' / 'ckpt') == 'step_000004' and not (tmp_path / 'run' / 'step_000006').exists()
    _, records = train(corpus, tmp_path / 'run', *RUN, '--init_from=auto')
    assert losses(records) == losses(uninterrupted)


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(corpus, tmp_path, uninterrupted):
    # torchrun, 2 gloo ranks; only rank 1 is signalled: both agree at the next logged step (log_interval=1: the
    # signalled step itself), save their shards, exit 143
    out = tmp_path / 'run'
    p, _ = torchrun(corpus, out, *RUN, env=dict(SIGNAL='SIGTERM', SIGNAL_STEP='6', SIGNAL_RANK='1'), check=False,
                    wrapper=SIGNALLER)
    assert p.returncode != 0 and 'exitcode  : 143' in p.stderr, p.stderr[-3000:]
    assert 'step 6: stopped by SIGTERM' in p.stdout and os.readlink(out / 'ckpt') == 'step_000006'
    p, records = torchrun(corpus, out, *RUN, '--init_from=auto', wrapper=SIGNALLER,
                          env=dict(SIGNAL='SIGTERM', SIGNAL_STEP='0'))
    assert losses(records) == pytest.approx(losses(uninterrupted), rel=1e-5)
    assert val_losses(records) == pytest.approx(val_losses(uninterrupted), rel=1e-5)


def test_a_sigterm_to_torchrun_stops_every_rank_with_a_checkpoint(corpus, tmp_path, uninterrupted):
    # what `scancel` or `kill <torchrun's pid>` does: torchrun forwards SIGTERM to every worker; they finish the step
    # in progress, agree on the stop step, save and exit 143. torchrun itself then ends with its own
    # SignalException traceback and exit status 1 (torch's launcher, not train.py: docs/training.md says so)
    out = tmp_path / 'run'
    p, _ = torchrun(corpus, out, *RUN, env=dict(SIGNAL='SIGTERM', SIGNAL_STEP='6', SIGNAL_RANK='0', TO_AGENT='1'),
                    check=False, wrapper=SIGNALLER)
    assert p.returncode == 1 and 'SignalException: Process' in p.stderr and 'got signal: 15' in p.stderr
    stops = [line for line in p.stdout.splitlines() if 'stopped by SIGTERM' in line]
    assert len(stops) == 1, p.stdout[-3000:] + p.stderr[-3000:]     # rank 0 speaks for both
    step = int(stops[0].split(':')[0].split()[1])
    assert 6 <= step < 9 and os.readlink(out / 'ckpt') == f'step_{step:06d}'
    assert read_state(out / 'ckpt')['iter_num'] == step
    p, records = torchrun(corpus, out, *RUN, '--init_from=auto', wrapper=SIGNALLER,
                          env=dict(SIGNAL='SIGTERM', SIGNAL_STEP='0'))
    assert losses(records) == pytest.approx(losses(uninterrupted), rel=1e-5)


# -----------------------------------------------------------------------------
# one run per out_dir

def test_a_second_run_in_a_locked_out_dir_is_refused_at_once(corpus, tmp_path):
    out = tmp_path / 'run'
    cmd = [sys.executable, 'train.py', *TINY, '--dataset=tiny', f'--data_root={corpus}', f'--out_dir={out}',
           '--max_iters=100000', '--lr_decay_iters=100000', '--eval_interval=50']
    printed = open(tmp_path / 'first.txt', 'w')     # (a pipe nobody reads would fill up and block the run)
    first = subprocess.Popen(cmd, cwd=REPO, stdout=printed, stderr=subprocess.STDOUT,
                             env={**os.environ, 'OMP_NUM_THREADS': '1'})
    try:
        while not (out / 'step_000050').exists():    # a checkpoint, and the run goes on
            assert first.poll() is None, (tmp_path / 'first.txt').read_text()
            time.sleep(0.2)
        for extra in ([], ['--init_from=auto'], ['--overwrite=True']):
            t0 = time.time()
            p = subprocess.run(cmd + extra, cwd=REPO, capture_output=True, text=True, timeout=60)
            assert p.returncode == 1 and time.time() - t0 < 30
            assert p.stderr.startswith(f"error: out_dir={str(out)!r} is in use by another run (pid {first.pid} on ")
            assert 'started 20' in p.stderr and 'Traceback' not in p.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    assert first.returncode == 143 and 'stopped by SIGTERM' in (tmp_path / 'first.txt').read_text()
    # the others never wrote into the first run's folder: one provenance record, steps in order, its own checkpoints
    records = [json.loads(line) for line in (out / 'log.jsonl').read_text().splitlines()]
    steps = [r['step'] for r in records if 'loss' in r]
    assert sum('provenance' in r for r in records) == 1 and steps == sorted(set(steps))
    assert read_state(str(out / 'ckpt'))['provenance']['argv'][-1] == '--eval_interval=50'
    # and once it has ended, the folder is free again
    p, _ = train(corpus, out, '--init_from=resume', '--max_iters=100000', '--lr_decay_iters=100000',
                 '--eval_interval=50', '--eval_only=True')
    assert 'val loss' in p.stdout


# -----------------------------------------------------------------------------
# export.py: whole or absent

def test_export_without_its_dependency_writes_nothing_and_with_it_a_folder_only_when_complete(corpus, tmp_path,
                                                                                              monkeypatch):
    train(corpus, tmp_path / 'run', '--max_iters=2', '--eval_interval=2', '--lr_decay_iters=3')
    run = [sys.executable, '-c', "import sys, runpy; sys.modules['tokenizers'] = None; sys.argv = sys.argv[1:]; "
                                 "runpy.run_path('export.py', run_name='__main__')"]
    p = subprocess.run(run + ['export.py', f'{tmp_path}/run/ckpt', f'{tmp_path}/x'], cwd=REPO, capture_output=True,
                       text=True)
    assert p.returncode == 1 and p.stderr == 'export.py: error: it needs tokenizers: pip install tokenizers\n'
    assert os.listdir(tmp_path) == ['run']
    # a missing tokenizer is found before anything is written; a failure after the weights are written (here:
    # the tokenizer's conversion) leaves nothing behind either
    import export
    state = read_state(str(tmp_path / 'run' / 'ckpt'))
    (tmp_path / 'run' / 'ckpt' / 'state.json').write_text(
        json.dumps({**state, 'meta': {**state['meta'], 'tokenizer': str(tmp_path / 'gone.json')}}))
    p = subprocess.run([sys.executable, 'export.py', f'{tmp_path}/run/ckpt', f'{tmp_path}/x'], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith(f"export.py: error: tokenizer '{tmp_path}/gone.json' is neither")
    (tmp_path / 'run' / 'ckpt' / 'state.json').write_text(json.dumps(state))
    def broken(*args):
        raise OSError('the disk is full')
    monkeypatch.setattr(export, 'save_hf_tokenizer', broken)
    with pytest.raises(OSError, match='the disk is full'):
        export.export(tmp_path / 'run' / 'ckpt', tmp_path / 'x')
    assert sorted(os.listdir(tmp_path)) == ['run']
    p = subprocess.run([sys.executable, 'export.py', f'{tmp_path}/run/ckpt', f'{tmp_path}/x'], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path / 'x')) == ['config.json', 'fast_routing.py', 'hf_model.py', 'model.py',
                                                   'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
    p = subprocess.run([sys.executable, 'export.py', f'{tmp_path}/run/ckpt', f'{tmp_path}/x'], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr == f'export.py: error: {tmp_path}/x exists; export into a new folder (or remove it first)\n'


# -----------------------------------------------------------------------------
# --help

@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'bench.py', 'export.py', 'report.py', 'eval_lm.py',
                                    'prepare_fineweb.py'])
def test_help_lists_the_settings(script):
    p = subprocess.run([sys.executable, script, '--help'], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == '', p.stderr
    expected = {'train.py': ['--learning_rate=0.0006', '\nI/O\n  --out_dir=out', '--init_from=scratch',
                              "'auto' (resume if out_dir"],
                'sample.py': ['--temperature=', '--start='], 'bench.py': ['--n_layer=', '--compile='],
                'export.py': ['--dtype'], 'report.py': ['--out'], 'eval_lm.py': ['--tasks'],
                'prepare_fineweb.py': ['--demo']}[script]
    for text in expected:
        assert text in p.stdout, p.stdout


HELP_WITHOUT_TORCH = """
import contextlib, io, runpy, sys
sys.argv = [sys.argv[1], '--help']
with contextlib.redirect_stdout(io.StringIO()):
    try:
        runpy.run_path(sys.argv[0], run_name='__main__')
    except SystemExit:
        pass
print('torch' in sys.modules)
"""


def test_gpu_check_dry_run_shows_its_stages_and_deadlines():
    p = subprocess.run([sys.executable, 'gpu_check.py', '--dry_run', '--budget=600'], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == '', p.stderr
    stages = [line.split()[0] for line in p.stdout.splitlines()[1:] if 'at most' in line]
    assert stages == ['tests', 'compile_delta_block', 'compile_delta_attnres', 'compile_attnres',
                      'compile_full_attnres', 'ddp', 'fsdp', 'resume', 'bench']
    ends = [float(line.split('ends by')[1].split()[0]) for line in p.stdout.splitlines() if 'ends by' in line]
    assert ends == sorted(ends) and abs(ends[-1] - 600) <= 1      # one after another, within the budget
    p = subprocess.run([sys.executable, 'gpu_check.py'], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and 'SKIPPED: no CUDA device' in p.stdout     # (this CPU machine)


@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'bench.py', 'prepare_fineweb.py'])
def test_help_answers_before_torch_loads(script):
    # importing torch takes seconds, tens of seconds on a busy machine; the settings need none of it
    p = subprocess.run([sys.executable, '-c', HELP_WITHOUT_TORCH, script], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout == 'False\n', p.stdout + p.stderr
