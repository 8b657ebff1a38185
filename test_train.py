"""Tests of train.py, configurator.py and config/: offline, on CPU, with a tiny model on a tiny corpus."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare_fineweb as prep
from model import GPT, GPTConfig, RESIDUAL_MODES
from runs import read_checkpoint

REPO = Path(__file__).resolve().parent
# the quick-start config, shrunk further: each step takes milliseconds
TINY = ['config/delta_block_tiny.py', '--n_layer=2', '--n_embd=32', '--n_head=2', '--n_kv_head=1', '--head_dim=16',
        '--intermediate_size=64', '--n_blocks=2', '--block_size=32', '--batch_size=4', '--eval_iters=4',
        '--log_interval=1', '--warmup_iters=2', '--learning_rate=1e-2', '--min_lr=1e-3']


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A small byte-token dataset with some structure to learn (a few words, repeated)."""
    root = tmp_path_factory.mktemp('data')
    rng = np.random.default_rng(0)
    words = ['the ', 'cat ', 'sat ', 'on ', 'a ', 'mat. ', 'def f(x):\n    return x\n']
    docs = [''.join(rng.choice(words, size=rng.integers(10, 80))) for _ in range(300)]
    prep.prepare(docs, str(root / 'tiny'), 'tiny', 'byte', None, val_tokens=4000, shard_size=20_000, num_proc=1)
    return root


def train(corpus, out_dir, *args, torchrun=False, wrapper=None, check=True, cwd=REPO):
    """Run train.py as a user would (a fresh process) and return (completed process, log records).
    From another cwd than the repository's, train.py and the config file are given by their full paths."""
    cmd = [sys.executable]
    if torchrun:
        cmd += ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
    cmd += [str(wrapper), str(out_dir)] if wrapper else [str(Path(os.path.relpath(REPO, cwd)) / 'train.py')]
    cmd += [str(REPO / TINY[0]) if cwd != REPO else TINY[0]] + TINY[1:]
    cmd += ['--dataset=tiny', f'--data_root={corpus}', f'--out_dir={out_dir}', *args]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = Path(out_dir) / 'log.jsonl'
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return p, records


def write_checkpoint(path, model_state, model_config, config=None, meta=None):
    """A train.py checkpoint folder (DCP shards and state.json, as runs.save_checkpoint writes them) holding these
    weights and settings, without training: for the scripts that read one (export, eval_lm, report)."""
    import torch.distributed.checkpoint as dcp
    dcp.save({'model': model_state}, checkpoint_id=str(path), no_dist=True)
    state = dict(model_config=model_config, config=config or {}, meta=meta or {}, iter_num=0, data_pos=0,
                 best_val_loss=None, best_ckpt=None)
    (Path(path) / 'state.json').write_text(json.dumps(state))
    return str(path)


def checkpoint(out_dir, name='ckpt'):
    """A run's checkpoint (out_dir/ckpt: the latest; 'best') in one process, with its optimizer state."""
    return read_checkpoint(str(Path(out_dir) / name), optimizer=True)


