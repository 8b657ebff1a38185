"""Tests for the fast routing path (fast_routing.py, as GPT.forward calls it) and bench.py.
Run: python -m pytest -q"""

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fast_routing import group_passes, keys, mix, two_phase_groups
import model as model_module
from model import RESIDUAL_MODES, route
from test_model import make_model

MODES = list(RESIDUAL_MODES)
ROUTED = [m for m in MODES if m != 'standard']
# the model-level checks also run on a GPU where there is one (CI has none: there they are skipped)
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA device')
DEVICES = ['cpu', pytest.param('cuda', marks=ON_CUDA)]


def site(d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    proj, norm = nn.Linear(d, 1, bias=False), nn.RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        proj.weight.copy_(3 * torch.randn(1, d, generator=g) / math.sqrt(d))
        norm.weight.copy_(1 + 0.5 * torch.randn(d, generator=g))
    return proj.to(dtype), norm.to(dtype)


def both_routes(sources, proj, norm, grad_out):
    """Values and gradients (sources, w, g) of route() and the fast path for the same inputs."""
    results = []
    for fast in (False, True):
        srcs = [s.detach().clone().requires_grad_() for s in sources]
        proj.zero_grad(), norm.zero_grad()
        if fast:    # each source's keys at this one site (u = w * g), then the mix, as Routing does
            u = (proj.weight[0] * norm.weight).unsqueeze(0)
            out, alpha = mix(torch.stack([keys(s, u, norm.eps)[..., 0] for s in srcs]), srcs)
            out = out.to(sources[0].dtype)
        else:
            out, alpha = route(srcs, proj, norm)
        (out * grad_out).sum().backward()
        results.append([out, alpha] + [s.grad for s in srcs] + [proj.weight.grad.clone(), norm.weight.grad.clone()])
    return results


@pytest.mark.parametrize('n', [1, 2, 7])
def test_route_fast_matches_route_fp32(n):
    d = 32
    g = torch.Generator().manual_seed(n)
    sources = [torch.randn(2, 5, d, generator=g) * (1 + i) for i in range(n)]
    proj, norm = site(d, n)
    ref, fast = both_routes(sources, proj, norm, torch.randn(2, 5, d, generator=g))
    for r, f in zip(ref, fast):
        torch.testing.assert_close(f, r, rtol=1e-4, atol=1e-5)


def test_route_fast_matches_route_bf16():
    # both in bf16 against an fp32 evaluation of the same bf16 inputs: the fast path (fp32 math inside)
    # must be at least about as accurate as the plain route() run in bf16
    d = 64
    g = torch.Generator().manual_seed(3)
    sources = [(torch.randn(2, 8, d, generator=g) * (1 + i)).bfloat16() for i in range(9)]
    grad_out = torch.randn(2, 8, d, generator=g).bfloat16()
    proj, norm = site(d, 3, torch.bfloat16)
    ref_bf16, fast = both_routes(sources, proj, norm, grad_out)
    exact, _ = both_routes([s.float() for s in sources], proj.float(), norm.float(), grad_out.float())
    proj.bfloat16(), norm.bfloat16()
    err_fast, err_ref = [], []
    for r, f, e in zip(ref_bf16, fast, exact):
        assert f.dtype == r.dtype       # bf16, and fp32 for alpha
        err_fast.append(((f.float() - e).abs().max() / e.abs().max()).item())
        err_ref.append(((r.float() - e).abs().max() / e.abs().max()).item())
    assert max(err_fast) <= 0.02                      # bf16 rounding (2^-8) of results and inputs
    assert sum(err_fast) <= sum(err_ref)              # fp32 math inside: no worse than route() in bf16


def loss_and_grads(model, idx, fast, dtype=None):
    model.zero_grad(set_to_none=True)
    model.fast_routing = fast
    device = idx.device.type
    ctx = torch.autocast(device, dtype=dtype) if dtype else torch.autocast(device, enabled=False)
    with ctx:
        logits, loss = model(idx, idx)
    loss.backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


def model_and_tokens(mode, device='cpu', **kw):
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    return make_model(mode, **kw).to(device), idx.to(device)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('n_blocks', [2, 5])
@pytest.mark.parametrize('mode', ROUTED + ['delta_attnres+official', 'delta_block+official',
                                  'delta_attnres+gate', 'delta_block+gate'])
def test_model_fast_equals_naive(mode, n_blocks, device):
    residual, *extra = mode.split('+')
    model, idx = model_and_tokens(residual, device, n_blocks=n_blocks, variant='official' if 'official' in extra else 'paper',
                                  res_gate='gate' in extra)
    with torch.no_grad():       # gates other than 1 (and one at 0, where a gate starts in a converted model)
        for i, (_, _, gate) in enumerate(model.routing_parameters() if 'gate' in extra else []):
            gate.fill_(0.0 if i == 1 else 0.5 + 0.1 * i)
    logits_n, grads_n = loss_and_grads(model, idx, fast=False)
    logits_f, grads_f = loss_and_grads(model, idx, fast=True)
    assert (logits_f - logits_n).abs().max() <= 1e-5 * logits_n.abs().max()
    # fp32 rounding, relative to each gradient's largest entry; for the gates, to the largest gate gradient: a gate's
    # gradient is one sum over every token of <mix, dL/dx>, which cancels down to 1/70 of another site's here, so its
    # own size does not measure its rounding (4.7e-9 of 4.5e-5 at layers.0.attn_res_gate on an AVX512 CPU)
    gates = max((g.abs().max() for n, g in grads_n.items() if n.endswith('res_gate')), default=None)
    for name in grads_n:
        scale = gates if name.endswith('res_gate') else grads_n[name].abs().max()
        assert (grads_f[name] - grads_n[name]).abs().max() <= 1e-4 * scale, name


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('mode', ROUTED)
def test_model_fast_equals_naive_bf16_autocast(mode, device):
    # under BF16 autocast both paths differ from FP32 by rounding; the fast path must be no further from the FP32
    # result than the plain route() is. Tiny random-routing models amplify rounding chaotically, so one seed's
    # comparison is a coin that the CPU's BF16 kernels flip (Full AttnRes, seed 0: summed gradient errors fast /
    # route() 9.6 / 4.0 on an AMD EPYC with AVX2, within 2x on the Intel Xeons that ran this before; route()'s own
    # logits error reaches 0.12 on one input). Summed over six seeds, logits and gradients, they are 0.86, 0.75, 1.03,
    # 1.00 of route()'s for full_attnres, attnres, delta_attnres, delta_block on that EPYC. A wrong gradient under autocast fails here (10% too much in the sources' gradient of the keys sums to
    # 1.6-2.8x route()'s, no query gradient to 2.3-19x); the fast path's FP32 math inside is tested on one site,
    # where nothing amplifies rounding (test_route_fast_matches_route_bf16)
    def err(a, b):
        return ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    err_fast = err_route = 0.0
    for seed in range(6):
        model = make_model(mode, seed=seed).to(device)
        idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1 + seed)).to(device)
        logits_x, grads_x = loss_and_grads(model, idx, fast=False)
        logits_n, grads_n = loss_and_grads(model, idx, fast=False, dtype=torch.bfloat16)
        logits_f, grads_f = loss_and_grads(model, idx, fast=True, dtype=torch.bfloat16)
        assert logits_f.dtype == logits_n.dtype == torch.bfloat16
        err_fast += err(logits_f, logits_x) + sum(err(grads_f[k], grads_x[k]) for k in grads_x)
        err_route += err(logits_n, logits_x) + sum(err(grads_n[k], grads_x[k]) for k in grads_x)
    assert err_fast <= 1.5 * err_route, (err_fast, err_route)