def sha(path):
    """A file's hash, or a folder's: of its files' names and bytes."""
    path = Path(path)
    files = sorted(p for p in path.rglob('*') if p.is_file()) if path.is_dir() else [path]
    return hashlib.sha256(b''.join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


def losses(records):
    return {r['step']: r['loss'] for r in records if 'loss' in r}


def val_losses(records):
    return {r['step']: r['val_loss'] for r in records if 'val_loss' in r}


@pytest.mark.parametrize('residual', list(RESIDUAL_MODES))
def test_every_mode_lowers_the_loss(corpus, tmp_path, residual):
    p, records = train(corpus, tmp_path, f'--residual={residual}', '--max_iters=15', '--lr_decay_iters=15',
                       '--eval_interval=15')
    val = val_losses(records)
    assert set(val) == {0, 15}
    assert val[0] > math.log(257) - 0.5        # an untrained model is close to uniform over the bytes
    assert val[15] < val[0] - 1.0, val         # and 15 steps learn a lot of the corpus
    train_losses = losses(records)
    assert np.mean([train_losses[s] for s in (13, 14, 15)]) < train_losses[1] - 1.0
    assert f'step 15: val loss {val[15]:.4f}' in p.stdout
    assert (Path(tmp_path) / 'ckpt' / '.metadata').exists()

    routing = [r['routing'] for r in records if 'routing' in r]
    assert len(routing) == 15
    if residual == 'standard':
        assert routing[-1] == {} and 'routing' not in p.stdout
        return
    sites = {f'layers.{i}.{k}' for i in range(2) for k in ('attn', 'mlp')}
    assert set(routing[-1]) == sites | ({'final'} if residual in ('full_attnres', 'attnres') else set())
    assert 'routing max_w' in p.stdout
    for site, s in routing[-1].items():
        w = np.array(s['weights'])
        # invariants of softmax weights, checked on the logged numbers: they sum to one, the mean of
        # the per-token maximum is at least every source's mean weight, 0 <= entropy <= log(#sources)
        assert w.sum() == pytest.approx(1.0, abs=1e-5)
        assert s['max_weight'] >= w.max() - 1e-6
        assert -1e-6 <= s['entropy'] <= math.log(len(w)) + 1e-6
    assert routing[0]['layers.1.mlp']['max_weight'] == pytest.approx(1 / len(routing[0]['layers.1.mlp']['weights']),
                                                                      abs=0.02)  # zero-init queries: uniform


def test_the_authors_training_settings(corpus, tmp_path):
    # variant='official' + the settings where the authors' training differs: normal-init queries and
    # BF16 weights. learning_rate 0 keeps the initial weights, so the checkpoint shows the init itself.
    train(corpus, tmp_path, '--residual=delta_block', '--variant=official', '--routing_init_std=0.02',
          '--param_dtype=bfloat16', '--dtype=bfloat16', '--max_iters=2', '--eval_interval=2',
          '--learning_rate=0', '--min_lr=0')
    ckpt = checkpoint(tmp_path)
    assert ckpt['model_config']['variant'] == 'official'
    assert {t.dtype for t in ckpt['model'].values()} == {torch.bfloat16}
    queries = torch.cat([t.flatten().float() for k, t in ckpt['model'].items() if k.endswith('_res_proj.weight')])
    assert 'layers.0.attn_res_proj.weight' not in ckpt['model']          # the unrouted first attention
    assert len(queries) == 3 * 32 and 0.014 < queries.std().item() < 0.026 and queries.abs().min() > 0


def test_resume_is_bitwise_and_nonfinite_loss_stops(corpus, tmp_path):
    common = ['--lr_decay_iters=6', '--eval_interval=3']
    _, full = train(corpus, tmp_path / 'full', '--max_iters=6', *common)
    _, first = train(corpus, tmp_path / 'split', '--max_iters=3', *common)
    p, resumed = train(corpus, tmp_path / 'split', '--max_iters=6', '--init_from=resume', *common)
    assert 'resumed from' in p.stdout
    assert sorted(losses(full)) == sorted(losses(resumed)) == [1, 2, 3, 4, 5, 6]
    assert losses(first) == {s: l for s, l in losses(full).items() if s <= 3}
    assert losses(resumed) == losses(full)          # exactly equal floats, not approximately
    assert val_losses(resumed) == val_losses(full)
    a, b = checkpoint(tmp_path / 'full'), checkpoint(tmp_path / 'split')
    assert a['iter_num'] == b['iter_num'] == 6 and a['data_pos'] == b['data_pos'] == 6 * 4
    assert a['model'].keys() == b['model'].keys()
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    for k, state in a['optimizer']['state'].items():
        assert all(torch.equal(v, b['optimizer']['state'][k][n]) for n, v in state.items())
    assert b['config']['max_iters'] == 6 and b['model_config']['residual'] == 'delta_block'

    # resuming a run under another model shape is refused, naming what differs
    p, _ = train(corpus, tmp_path / 'split', '--max_iters=9', '--init_from=resume', '--n_blocks=1', *common, check=False)
    assert p.returncode != 0 and "differs from this config (checkpoint, now): {'n_blocks': (2, 1)}" in p.stderr

    # a NaN in the weights: the next step stops with a message and the last good checkpoint survives
    import torch.distributed.checkpoint as dcp
    b['model']['layers.0.mlp.up_proj.weight'][0, 0] = float('nan')
    dcp.save({'model': b['model'], 'optimizer': b['optimizer']}, checkpoint_id=tmp_path / 'split' / 'ckpt', no_dist=True)
    before = sha(tmp_path / 'split' / 'ckpt')
    # (log_interval 2: the host looks at step 8, the device skipped step 7's update without waiting)
    p, records = train(corpus, tmp_path / 'split', '--max_iters=9', '--init_from=resume', '--log_interval=2', *common,
                       check=False)
    assert p.returncode == 1
    assert 'step 7: non-finite loss (nan)' in p.stderr and 'stopped at step 8' in p.stderr and 'untouched' in p.stderr
    assert 'Traceback' not in p.stderr
    assert sha(tmp_path / 'split' / 'ckpt') == before
    assert max(losses(records)) == 6


# Runs train.py inside torchrun and keeps each rank's final weights, to compare them across ranks.
WRAPPER = """
import os, runpy, sys
import torch
sys.path.insert(0, os.getcwd())
out_dir = sys.argv[1]
sys.argv = ['train.py'] + sys.argv[2:]
g = runpy.run_path('train.py', run_name='__main__')
if not g['fsdp']:
    torch.save(g['raw_model'].state_dict(), os.path.join(out_dir, f"rank{os.environ.get('RANK', 0)}.pt"))
"""


def test_ddp_and_fsdp_two_processes_match_one(corpus, tmp_path):
    wrapper = tmp_path / 'wrapper.py'
    wrapper.write_text(WRAPPER)
    args = ['--max_iters=4', '--lr_decay_iters=4', '--eval_interval=2', '--gradient_accumulation_steps=2',
            '--residual=attnres']
    _, single = train(corpus, tmp_path / 'single', *args, wrapper=wrapper)
    p, ddp = train(corpus, tmp_path / 'ddp', *args, torchrun=True, wrapper=wrapper)
    assert '2 process(es) x 1 micro-batches x 4 x 32 = 256 tokens per step (DDP)' in p.stdout
    r0, r1 = (torch.load(tmp_path / 'ddp' / f'rank{r}.pt') for r in (0, 1))
    s = torch.load(tmp_path / 'single' / 'rank0.pt')
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # the ranks hold identical weights
    for k in s:  # and the same weights as one process with 2 micro-batches of the same global batch
        torch.testing.assert_close(r0[k], s[k], rtol=1e-4, atol=1e-5)
    for step, loss in losses(single).items():
        assert losses(ddp)[step] == pytest.approx(loss, rel=1e-5)
    assert val_losses(single).keys() == val_losses(ddp).keys() == {0, 2, 4}
    for step, loss in val_losses(single).items():  # the same val batches, split over the ranks
        assert val_losses(ddp)[step] == pytest.approx(loss, rel=1e-5)
    # at the end, the whole val split: every window once, recomputed here from the shard and the final weights
    final = [r for r in single if 'final_val_loss' in r]
    model = GPT(GPTConfig(**checkpoint(tmp_path / 'single')['model_config']))
    model.load_state_dict(s)
    val = np.fromfile(next((corpus / 'tiny').glob('*_val_*.bin')), dtype=np.uint16)[256 * 2:].astype(np.int64)
    n = (len(val) - 1) // 32
    windows = torch.from_numpy(np.stack([val[i * 32:i * 32 + 33] for i in range(n)]))
    with torch.no_grad():
        _, expected = model(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
    assert final == [dict(step=4, final_val_loss=pytest.approx(expected.item(), rel=1e-5), final_val_tokens=n * 32)]
    assert [r['final_val_loss'] for r in ddp if 'final_val_loss' in r] == [pytest.approx(expected.item(), rel=1e-5)]

    # FSDP2 with activation checkpointing: sharded training and a sharded checkpoint that reads like the others
    p, fsdp = train(corpus, tmp_path / 'fsdp', *args, '--fsdp=True', '--activation_checkpointing=True', torchrun=True)
    assert '(FSDP2, activation checkpointing)' in p.stdout
    assert sorted(f.name for f in (tmp_path / 'fsdp' / 'ckpt').glob('*.distcp')) == ['__0_0.distcp', '__1_0.distcp']
    a, b = checkpoint(tmp_path / 'single'), checkpoint(tmp_path / 'fsdp')
    assert a['model'].keys() == b['model'].keys()  # whole tensors, with the plain parameter names
    for k in a['model']:
        torch.testing.assert_close(b['model'][k], a['model'][k], rtol=1e-4, atol=1e-5)
    for step, loss in losses(single).items():
        assert losses(fsdp)[step] == pytest.approx(loss, rel=1e-5)
    assert [r['final_val_loss'] for r in fsdp if 'final_val_loss' in r] == [pytest.approx(expected.item(), rel=1e-5)]


# train.py, recording the dtype of the weights that the first layer's q_proj (a sharded unit under FSDP) and the LM
# head (the root) compute with, as the forward runs
DTYPES = """
import atexit, json, os, runpy, sys
import torch.nn as nn
sys.path.insert(0, os.getcwd())
out_dir, seen = sys.argv[1], {}
forward = nn.Linear.forward
def recording(self, x):
    seen[getattr(self, 'tag', None)] = str(self.weight.dtype)     # (the last: the training run's)
    return forward(self, x)
nn.Linear.forward = recording
import model
init = model.GPT.__init__
def tagged(self, *a, **k):
    init(self, *a, **k)
    self.layers[0].self_attn.q_proj.tag, self.lm_head.tag = 'q_proj', 'lm_head'
model.GPT.__init__ = tagged
atexit.register(lambda: json.dump(seen, open(os.path.join(out_dir, f"dtypes{os.environ['RANK']}.json"), 'w')))
sys.argv = ['train.py'] + sys.argv[2:]
runpy.run_path('train.py', run_name='__main__')
"""


def test_fsdp_gathers_the_layers_in_bf16_and_matches_ddp(corpus, tmp_path):
    # BF16 autocast: FSDP2 all-gathers the attention and MLP units in BF16 (half the traffic) and keeps the root
    # (embedding / LM head, norms, routing) in fp32; DDP's autocast rounds the same weights for the same matmuls
    wrapper = tmp_path / 'dtypes.py'
    wrapper.write_text(DTYPES)
    args = ['--max_iters=4', '--lr_decay_iters=4', '--eval_interval=4', '--gradient_accumulation_steps=2',
            '--residual=delta_attnres', '--dtype=bfloat16', '--final_eval=False']
    _, ddp = train(corpus, tmp_path / 'ddp', *args, torchrun=True, wrapper=wrapper)
    _, fsdp = train(corpus, tmp_path / 'fsdp', *args, '--fsdp=True', torchrun=True, wrapper=wrapper)
    for rank in (0, 1):
        seen = {run: json.loads((tmp_path / run / f'dtypes{rank}.json').read_text()) for run in ('ddp', 'fsdp')}
        assert seen['fsdp']['q_proj'] == 'torch.bfloat16' and seen['fsdp']['lm_head'] == 'torch.float32'
        assert seen['ddp']['q_proj'] == seen['ddp']['lm_head'] == 'torch.float32'
    for step, loss in losses(ddp).items():
        assert losses(fsdp)[step] == pytest.approx(loss, rel=2e-3)
    for step, loss in val_losses(ddp).items():
        assert val_losses(fsdp)[step] == pytest.approx(loss, rel=2e-3)


SLOW = pytest.mark.skipif(not os.environ.get('RUN_SLOW'), reason='inductor on 2 CPU cores takes minutes: RUN_SLOW=1')


# Several train.py runs in one process (imports and compiler start-up paid once), with torch.compile's backend
# set by COMPILE_BACKEND. Each out_dir starts from a fresh dynamo, as its own process would; runs that continue
# in the same out_dir (a resume) reuse its graphs, which its own process would compile again in the same way.
# The dynamo counters (graphs, graph breaks, recompiles) of all runs in an out_dir go to that out_dir.
RUNNER = """
import functools, json, os, runpy, sys
import torch
torch.compile = functools.partial(torch.compile, backend=os.environ['COMPILE_BACKEND'])
if 'DDP_BUCKET_CAP_MB' in os.environ:     # small gradient buckets: DDP's graph splitter then cuts the compiled graph
    import torch.nn.parallel
    class SmallBuckets(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, bucket_cap_mb=float(os.environ['DDP_BUCKET_CAP_MB']), **kwargs)
    torch.nn.parallel.DistributedDataParallel = SmallBuckets
sys.path.insert(0, os.getcwd())
previous = None
for out_dir, *args in json.loads(sys.argv[1]):
    if out_dir != previous:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    previous = out_dir
    sys.argv = ['train.py', *args, f'--out_dir={out_dir}']
    runpy.run_path('train.py', run_name='__main__')
    with open(os.path.join(out_dir, f"counters{os.environ.get('RANK', 0)}.json"), 'w') as f:
        json.dump({k: dict(v) for k, v in torch._dynamo.utils.counters.items()}, f)
"""


def train_in_one_process(corpus, runs, backend, torchrun=False, timeout=600, env=None):
    """runs: [(out_dir, train.py arguments after TINY)]. -> the completed process; one log/counters per out_dir."""
    runs = [[str(out_dir), *TINY, '--dataset=tiny', f'--data_root={corpus}', *args] for out_dir, *args in runs]
    launch = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '--no-python']
    cmd = (launch if torchrun else []) + [sys.executable, '-c', RUNNER, json.dumps(runs)]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'COMPILE_BACKEND': backend, **(env or {})}
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def records(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / 'log.jsonl').read_text().splitlines()]


def counters(out_dir, rank=0):
    return json.loads((Path(out_dir) / f'counters{rank}.json').read_text())


@pytest.mark.parametrize('backend', ['aot_eager', pytest.param('inductor', marks=SLOW)])
def test_ddp_compiled_whole_and_regional_equal_eager(corpus, tmp_path, backend):
    # the paper configs' path: torchrun, DDP, the model compiled whole or regionally; both equal eager. Whole,
    # DDP's graph splitter cuts the graph at its gradient buckets: 1 MiB buckets (the size of DDP's first) over a
    # 2 MiB model here, so that it does (at 1b, 25 MiB buckets: about 140 pieces)
    args = ['--max_iters=3', '--lr_decay_iters=3', '--eval_interval=3', '--gradient_accumulation_steps=4',
            '--residual=delta_attnres', '--n_embd=128', '--intermediate_size=512']
    _, eager = train(corpus, tmp_path / 'eager', *args)       # one eager process: what DDP equals (tested above)
    for run, extra in (('whole', []), ('regional', ['--compile_regional=True'])):    # (a process group each)
        p = train_in_one_process(corpus, [(tmp_path / run, *args, '--compile=True', *extra)], backend, torchrun=True,
                                 env={'DDP_BUCKET_CAP_MB': '1'})
        assert '2 process(es) x 2 micro-batches' in p.stdout and '(DDP)' in p.stdout
    for run in ('whole', 'regional'):
        for rank in (0, 1):
            c = counters(tmp_path / run, rank)
            assert not c.get('recompile_limit'), c
        compiled = records(tmp_path / run)
        for step, loss in losses(eager).items():
            assert losses(compiled)[step] == pytest.approx(loss, rel=1e-4), run
        for step, loss in val_losses(eager).items():
            assert val_losses(compiled)[step] == pytest.approx(loss, rel=1e-4), run
    c = counters(tmp_path / 'whole')        # each of dynamo's graphs split at the buckets: more pieces than graphs
    assert c['aot_autograd']['total'] > c['stats']['unique_graphs'], c