@pytest.mark.parametrize('mode', ['full_attnres', 'delta_attnres'])
def test_bf16_routing_stacks_and_keys_are_bf16(monkeypatch, mode):
    # under BF16 autocast every routing source enters the fast path in BF16, the fp32 embedding E included: one fp32
    # source would make each two-phase stack (and its traffic) fp32
    import fast_routing
    model = make_model(mode, n_layer=6)
    model_module.check_fast_routing(model.config)   # (its tiny fp32 model first: not what is spied on below)
    seen = []
    stack, keys_op = fast_routing._stack, fast_routing.EAGER.keys
    monkeypatch.setattr(fast_routing, '_stack', lambda sources: seen.append(('stack', {s.dtype for s in sources}))
                        or stack(sources))
    monkeypatch.setattr(fast_routing.EAGER, 'keys', lambda s, U, r: seen.append(('keys', {s.dtype})) or keys_op(s, U, r))
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert {kind for kind, _ in seen} == {'stack', 'keys'}       # both paths ran (and the stack in backward too)
    assert all(dtypes == {torch.bfloat16} for _, dtypes in seen), seen


def saved_bytes(model, idx):
    model_module.check_fast_routing(model.config)   # (its tiny model's tensors are not this model's: before the hooks)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    return sum(seen.values())