@pytest.mark.parametrize('backend', ['aot_eager', pytest.param('inductor', marks=SLOW)])
def test_fsdp_compiled_with_res_gate_matches_one_process(corpus, tmp_path, backend):
    # FSDP2 + compile: each sharded unit compiled once for all layers (no graph break, no recompile per layer
    # or routing site); FSDP2 + res_gate: the per-site gates shard; the losses are one eager process's
    args = ['--max_iters=3', '--lr_decay_iters=3', '--eval_interval=3', '--gradient_accumulation_steps=4',
            '--residual=delta_block', '--res_gate=True']
    _, single = train(corpus, tmp_path / 'single', *args)
    p = train_in_one_process(corpus, [(tmp_path / 'fsdp', *args, '--fsdp=True', '--activation_checkpointing=True',
                                       '--compile=True')], backend, torchrun=True)
    assert '2 process(es) x 2 micro-batches' in p.stdout and '(FSDP2, activation checkpointing)' in p.stdout
    for rank in (0, 1):
        c = counters(tmp_path / 'fsdp', rank)
        # attention and MLP, with and without gradients (training, evaluation), and the routing's graphs (test_bench.py)
        assert not c.get('graph_break') and not c.get('recompile_limit'), c
    fsdp = records(tmp_path / 'fsdp')
    for step, loss in losses(single).items():
        assert losses(fsdp)[step] == pytest.approx(loss, rel=1e-4)
    for step, loss in val_losses(single).items():
        assert val_losses(fsdp)[step] == pytest.approx(loss, rel=1e-4)
    a, b = checkpoint(tmp_path / 'single')['model'], checkpoint(tmp_path / 'fsdp')['model']
    assert a['layers.1.mlp_res_gate'].shape == (1,) and a['layers.1.mlp_res_gate'] != 1   # trained
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)


# Every mode compiled: with inductor, which also generates and runs the kernels (a minute or two per mode on 2 CPU
# cores), one sublayer mode and one block mode (both routing paths of fast_routing.py, replace and add mixing, the
# paper's Delta Block); the others with aot_eager (RUN_SLOW=1: inductor for every mode)
INDUCTOR_MODES = RESIDUAL_MODES if os.environ.get('RUN_SLOW') else ('full_attnres', 'delta_block')
AOT_EAGER_MODES = tuple(m for m in RESIDUAL_MODES if m not in INDUCTOR_MODES)
COMPILED = [('inductor', (m,)) for m in INDUCTOR_MODES] + ([('aot_eager', AOT_EAGER_MODES)] if AOT_EAGER_MODES else [])


@pytest.mark.parametrize('backend,modes', COMPILED, ids=[f"{b}-{'+'.join(m)}" for b, m in COMPILED])
def test_compiled_training_evaluation_and_resume_equal_eager(corpus, tmp_path, backend, modes):
    # What a GPU run does, compiled: evaluation at step 0 (a forward without gradients), training steps with and
    # without routing statistics, a checkpoint, a resume. aot_eager traces what inductor gets (dynamo's graph,
    # AOTAutograd's forward and backward: where most compiled-only failures live) in seconds; gpu_check.py runs
    # inductor's CUDA kernels on a GPU.
    args = ['--max_iters=4', '--lr_decay_iters=4', '--eval_interval=2', '--log_interval=2']
    runs = []
    for mode in modes:
        runs += [(tmp_path / mode / 'eager', f'--residual={mode}', *args, '--compile=False'),
                 (tmp_path / mode / 'compiled', f'--residual={mode}', *args, '--compile=True', '--max_iters=2'),
                 (tmp_path / mode / 'compiled', f'--residual={mode}', *args, '--compile=True', '--init_from=resume')]
    p = train_in_one_process(corpus, runs, backend, timeout=1800)
    assert p.stdout.count('resumed from') == len(modes)
    for mode in modes:
        eager, compiled = records(tmp_path / mode / 'eager'), records(tmp_path / mode / 'compiled')
        assert sorted(val_losses(compiled)) == [0, 2, 4] and sorted(losses(compiled)) == [2, 4], mode
        for step, loss in val_losses(eager).items():
            assert val_losses(compiled)[step] == pytest.approx(loss, rel=1e-4), (mode, step)
        for step, loss in losses(eager).items():
            assert losses(compiled)[step] == pytest.approx(loss, rel=1e-4), (mode, step)
        # one graph each for evaluation, training and training with routing statistics; no graph break
        c = counters(tmp_path / mode / 'compiled')
        assert c['stats']['unique_graphs'] == 3 and not c.get('graph_break'), (mode, c)


@pytest.mark.parametrize('backend', ['aot_eager', pytest.param('inductor', marks=SLOW)])
def test_regional_compile_equals_eager(corpus, tmp_path, backend):
    # compile_regional: each layer's attention and MLP compiled, one graph for all layers, and the routing math
    # compiled apart with dynamic shapes, so that compile time does not grow with the square of the depth
    args = ['--max_iters=3', '--lr_decay_iters=3', '--eval_interval=3', '--log_interval=1', '--n_layer=3']
    runs = []
    for mode in ('full_attnres', 'attnres'):
        runs += [(tmp_path / mode / 'eager', f'--residual={mode}', *args, '--compile=False'),
                 (tmp_path / mode / 'regional', f'--residual={mode}', *args, '--compile=True', '--compile_regional=True')]
    train_in_one_process(corpus, runs, backend)
    for mode in ('full_attnres', 'attnres'):
        eager, regional = records(tmp_path / mode / 'eager'), records(tmp_path / mode / 'regional')
        assert losses(regional) == pytest.approx(losses(eager), rel=1e-4) and len(losses(eager)) == 3
        assert val_losses(regional) == pytest.approx(val_losses(eager), rel=1e-4)
        c = counters(tmp_path / mode / 'regional')     # (how many graphs the routing takes: test_bench.py)
        assert not c.get('graph_break') and not c.get('recompile_limit'), (mode, c)