def test_fast_routing_memory_is_linear_in_depth():
    # extra saved bytes over 'standard', two-phase routing: each source once and each group's first residual stream
    # (B x T x d, linear in depth), and about one fp32 routing weight per token for each (site, source) pair (B x T,
    # quadratic in depth but d times smaller), nothing else: no per-site copy (the sublayer input that phase 2 keeps
    # is the one the sublayer's RMSNorm keeps)
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    for L in (4, 8):
        std = saved_bytes(make_model('standard', n_layer=L), idx)
        model = make_model('delta_attnres', n_layer=L)
        extra = saved_bytes(model, idx) - std
        source_bytes, pair_bytes = 2 * 16 * 32 * 4, 2 * 16 * 4
        sites = 2 * L
        groups = len(model.routing_groups)      # over the sites after the first, which sees E only and mixes alone
        assert model.routing_groups[0][0] == 1 and sum(size for _, size in model.routing_groups) == sites - 1
        expected = (2 * L + 1 + groups) * source_bytes + (sum(model.routing_sources()) + sites) * pair_bytes
        assert expected * 0.95 <= extra <= expected * 1.05, (L, extra, expected)


# aot_eager traces what inductor gets (dynamo graph + AOTAutograd joint graph through the custom
# autograd.Function) in seconds; inductor itself takes minutes on 2 CPU cores: RUN_SLOW=1 adds it.
# With a GPU, inductor compiles real CUDA kernels for three modes.
BACKENDS = [('delta_attnres', 'aot_eager', 'cpu')] + (
    [('attnres', 'aot_eager', 'cpu'), ('delta_attnres', 'inductor', 'cpu'), ('attnres', 'inductor', 'cpu')]
    if os.environ.get('RUN_SLOW') else []) + [
    pytest.param(mode, 'inductor', 'cuda', marks=ON_CUDA) for mode in ('delta_attnres', 'delta_block', 'attnres')]


@pytest.mark.parametrize('mode,backend,device', BACKENDS)
def test_compiled_equals_eager_one_graph(mode, backend, device):
    # fullgraph=True: no graph break anywhere (so none per layer); two steps: no recompilation
    import torch._dynamo
    torch._dynamo.reset()
    model, idx = model_and_tokens(mode, device, n_layer=3)
    logits_e, grads_e = loss_and_grads(model, idx, fast=True)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    torch._dynamo.utils.counters.clear()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logits_c, loss = compiled(idx, idx)
        loss.backward()
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] == 1
    assert not torch._dynamo.utils.counters['graph_break']
    assert (logits_c - logits_e).abs().max() <= 1e-4 * logits_e.abs().max()
    for name, p in model.named_parameters():
        assert (p.grad - grads_e[name]).abs().max() <= 1e-3 * grads_e[name].abs().max().clamp_min(1e-12), name


# compile_regional: the layers' units and the routing math compiled apart, the routing's with dynamic shapes, so that
# every routing site runs one of a few graphs: compile time that does not grow with the square of the depth
REGIONAL_BACKENDS = [('aot_eager', 'cpu'), pytest.param('inductor', 'cpu', marks=pytest.mark.skipif(
    not os.environ.get('RUN_SLOW'), reason='inductor: minutes on 2 CPU cores (RUN_SLOW=1)')),
    pytest.param('inductor', 'cuda', marks=ON_CUDA)]


@pytest.mark.parametrize('backend,device', REGIONAL_BACKENDS)
@pytest.mark.parametrize('mode', ['delta_attnres+gate', 'delta_block+official+gate'])   # replace: test_train.py
def test_regional_compile_equals_route_and_its_graphs_do_not_grow_with_depth(mode, backend, device, monkeypatch):
    import functools
    import torch._dynamo
    residual, *extra = mode.split('+')
    monkeypatch.setattr(torch, 'compile', functools.partial(torch.compile, backend=backend))
    graphs = {}
    for L in (2, 4):
        torch._dynamo.reset()
        model, idx = model_and_tokens(residual, device, n_layer=L, n_blocks=2, variant='official' if 'official' in extra else 'paper',
                                      res_gate='gate' in extra)
        with torch.no_grad():
            for i, (_, _, gate) in enumerate(model.routing_parameters() if 'gate' in extra else []):
                gate.fill_(0.5 + 0.1 * i)
        logits_n, grads_n = loss_and_grads(model, idx, fast=False)         # route(), eagerly: the specification
        with torch.no_grad():
            val_n, _ = model(idx)
        limit = model.compile_regional()     # the routing's graphs per function: dynamo's limit must allow them
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.utils.counters.clear()
        for _ in range(2):                                                  # the second step: no recompilation
            logits_c, grads_c = loss_and_grads(model, idx, fast=True)
        with torch.no_grad():                                               # evaluation
            val_c, _ = model(idx)
        c = torch._dynamo.utils.counters
        assert not c['graph_break'] and not c['recompile_limit'], dict(c)
        graphs[L] = c['stats']['unique_graphs']
        for a, b in ((logits_c, logits_n), (val_c, val_n)):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        gates = max((g.abs().max() for n, g in grads_n.items() if n.endswith('res_gate')), default=None)
        for name in grads_n:    # (a gate's gradient cancels: scaled as in test_model_fast_equals_naive)
            scale = gates if name.endswith('res_gate') else grads_n[name].abs().max().clamp_min(1e-12)
            assert (grads_c[name] - grads_n[name]).abs().max() <= 1e-4 * scale, name
        if L == 2:
            small = model.routing_groups
    # the block modes: the same graphs at any depth; the sublayer modes: phase 2 has one graph per number of sources a
    # site merges (and its backward one), so theirs grow with the largest group (about sqrt(depth)), no faster (give or
    # take the sizes that dynamic shapes specialise on: 0 and 1)
    largest = lambda groups: max(size for _, size in groups)
    growth = 0 if small is None else 2 * (largest(model.routing_groups) - largest(small)) + 4
    assert graphs[4] <= graphs[2] + growth, (graphs, small, model.routing_groups)


# Evaluation, sampling and any inference run the compiled model without gradients. There dynamo
# takes another path through autograd.Function than in training (it calls forward() itself), which
# once crashed every compiled run at its step-0 evaluation while the training-step test above passed.
# test_train.py's compiled end-to-end run covers torch.no_grad (train.py's evaluation) in every mode;
# these are the other ways to run without gradients.
NO_GRAD_CONTEXTS = {'inference_mode': torch.inference_mode,
                    'frozen': torch.enable_grad}   # frozen: gradients on, but no parameter requires one