def test_settings_are_checked_before_any_work(corpus, tmp_path):
    # (bad data, batches that do not fit the data and bad config keys: test_data.py and below)
    # every bad setting is named with its value and what it must be, one line each, before anything is written
    bad = {'residual': "'delta'", 'batch_size': '0', 'block_size': '0', 'eval_interval': '0', 'log_interval': '0',
           'eval_iters': '0', 'max_iters': '-1', 'gradient_accumulation_steps': '0', 'warmup_iters': '10',
           'lr_decay_iters': '10', 'divergence_factor': '1', 'ddp_timeout_s': '0'}
    if not torch.cuda.is_available():
        bad['device'] = "'cuda'"     # (before any work, not an assertion deep inside torch)
    p, _ = train(corpus, tmp_path / 'out', *[f'--{k}={v.strip(chr(39))}' for k, v in bad.items()], check=False)
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and 'Traceback' not in p.stderr and not (tmp_path / 'out').exists()
    assert lines == [l for l in lines if l.startswith('error: ')] and len(lines) == len(bad) - 1  # lr_decay_iters: with warmup
    assert "error: residual='delta': expected one of standard, full_attnres" in p.stderr
    for k in ('batch_size', 'block_size', 'eval_interval', 'log_interval'):
        assert f'error: {k}=0: expected >= 1' in lines
    assert 'error: eval_iters=0: expected >= the number of processes, 1 (every rank evaluates a batch)' in lines
    assert 'error: max_iters=-1: expected >= 0' in lines
    assert 'error: warmup_iters=10: expected >= 0 and < lr_decay_iters=10 (decay_lr=True)' in lines
    assert ('error: gradient_accumulation_steps=0: expected >= 1 and divisible by the number of processes, 1 '
            '(it counts micro-batches over all processes)') in lines
    assert 'error: divergence_factor=1.0: expected > 1, or 0 to stop only on non-finite losses' in lines
    if 'device' in bad:
        assert "error: device='cuda': expected 'cpu', or 'cuda' / 'cuda:N' on a machine with CUDA (this one has none)" in lines
    # sample.py checks its settings before it loads a model (there is none here)
    p = subprocess.run([sys.executable, 'sample.py', '--temperature=-0.5', '--top_k=-1', '--num_samples=0',
                        '--max_new_tokens=0', f'--start=FILE:{tmp_path}/missing.txt', f'--out_dir={tmp_path}'],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.splitlines() == [
        'error: temperature=-0.5: expected 0 (greedy, always the most likely token) or a number from 1e-4 up',
        'error: top_k=-1: expected >= 0 (0: all tokens)', 'error: num_samples=0: expected >= 1',
        'error: max_new_tokens=0: expected >= 1', f"error: start='FILE:{tmp_path}/missing.txt': expected a prompt, "
        f"or FILE:path of a file"]


def test_runs_never_overwrite_a_good_checkpoint(corpus, tmp_path):
    out, common = tmp_path / 'run', ['--max_iters=4', '--eval_interval=2', '--lr_decay_iters=4']
    out.mkdir()
    (out / 'log.jsonl').write_text('old')   # an earlier run's log (and checkpoints), replaced with --overwrite=True
    # run from another directory: train.py finds configurator.py next to itself; says where checkpoints go
    p, records = train(corpus, out, *common, '--overwrite=True', cwd=tmp_path)
    assert sorted(val_losses(records)) == [0, 2, 4]
    assert f'step 2: saved {out}/step_000002 (best val loss so far)' in p.stdout
    assert f'step 4: saved {out}/step_000004 (best val loss so far)' in p.stdout
    assert sorted(f.name for f in out.iterdir()) == ['.lock', 'best', 'ckpt', 'log.jsonl', 'step_000004']  # step 2: gone
    assert os.readlink(out / 'ckpt') == os.readlink(out / 'best') == 'step_000004'   # no second copy on disk
    best_val = val_losses(records)[4]
    assert checkpoint(out)['best_ckpt'] == [4, best_val]
    good = {f: sha(out / f) for f in ('ckpt', 'best', 'log.jsonl')}

    # a new run in the same out_dir is refused, with the ways on; nothing is touched
    p, _ = train(corpus, out, *common, check=False)
    assert p.returncode == 1 and p.stderr == (
        f"error: out_dir={str(out)!r} holds the checkpoint {out}/ckpt of an earlier run; continue it with "
        f"--init_from=resume (or auto), replace it with --overwrite=True, or choose another --out_dir\n")
    assert {f: sha(out / f) for f in good} == good

    # divergence: at lr=3 the train loss explodes (finite); at lr=30 the val loss passes exp's range (ppl inf).
    # Both stop the run before a checkpoint is written.
    resume = ['--init_from=resume', '--max_iters=40', '--lr_decay_iters=40']
    p, records = train(corpus, out, *resume, '--eval_interval=20', '--learning_rate=3', '--min_lr=0.3', check=False)
    assert p.returncode == 1 and 'Traceback' not in p.stderr
    last = records[-1]
    assert last['loss'] > 2 * best_val and 'val_loss' not in last    # stopped at the first logged blow-up
    assert (f"step {last['step']}: train loss {last['loss']:.4g} is over divergence_factor=2.0 x the best val loss "
            f"{best_val:.4f}: the run diverged; stopped. The checkpoints are untouched: {out}/ckpt (step 4) and "
            f"{out}/best (step 4, val loss {best_val:.4f})") in p.stderr
    p, records = train(corpus, out, *resume, '--eval_interval=10', '--learning_rate=30', '--min_lr=3',
                       '--log_interval=100', check=False)
    assert p.returncode == 1 and records[-1]['step'] == 10 and records[-1]['val_loss'] > 709
    assert records[-1]['val_ppl'] == math.inf and 'val ppl inf' in p.stdout
    assert 'step 10: val loss' in p.stderr and 'is over divergence_factor=2.0' in p.stderr
    assert {f: sha(out / f) for f in ('ckpt', 'best')} == {f: good[f] for f in ('ckpt', 'best')}

    # resuming on another dataset (here: another tokenizer's meta) is refused, naming what differs
    other = tmp_path / 'data'
    shutil.copytree(Path(corpus) / 'tiny', other / 'tiny')
    meta = json.loads((other / 'tiny' / 'meta.json').read_text())
    (other / 'tiny' / 'meta.json').write_text(json.dumps({**meta, 'tokenizer': 'mine.json'}))
    p, _ = train(corpus, out, *resume, f'--data_root={other}', check=False)
    assert p.returncode == 1 and p.stderr == (
        f"error: {out}/ckpt was trained on another dataset than {other}/tiny (checkpoint, now): "
        f"{{'tokenizer': ('byte', 'mine.json')}}; resume with its --data_root/--dataset, or start a new run in another "
        f"--out_dir\n")

    # a damaged checkpoint folder: the message names it; sample.py's loader says the same
    (out / 'ckpt' / '.metadata').unlink()
    p, _ = train(corpus, out, *resume, check=False)
    assert p.returncode == 1 and p.stderr == (
        f"error: {out}/ckpt is not a complete checkpoint: {out}/ckpt/.metadata is missing (its save did not finish)\n")
    from checkpoints import load_model   # sample.py's and export.py's loader
    with pytest.raises(ValueError, match=f'{out}/ckpt is not a complete checkpoint'):
        load_model('resume', str(out))


# Runs train.py inside torchrun; rank 1 stops answering at its third step (a frozen process).
FROZEN_RANK = """
import os, runpy, sys, time
sys.path.insert(0, os.getcwd())
import data
calls, real = [], data.ShardLoader.train_batches
def train_batches(self):
    calls.append(1)
    if os.environ['RANK'] == '1' and len(calls) == 3:
        time.sleep(600)
    return real(self)
data.ShardLoader.train_batches = train_batches
sys.argv = ['train.py'] + sys.argv[2:]
runpy.run_path('train.py', run_name='__main__')
"""


def test_a_frozen_rank_ends_the_job_after_ddp_timeout_s(corpus, tmp_path):
    import time
    wrapper = tmp_path / 'frozen.py'
    wrapper.write_text(FROZEN_RANK)
    t0 = time.time()
    p, records = train(corpus, tmp_path / 'out', '--max_iters=10', '--eval_interval=5', '--lr_decay_iters=10',
                       '--gradient_accumulation_steps=2', '--ddp_timeout_s=3', torchrun=True, wrapper=wrapper,
                       check=False)
    assert p.returncode != 0 and time.time() - t0 < 120      # not the 600 s that rank 1 sleeps
    assert max(losses(records)) == 2                          # rank 0 waited at step 3 ...
    assert 'Timed out waiting 3000ms' in p.stderr             # ... for ddp_timeout_s, then gave up


def train_defaults():
    """train.py's settings before any override: the part of the file above `config_keys`."""
    src = (REPO / 'train.py').read_text()
    g = {}
    exec(src[:src.index('config_keys = ')], g)
    return {k: v for k, v in g.items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))}