@pytest.mark.parametrize('context', NO_GRAD_CONTEXTS)
@pytest.mark.parametrize('mode', ROUTED)
def test_compiled_without_gradients_equals_eager(mode, context):
    import torch._dynamo
    torch._dynamo.reset()
    model, idx = model_and_tokens(mode, n_layer=2)
    if context == 'frozen':
        model.requires_grad_(False)
    with NO_GRAD_CONTEXTS[context]():
        logits_e, _ = model(idx)
        compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
        torch._dynamo.utils.counters.clear()
        for _ in range(2):
            logits_c, _ = compiled(idx)
        _, _, stats = compiled(idx, stats=True)   # the routing statistics report.py reads
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] == 2   # plain and stats=True, no recompile
    assert (logits_c - logits_e).abs().max() <= 1e-5 * logits_e.abs().max()
    assert len(stats) == len(model.routing_sources())


TINY_BENCH = ['--n_layer=2', '--n_embd=32', '--n_head=2', '--n_kv_head=1', '--head_dim=16',
              '--intermediate_size=64', '--vocab_size=64', '--block_size=16', '--batch_size=2',
              '--warmup=1', '--repeats=2', '--steps=1', '--n_blocks=2', '--device=cpu', '--compile=False']


def bench_process(*args):
    root = Path(__file__).resolve().parent
    return subprocess.run([sys.executable, 'bench.py', *TINY_BENCH, *args], cwd=root, capture_output=True,
                          text=True, timeout=120)