def configure(monkeypatch, *argv):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, 'argv', ['train.py', *argv])
    g = train_defaults()
    exec((REPO / 'configurator.py').read_text(), g)
    return g


def test_configurator_overrides_and_errors(monkeypatch, tmp_path):
    g = configure(monkeypatch, '--learning_rate=1', '--out_dir=123', '--compile=False', '--vocab_size=512')
    assert (g['learning_rate'], g['out_dir'], g['compile'], g['vocab_size']) == (1.0, '123', False, 512)
    assert type(g['learning_rate']) is float
    with pytest.raises(ValueError, match="unknown config key 'lerning_rate'.*did you mean 'learning_rate'"):
        configure(monkeypatch, '--lerning_rate=1e-3')
    with pytest.raises(ValueError, match="'max_iters' .* must be int.*got float 1.5"):
        configure(monkeypatch, '--max_iters=1.5')
    with pytest.raises(ValueError, match="'final_eval' .* must be bool"):
        configure(monkeypatch, '--final_eval=1')
    with pytest.raises(ValueError, match='--key=value'):
        configure(monkeypatch, '--compile')
    bad = tmp_path / 'bad.py'
    bad.write_text("import math\nbatch_size = 8\nwarmup_iter = 10\n")
    with pytest.raises(ValueError, match="unknown config key 'warmup_iter' in .*bad.py"):
        configure(monkeypatch, str(bad))
    with pytest.raises(FileNotFoundError, match='config/nope.py'):
        configure(monkeypatch, 'config/nope.py')
    # later arguments win over earlier ones, a config file included
    g = configure(monkeypatch, 'config/delta_block_tiny.py', '--residual=standard')
    assert (g['residual'], g['dataset'], g['n_layer']) == ('standard', 'demo', 4)
    # a wrong type is named against the value the config file set, not train.py's default (10000)
    with pytest.raises(ValueError, match=r"'max_iters' in the command line must be int \(like its value so far, "
                                         r"600\), got str 'abc'"):
        configure(monkeypatch, 'config/delta_block_tiny.py', '--max_iters=abc')