def run_bench(*args):
    out = bench_process(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_bench_prints_a_row_per_mode():
    text = run_bench('--routing=both')
    lines = text.splitlines()
    assert any('saved' in l and 'each storage once' in l for l in lines)
    for mode in MODES:
        assert any(l.split()[:1] == [mode] and not l.split()[1].startswith('(') for l in lines), mode
        if mode != 'standard':
            assert any(l.startswith(f'{mode} (naive)') for l in lines), mode


def test_bench_json():
    doc = json.loads(run_bench('--json', '--residual=delta_attnres,attnres', '--routing=both'))
    rows = doc['rows']
    assert [(r['mode'], r['routing']) for r in rows] == [('standard', 'fast'), ('delta_attnres', 'fast'), ('delta_attnres', 'naive'),
                                                         ('attnres', 'fast'), ('attnres', 'naive')]
    std, delta = rows[:2]
    assert std['tok_per_s_ratio'] == 1.0 and std['saved_ratio'] == 1.0
    assert delta['tok_per_s'] > 0 and delta['saved_bytes'] > std['saved_bytes']
    lo, hi = delta['tok_per_s_ratio_range']         # the per-round ratios around their median
    assert 0 < lo <= delta['tok_per_s_ratio'] <= hi
    # the bound: the row's schedule (fast: two-phase; naive: route()) moving its modelled bytes per token for the
    # step's 2 x 16 tokens at the measured bandwidth, on top of standard's step
    assert doc['setup']['bandwidth'] > 0
    for r in rows[1:]:
        traffic = doc['traffic']['this'][r['mode']]['two_phase' if r['routing'] == 'fast' else 'route']
        t = traffic * 2 * 16 / doc['setup']['bandwidth']
        assert r['routing_traffic_s'] == pytest.approx(t)
        assert r['tok_per_s_ratio_bound'] == pytest.approx(std['seconds_per_step'] / (std['seconds_per_step'] + t))


def test_bench_ratios_are_against_standard_wherever_it_is_listed():
    # listing a mode first (for its cold compile, as bench.py's help says) leaves standard the reference of every ratio
    doc = json.loads(run_bench('--json', '--residual=delta_attnres,standard'))
    delta, std = doc['rows']
    assert (delta['mode'], std['mode']) == ('delta_attnres', 'standard')
    assert std['tok_per_s_ratio'] == 1.0 and std['saved_ratio'] == 1.0
    assert delta['tok_per_s_ratio'] == statistics.median(s / d for s, d in zip(std['times'], delta['times']))
    assert delta['saved_ratio'] == delta['saved_bytes'] / std['saved_bytes'] > 1
    assert delta['tok_per_s_ratio_bound'] == pytest.approx(
        std['seconds_per_step'] / (std['seconds_per_step'] + delta['routing_traffic_s']))


def test_bench_routing_traffic_model():
    # the modelled traffic (docs/routing.md), counted here site by site for TINY_BENCH's 2 layers, d=32, fp32
    traffic = json.loads(run_bench('--json', '--residual=delta_attnres,delta_block'))['traffic']
    passes = {m: {k: v / (32 * 4) for k, v in t.items()} for m, t in traffic['this'].items()}
    # delta_attnres: 4 sites over 1..4 sources, 4 completed sources at the last. Two-phase: the first site (E only)
    # mixes alone, then the cheapest groups of sites 2-4: one group over 2 earlier sources (10*2 + 5*3 + 10 + 16 + 22
    # = 83 passes) beats 2 + 1 sites (56 + 55), 1 + 2 (35 + 66) and 1 + 1 + 1 (35 + 45 + 55)
    assert passes['delta_attnres']['route'] == sum(19 * n + 3 for n in (1, 2, 3, 4))
    assert passes['delta_attnres']['keys_mix'] == sum(8 * n + 1 for n in (1, 2, 3, 4)) + 10 * 4
    assert passes['delta_attnres']['two_phase'] == (8 + 1) + 10 * 4 + (10 * 2 + 5 * 3 + 10 + 16 + 22)
    # delta_block keeps keys + mix
    assert passes['delta_block']['two_phase'] == passes['delta_block']['keys_mix']
    # at the paper's 1b shape, the sublayer modes' two-phase schedule reads and writes far less than route() and
    # keys + mix (8.7x and 3.8x less, stacking the sources for phase 1 included)
    big = traffic['1b']['delta_attnres']
    assert set(big) == {'route', 'keys_mix', 'two_phase'}
    assert big['route'] / big['two_phase'] > 8 and big['keys_mix'] / big['two_phase'] > 3.5


def test_two_phase_groups_are_the_cheapest():
    # every way to cut the sites into consecutive groups, priced with group_passes, against the dynamic programme
    def cheapest(n):
        return min(group_passes(n[:g]) + (cheapest(n[g:]) if g < len(n) else 0) for g in range(1, len(n) + 1))
    for n in ([2], [2, 3, 4], list(range(2, 14)), [3, 3, 5, 6, 6, 8, 9, 9, 11]):
        sizes = two_phase_groups(n)
        starts = [0, *itertools.accumulate(sizes)]
        assert starts[-1] == len(n) and min(sizes) >= 1
        assert sum(group_passes(n[a:b]) for a, b in zip(starts, starts[1:])) == cheapest(n)
    # the groups grow with depth: at 36 layers from 3 sites to more than twice as many
    sizes = two_phase_groups(list(range(2, 73)))
    assert sizes[0] == 3 and sizes[-1] >= 2 * sizes[0] and sum(sizes) == 71


def test_bench_rejects_an_unknown_mode():
    out = bench_process('--residual=delta_block,delta')
    assert out.returncode != 0 and 'Traceback' not in out.stderr and out.stderr.startswith(
        "error: residual='delta_block,delta': expected 'all' or modes from standard, full_attnres")


@ON_CUDA
def test_bench_on_cuda_compiled_bf16():
    # the GPU columns: peak memory of each mode alone, and MFU against a given peak
    rows = json.loads(run_bench('--json', '--residual=delta_block', '--device=cuda', '--compile=True',
                                '--dtype=bfloat16', '--peak_flops=1e12'))['rows']
    assert [r['mode'] for r in rows] == ['standard', 'delta_block']
    for r in rows:
        assert r['peak_bytes'] > 0 and r['peak_ratio'] > 0 and 0 < r['mfu'] < 1


def test_bench_shows_progress_from_any_directory(tmp_path):
    # run from another directory (configurator.py is found next to bench.py); progress goes to stderr, so that
    # stdout holds only the table (or the JSON)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / 'bench.py'), *TINY_BENCH,
                          '--residual=standard', '--json'], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'warm up: 100%' in out.stderr and 'timed rounds of 1 models: 100%' in out.stderr and '2/2 [' in out.stderr
    doc = json.loads(out.stdout)
    assert [r['mode'] for r in doc['rows']] == ['standard']
    assert doc['setup']['bandwidth'] is None        # nothing routed: no bound to price, no bandwidth measured