# name -> (shape, residual); counts with Qwen3's 151,936-token vocabulary, as in the paper
PAPER = {'220m': (768, 12, 12, 4, 64, 3072, 220e6), '533m': (1024, 24, 16, 8, 64, 4096, 533e6),
         '1b': (1280, 36, 20, 4, 64, 5120, 1.04e9), '8b': (4096, 36, 32, 8, 128, 12288, 8.19e9)}


def test_paper_configs(monkeypatch):
    files = sorted(p.name for p in (REPO / 'config').glob('[!_]*.py')   # fine-tuning configs: test_pretrained.py
                   if not p.name.startswith(('finetune_', 'study_')))    # the CPU study's: test_study_configs
    expected = [f'{r}_{s}.py' for s in ('220m', '533m', '1b') for r in RESIDUAL_MODES]
    expected += [f'{r}_8b.py' for r in ('standard', 'attnres', 'delta_block')] + ['delta_block_tiny.py']
    assert files == sorted(expected), (f"every mode has a config per paper scale (config/MODE_SCALE.py): "
                                       f"missing {sorted(set(expected) - set(files))}, unknown {sorted(set(files) - set(expected))}")
    for name in expected[:-1]:
        residual, scale = name[:-3].rsplit('_', 1)
        g = configure(monkeypatch, f'config/{name}')
        d, L, H, KV, hd, ff, count = PAPER[scale]
        assert (g['residual'], g['n_embd'], g['n_layer'], g['n_head'], g['n_kv_head'], g['head_dim'],
                g['intermediate_size'], g['n_blocks']) == (residual, d, L, H, KV, hd, ff, 4)
        assert g['batch_size'] * g['gradient_accumulation_steps'] == 64        # sequences per step, every scale
        assert (g['batch_size'], g['block_size'], g['max_iters']) == (2 if scale == '8b' else 4, 2048, 10000)
        assert (g['beta1'], g['beta2'], g['weight_decay'], g['grad_clip']) == (0.9, 0.95, 0.1, 1.0)
        lr, min_lr, warmup = (3e-4, 3e-5, 500) if scale == '8b' else (6e-4, 6e-5, 1000)
        assert (g['learning_rate'], g['min_lr'], g['warmup_iters'], g['lr_decay_iters']) == (lr, min_lr, warmup, 10000)
        assert g['out_dir'] == f'out/{residual}_{scale}'
        assert g['fsdp'] == g['activation_checkpointing'] == (scale == '8b')
        assert g['compile_regional']        # a bounded first step under DDP (docs/training.md)
        if residual == 'standard':  # the parameter count the scale is named after (meta device: no memory)
            with torch.device('meta'):
                model = GPT(GPTConfig(vocab_size=151936, n_layer=L, n_head=H, n_kv_head=KV, n_embd=d, head_dim=hd,
                                      intermediate_size=ff, tie_embeddings=g['tie_embeddings'], residual=residual))
            assert model.get_num_params() == pytest.approx(count, rel=0.01)


def test_study_configs(monkeypatch):
    # results/cpu_study.sh (v1) and study_v2.sh run these: they must parse, and each conversion must fine-tune its
    # study's own shape
    study = configure(monkeypatch, 'config/study_cpu.py')
    convert = configure(monkeypatch, 'config/study_cpu_convert.py')
    shape = ('n_layer', 'n_embd', 'n_head', 'n_kv_head', 'head_dim', 'intermediate_size', 'block_size', 'dataset')
    assert [study[k] for k in shape] == [convert[k] for k in shape] == [12, 64, 4, 2, 16, 192, 64, 'demo']
    assert convert['init_from'] == 'out/study/convert/pretrained' and convert['seed'] != study['seed']
    assert study['max_iters'] == study['lr_decay_iters'] and convert['max_iters'] == convert['lr_decay_iters']
    # study v2 (results/study_v2.sh): 256-byte sequences, 4 per step; its conversion fine-tunes that shape, eagerly
    v2 = configure(monkeypatch, 'config/study_v2.py')
    v2_convert = configure(monkeypatch, 'config/study_v2_convert.py')
    assert [v2[k] for k in shape] == [v2_convert[k] for k in shape] == [12, 64, 4, 2, 16, 192, 256, 'demo']
    assert v2['batch_size'] * v2['block_size'] == study['batch_size'] * study['block_size'] == 1024
    assert v2['compile'] and v2['final_eval'] and not v2_convert['compile']
    assert v2_convert['init_from'] == 'out/study_v2/convert/pretrained' and v2_convert['max_iters'] == 120