# bench.py in a fresh process with torch.compile's backend set to 'eager' (dynamo's graphs, run as they are:
# seconds instead of minutes for inductor), reporting dynamo's counters
COMPILE_COUNTING_BENCH = """
import functools, json, runpy, sys
import torch
torch.compile = functools.partial(torch.compile, backend='eager')
sys.argv = ['bench.py'] + sys.argv[1:]
runpy.run_path('bench.py', run_name='__main__')
c = torch._dynamo.utils.counters
print(json.dumps(dict(graphs=c['stats']['unique_graphs'], breaks=sum(c['graph_break'].values()))), file=sys.stderr)
"""


def test_bench_compiles_every_row():
    # --routing=both: 9 models with the five modes, one more than dynamo's default recompile limit; the ninth must be
    # compiled too, not run eagerly while the table says compile=True
    root = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, '-c', COMPILE_COUNTING_BENCH, *TINY_BENCH[:-1], '--compile=True',
                          '--routing=both', '--json'], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)['rows']
    models = 1 + 2 * len(ROUTED)        # standard, then every routed mode fast and naive
    assert len(rows) == models, [(r['mode'], r['routing']) for r in rows]
    counts = json.loads(out.stderr.splitlines()[-1])
    assert counts == {'graphs': models, 'breaks': 0}, (
        f"{models} models compiled to {counts['graphs']} dynamo graphs with {counts['breaks']} graph breaks, expected "
        f"{models} and 0: fewer graphs means two modes compiled to one (modes with the same switches compute the "
        f"same: test_model.py's test_reference_detects_other_source_sets names the pair)")
    assert 'recompile_limit' not in out.stderr


def test_bench_says_when_its_rounds_disagree(monkeypatch):
    """A table from rounds that disagree (another job took the cores for a while) carries one line saying that its
    speeds and ratios cannot be trusted (issue 50: standard 185 tok/s, delta_attnres 688, 'paired x' 0.94)."""
    import runpy
    monkeypatch.setattr(sys, 'argv', ['bench.py'])
    bench = runpy.run_path(str(Path(__file__).parent / 'bench.py'), run_name='bench')
    calm = [dict(mode='standard', round_spread=1.05), dict(mode='delta_attnres', round_spread=1.2)]
    assert bench['noise_warning'](calm) is None
    loud = calm + [dict(mode='attnres', round_spread=4.5)]
    warning = bench['noise_warning'](loud)
    assert warning.startswith('WARNING: the rounds disagree: 1 of 3 models ran up to 4.5x slower') and \
        'cannot be trusted' in warning
    # steady times, but the load hit the mode's turn in one round and standard's in the others
    assert bench['round_spread']([1.2, 1.0, 1.2], [1.0, 1.2, 1.0]) == pytest.approx(1.44)
    assert bench['round_spread']([2.0, 2.1, 2.0], [1.0, 1.0, 1.05]) == pytest.approx(1.05 ** 2)
