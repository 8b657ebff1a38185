"""Tests for model.py. Run: python -m pytest -q"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import model as model_module
from checkpoints import load_hf
from model import GPT, GPTConfig, RESIDUAL_MODES

MODES = list(RESIDUAL_MODES)
ROUTED = [m for m in MODES if m != 'standard']


def tiny_config(**kw):
    cfg = dict(vocab_size=61, block_size=16, n_layer=5, n_head=4, n_kv_head=2, n_embd=32, head_dim=8,
               intermediate_size=48, residual='standard', n_blocks=2)
    cfg.update(kw)
    return GPTConfig(**cfg)


def randomize_routing(model, seed=0):
    """Non-zero queries and key-norm weights: with zero queries every mode is a rescaled standard
    stream that pre-norm cannot see, so only random routing tests which sources are routed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('_res_proj.weight'):
                p.copy_(3 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith('_res_norm.weight'):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def make_model(residual, seed=0, **kw):
    torch.manual_seed(seed)
    return randomize_routing(GPT(tiny_config(residual=residual, **kw)), seed).eval()


# -----------------------------------------------------------------------------
# A slow reference written straight from the papers' definitions, with plain lists and loops and its
# own routing arithmetic. It shares only the sublayer functions f_j (attention, MLP) with model.py;
# those are checked against Hugging Face's Qwen3 below.

def ref_route(sources, proj, norm):
    w, g, eps = proj.weight[0], norm.weight, norm.eps
    logits = []
    for s in sources:
        key = s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) * g      # RMSNorm(s_i)
        logits.append((key * w).sum(-1))                                    # w . RMSNorm(s_i)
    m = torch.stack(logits).max(0).values
    exps = [torch.exp(l - m) for l in logits]
    Z = sum(exps)
    return sum((e / Z).unsqueeze(-1) * s for e, s in zip(exps, sources))


def reference_forward(model, idx):
    cfg = model.config
    L, lpb = cfg.n_layer, math.ceil(cfg.n_layer / cfg.n_blocks)
    T = idx.shape[1]
    cos, sin = model_module.rope_tables(cfg.head_dim, T, cfg.rope_theta)
    E = model.embed_tokens.weight[idx]
    # sublayer j = (f_j, routing site j): attention then MLP of each layer, each with its own pre-norm
    fs, sites = [], []
    for layer in model.layers:
        fs.append(lambda x, l=layer: l.self_attn(l.input_layernorm(x), cos, sin))
        fs.append(lambda x, l=layer: l.mlp(l.post_attention_layernorm(x)))
        sites.append((getattr(layer, 'attn_res_proj', None), getattr(layer, 'attn_res_norm', None)))
        sites.append((getattr(layer, 'mlp_res_proj', None), getattr(layer, 'mlp_res_norm', None)))
    mode = cfg.residual

    if mode == 'standard':
        h = E
        for f in fs:
            h = h + f(h)
    elif mode == 'full_attnres':                      # x_j = sum a v over [E, v_0 .. v_{j-1}]
        vs = [E]
        for j, f in enumerate(fs):
            vs.append(f(ref_route(vs, *sites[j])))
        h = ref_route(vs, model.final_res_proj, model.final_res_norm)
    elif mode == 'delta_attnres':                     # x_j = h + sum a v over [E, v_0 .. v_{j-1}]
        h, vs = E, [E]
        for j, f in enumerate(fs):
            v = f(h + ref_route(vs, *sites[j]))
            h = h + v
            vs.append(v)
    elif mode == 'attnres':                           # Kimi's block pseudocode, literally
        blocks, partial = [], E
        for i in range(L):
            x = ref_route(blocks + [partial], *sites[2 * i])
            if i % lpb == 0:
                blocks.append(partial)
                partial = None
            v = fs[2 * i](x)
            partial = v if partial is None else partial + v
            x = ref_route(blocks + [partial], *sites[2 * i + 1])
            partial = partial + fs[2 * i + 1](x)
        h = ref_route(blocks + [partial], model.final_res_proj, model.final_res_norm)
    elif mode == 'delta_block':                       # Delta_b = h(end of block b) - h(start of block b)
        h, deltas, start = E, [E], E
        for i in range(L):
            if i % lpb == 0 and i > 0:
                deltas.append(h - start)
                start = h
            for j in (2 * i, 2 * i + 1):
                partial = [] if (j % 2 == 0 and i % lpb == 0) else [h - start]
                h = h + fs[j](h + ref_route(deltas + partial, *sites[j]))
    else:
        raise NotImplementedError(f"test_model.reference_forward has no branch for residual={mode!r}: add one, written "
                                  f"from your mode's definition with plain lists and ref_route (not model.py's loop)")
    return model.lm_head(model.norm(h))


@pytest.mark.parametrize('n_blocks', [2, 3, 5])
@pytest.mark.parametrize('mode', MODES)
def test_matches_reference(mode, n_blocks):
    # n_layer=5: n_blocks 2 -> blocks of 3+2 layers, 3 -> 2+2+1, 5 -> one layer each
    model = make_model(mode, n_blocks=n_blocks)
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(idx)
        ref = reference_forward(model, idx)
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize('mode', ROUTED)
def test_one_seed_gives_every_mode_the_same_weights(mode):
    # a comparison of modes at one seed differs only in the routing: every tensor that 'standard' has starts bit for
    # bit the same in every mode, variant and gate setting (the pseudo-queries take no random draws)
    torch.manual_seed(0)
    standard = GPT(tiny_config()).state_dict()
    for variant in ('paper', 'official'):
        for gate in ((False, True) if RESIDUAL_MODES[mode][1] == 'add' else (False,)):
            torch.manual_seed(0)
            routed = GPT(tiny_config(residual=mode, variant=variant, res_gate=gate)).state_dict()
            assert set(standard) == {k for k in routed if not GPT.is_routing(k)}
            differ = [k for k in standard if not torch.equal(standard[k], routed[k])]
            assert not differ, f"{mode} {variant} gate={gate}: {len(differ)} tensors differ from standard's, e.g. {differ[:3]}"
            assert all(routed[k].eq(0).all() for k in routed if k.endswith('_res_proj.weight'))   # zero queries


def hot_route(sources, proj, norm):
    """route() as a reader might edit it: the routing logits at a temperature of 1/8."""
    V = torch.stack(sources)
    alpha = (proj(norm(V)).squeeze(-1) / 8).float().softmax(dim=0)
    return torch.einsum('nbt,nbtd->btd', alpha.to(V.dtype), V), alpha


@pytest.mark.parametrize('variant', ['paper', 'official'])
@pytest.mark.parametrize('mode', ROUTED)
def test_an_edited_route_is_followed_or_refused_never_ignored(monkeypatch, mode, variant):
    model = make_model(mode, variant=variant)
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before, _ = model(idx)
    monkeypatch.setattr(model_module, 'route', hot_route)
    # the default path (fast_routing.py) does not compute the edited rule: it refuses, naming the way on
    with pytest.raises(model_module.FastRoutingMismatch, match=r"route\(\) and fast_routing.py disagree for "
                       rf"residual='{mode}'.*fast_routing=False"):
        model(idx)
    model.fast_routing = False      # the rule as edited, at every site
    with torch.no_grad():
        after, _ = model(idx)
    assert (after - before).abs().max() > 1e-3
    monkeypatch.undo()              # the rule as shipped: the fast path is used again, and equals route()
    model.fast_routing = True
    with torch.no_grad():
        again, _ = model(idx)
    torch.testing.assert_close(again, before, rtol=0, atol=0)


def test_the_fast_path_check_is_quick_and_leaves_the_random_generator_alone():
    import time
    model_module._checked.clear()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    t0 = time.perf_counter()
    for mode in ROUTED:
        for variant in ('paper', 'official'):
            model_module.check_fast_routing(tiny_config(residual=mode, variant=variant))
    assert (time.perf_counter() - t0) / 8 < 2         # each about 0.1 s: 2 s is a busy machine's margin
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize('mode', ROUTED)
def test_reference_detects_other_source_sets(mode):
    # the comparison above is sensitive: the same weights under another mode give other logits
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    model = make_model(mode)
    with torch.no_grad():
        logits, _ = model(idx)
        for other in ROUTED:
            if RESIDUAL_MODES[other][1] == RESIDUAL_MODES[mode][1] and other != mode:
                twin = make_model(other)
                twin.load_state_dict(model.state_dict())
                assert (reference_forward(twin, idx) - logits).abs().max() > 1e-3, \
                    f"{mode} and {other} give the same logits from the same weights: a new mode that computes another's"


# variant='official': the authors' code (wdlctc/delta-attention-residuals-code,
# modeling_qwen3_attnres.py), as issue 10 describes its loop, again with plain lists. Per layer l
# (lpb = ceil(L / n_blocks)): attention x = h + R(blocks) if blocks else h; if l % lpb == 0 the block
# list grows by h (when empty) or h - blocks[-1], AFTER the attention routed; h += a; then the MLP
# x = h + R(blocks). Delta AttnRes: the first attention reads h, then E and every sublayer output join.

def reference_forward_official(model, idx):
    cfg = model.config
    lpb = math.ceil(cfg.n_layer / cfg.n_blocks)
    cos, sin = model_module.rope_tables(cfg.head_dim, idx.shape[1], cfg.rope_theta)
    E = model.embed_tokens.weight[idx]
    R = lambda srcs, layer, kind: ref_route(srcs, getattr(layer, f'{kind}_res_proj'), getattr(layer, f'{kind}_res_norm'))
    h, srcs = E, []
    for l, layer in enumerate(model.layers):
        attn = lambda x: layer.self_attn(layer.input_layernorm(x), cos, sin)
        mlp = lambda x: layer.mlp(layer.post_attention_layernorm(x))
        a = attn(h + R(srcs, layer, 'attn') if srcs else h)
        if cfg.residual == 'delta_block':
            if l % lpb == 0:
                srcs = srcs + [h - srcs[-1] if srcs else h]
            h = h + a
            h = h + mlp(h + R(srcs, layer, 'mlp'))
        else:   # delta_attnres
            srcs = srcs + ([E] if l == 0 else []) + [a]
            h = h + a
            m = mlp(h + R(srcs, layer, 'mlp'))
            srcs, h = srcs + [m], h + m
    return model.lm_head(model.norm(h))


@pytest.mark.parametrize('n_blocks', [2, 3, 5])
@pytest.mark.parametrize('mode', ['delta_attnres', 'delta_block'])
def test_official_variant_matches_its_reference(mode, n_blocks):
    model = make_model(mode, n_blocks=n_blocks, variant='official')
    assert 'layers.0.attn_res_proj.weight' not in model.state_dict()     # the first attention is not routed
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(idx)
        ref = reference_forward_official(model, idx)
        _, _, stats = model(idx, stats=True)
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert [len(s['weights']) for s in stats.values()] == model.routing_sources()


def reference_forward_causes(model, idx, telescoping, lag, no_open_block, unrouted_first):
    """Delta Block with each of docs/fidelity.md's four differences switched on separately: all off is
    the paper, all on the authors' code. Measure each cause with `python test_model.py`."""
    cfg = model.config
    lpb = math.ceil(cfg.n_layer / cfg.n_blocks)
    cos, sin = model_module.rope_tables(cfg.head_dim, idx.shape[1], cfg.rope_theta)
    E = model.embed_tokens.weight[idx]
    h, srcs, start, fresh = E, [] if unrouted_first else [E], 0 * E if unrouted_first else E, True

    def close():                                   # the open block becomes a source
        nonlocal start, fresh
        srcs.append((h - srcs[-1] if srcs else h) if telescoping else h - start)
        start, fresh = h, True
    for l, layer in enumerate(model.layers):
        opens = l % lpb == 0
        if opens and l > 0 and not lag:
            close()
        s = srcs + ([] if no_open_block or fresh else [h - start])
        x = h + ref_route(s, layer.attn_res_proj, layer.attn_res_norm) if s else h
        a = layer.self_attn(layer.input_layernorm(x), cos, sin)
        if opens and (l > 0 and lag or l == 0 and unrouted_first):
            close()
        h, fresh = h + a, False
        x = h + ref_route(srcs + ([] if no_open_block else [h - start]), layer.mlp_res_proj, layer.mlp_res_norm)
        h = h + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(h))


@pytest.mark.parametrize('n_blocks', [2, 3, 5])
def test_the_four_causes_together_are_the_official_variant(n_blocks):
    paper = make_model('delta_block', n_blocks=n_blocks)
    official = make_model('delta_block', n_blocks=n_blocks, variant='official')
    official.load_state_dict(paper.state_dict(), strict=False)
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for flags, target in (((0, 0, 0, 0), paper), ((1, 1, 1, 1), official)):
            ref = target(idx)[0]
            assert (reference_forward_causes(paper, idx, *flags) - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize('mode', MODES)
def test_variants_differ_only_in_the_delta_modes(mode):
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    paper, official = make_model(mode, n_blocks=2), make_model(mode, n_blocks=2, variant='official')
    official.load_state_dict(paper.state_dict(), strict=False)   # official has no first-attention site
    with torch.no_grad():
        gap = (paper(idx)[0] - official(idx)[0]).abs().max() / paper(idx)[0].abs().max()
    if RESIDUAL_MODES[mode][1] == 'add':
        # sublayer sources (delta_attnres) differ only at the first attention (x = E, not E + E: pre-norm hides it
        # up to eps); block sources differ in what a block is (h minus the previous source, completed a site later)
        least = 1e-4 if RESIDUAL_MODES[mode][0] == 'sublayer' else 0.1
        assert gap > least, f"{mode}: the official variant changes the logits by {gap:.2g} relative, expected > {least:g}"
    else:
        assert gap == 0


def test_routing_weights_are_uniform_at_zero_query():
    for mode in ROUTED:
        torch.manual_seed(0)
        model = GPT(tiny_config(residual=mode, n_blocks=3))
        _, _, stats = model(torch.randint(0, 61, (2, 12)), stats=True)
        assert len(stats) == len(model.routing_sources())
        for name, s in stats.items():
            n = len(s['weights'])
            torch.testing.assert_close(s['weights'], torch.full((n,), 1 / n), rtol=0, atol=1e-7)
            assert s['max_weight'].item() == pytest.approx(1 / n, abs=1e-7)
            assert s['entropy'].item() == pytest.approx(math.log(n), abs=1e-5)
        assert [len(s['weights']) for s in stats.values()] == model.routing_sources()
        # per token, not just on average: exactly 1/N
        layer = model.layers[2]
        sources = list(torch.randn(4, 2, 12, 32) * 5)
        _, alpha = model_module.route(sources, layer.mlp_res_proj, layer.mlp_res_norm)
        assert torch.equal(alpha, torch.full_like(alpha, 1 / 4))


def test_routing_stats_match_weights():
    model = make_model('delta_attnres')
    idx = torch.randint(0, 61, (2, 12))
    logits, loss, stats = model(idx, idx, stats=True)
    logits2, loss2 = model(idx, idx)
    assert torch.equal(loss, loss2) and torch.equal(logits, logits2)   # stats do not change the loss
    # recompute site layers.1.attn (sources [E, v_0, v_1]) by hand from hooks on the sublayers
    outs = []
    hooks = [model.layers[0].self_attn.register_forward_hook(lambda m, i, o: outs.append(o)),
             model.layers[0].mlp.register_forward_hook(lambda m, i, o: outs.append(o))]
    model(idx)
    for hk in hooks:
        hk.remove()
    layer = model.layers[1]
    srcs = [model.embed_tokens(idx)] + outs
    keys = torch.stack([layer.attn_res_norm(s) for s in srcs])
    alpha = (keys @ layer.attn_res_proj.weight[0]).softmax(0)
    s = stats['layers.1.attn']
    torch.testing.assert_close(s['weights'], alpha.mean((1, 2)))
    torch.testing.assert_close(s['max_weight'], alpha.max(0).values.mean())
    torch.testing.assert_close(s['entropy'], -(alpha * alpha.log()).sum(0).mean())


def test_delta_block_deltas_sum_to_the_residual_stream():
    model = make_model('delta_block', n_blocks=3)
    model.fast_routing = False      # spy on the plain route(); test_bench.py checks route_fast against it
    idx = torch.randint(0, 61, (2, 12))
    seen = {}
    real_route = model_module.route
    hooks = [model.layers[-1].mlp.register_forward_hook(lambda m, i, o: seen.__setitem__('v_last', o)),
             model.norm.register_forward_pre_hook(lambda m, i: seen.__setitem__('h', i[0]))]

    def spy(sources, proj, norm):
        seen['sources'] = list(sources)
        return real_route(sources, proj, norm)
    model_module.route = spy
    try:
        with torch.no_grad():
            model(idx)
    finally:
        model_module.route = real_route
        for hk in hooks:
            hk.remove()
    # the last site (the last MLP) sees [E, Delta_0, Delta_1, partial]; adding the last MLP's output
    # completes the last block, and E plus all block deltas is the final residual stream
    assert len(seen['sources']) == 4
    assert torch.equal(seen['sources'][0], model.embed_tokens(idx))
    total = sum(seen['sources']) + seen['v_last']
    torch.testing.assert_close(total, seen['h'], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('mode', MODES)
def test_causal(mode):
    model = make_model(mode, n_blocks=3)
    idx = torch.randint(0, 61, (1, 12))
    changed = idx.clone()
    changed[0, 7] = (idx[0, 7] + 1) % 61
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize('mode', ROUTED)
def test_gradients_reach_every_routing_parameter(mode):
    model = make_model(mode, n_blocks=3).train()
    idx = torch.randint(0, 61, (2, 12))
    _, loss = model(idx, idx)
    loss.backward()
    sites = [f'layers.{i}.{k}' for i in range(5) for k in ('attn', 'mlp')] + ['final'] * (RESIDUAL_MODES[mode][1] == 'replace')
    for site, n_sources in zip(sites, model.routing_sources(), strict=True):
        for part in ('proj', 'norm'):
            name = site.replace('.attn', '.attn_res').replace('.mlp', '.mlp_res').replace('final', 'final_res') + f'_{part}.weight'
            grad = model.get_parameter(name).grad
            if n_sources == 1:   # a softmax over one source is constant: nothing to learn there
                assert grad is None or torch.count_nonzero(grad) == 0, name
            else:
                assert grad is not None and torch.count_nonzero(grad) == grad.numel(), name


def test_parameter_names_and_shapes():
    model = GPT(tiny_config(residual='attnres'))
    sd = model.state_dict()
    assert sd['layers.3.attn_res_proj.weight'].shape == (1, 32)
    assert sd['layers.3.mlp_res_norm.weight'].shape == (32,)
    assert 'final_res_proj.weight' in sd and 'final_res_norm.weight' in sd
    assert not any('_res_' in k for k in GPT(tiny_config()).state_dict())
    assert 'final_res_proj.weight' not in GPT(tiny_config(residual='delta_block')).state_dict()
    assert torch.count_nonzero(sd['layers.3.attn_res_proj.weight']) == 0
    assert torch.all(sd['layers.3.attn_res_norm.weight'] == 1)


def test_loss_ignores_minus_one():
    model = make_model('delta_block')
    idx = torch.randint(0, 61, (2, 12))
    targets = idx.clone()
    targets[:, :6] = -1
    logits, loss = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits[:, 6:].reshape(-1, 61), targets[:, 6:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_optimizer_groups_and_flops():
    model = GPT(tiny_config(residual='full_attnres'))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    decayed = {id(p) for p in opt.param_groups[0]['params']}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.dim() == 2 and '_res_' not in name), name
    # full AttnRes, 5 layers: sites see 1..10 sources, the final site 11
    assert model.routing_sources() == list(range(1, 11)) + [11]
    assert GPT(tiny_config(residual='attnres', n_blocks=3)).routing_sources() == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert GPT(tiny_config(residual='delta_block', n_blocks=3)).routing_sources() == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    # which of them is the open block (5 layers in blocks of 2): E, then at each block's first attention a closed block
    sites = lambda **kw: [(s.n, s.open_block) for s in GPT(tiny_config(**kw)).sites.values()]
    assert sites(residual='delta_block', n_blocks=3) == [
        (1, 0), (1, 1), (1, 1), (1, 1), (2, 0), (2, 1), (2, 1), (2, 1), (3, 0), (3, 1)]
    assert sites(residual='delta_block', n_blocks=3, variant='official') == [
        (1, 0), (1, 0), (1, 0), (1, 0), (2, 0), (2, 0), (2, 0), (2, 0), (3, 0)]
    # the one schedule: its names, in forward order, are the routing parameters' order and the statistics' keys
    for kw in (dict(residual='attnres'), dict(residual='delta_attnres', variant='official', res_gate=True)):
        m = GPT(tiny_config(**kw))
        assert [s.index for s in m.sites.values()] == list(range(len(m.sites)))
        assert [p for p, _, _ in m.routing_parameters()] == [mod for n, mod in m.named_modules() if n.endswith('_res_proj')]
        _, _, stats = m(torch.zeros(1, 4, dtype=torch.long), stats=True)
        assert list(stats) == list(m.sites) == [n[:-len('_res_proj')].replace('_', '.') if n != 'final_res_proj' else 'final'
                                                 for n, _ in m.named_modules() if n.endswith('_res_proj')]
    std, full = GPT(tiny_config()), model
    assert full.flops_per_token(16) - std.flops_per_token(16) == 3 * 4 * 32 * sum(range(1, 11)) + 3 * 4 * 32 * 11 + 6 * 22 * 32


# -----------------------------------------------------------------------------
# Bad input gets a clear ValueError

@pytest.mark.parametrize('kw, message', [
    (dict(residual='delta'), 'standard, full_attnres, attnres, delta_attnres, delta_block'),
    (dict(n_blocks=0), 'n_blocks'),
    (dict(n_blocks=6), 'n_blocks'),
    (dict(n_head=4, n_kv_head=3), 'n_kv_head'),
])
def test_bad_config(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**kw)


def test_bad_tokens():
    model = GPT(tiny_config())
    with pytest.raises(ValueError, match='block_size'):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r'\[0, 61\)'):
        model(torch.tensor([[0, 61]]))
    with pytest.raises(ValueError, match=r'\[0, 61\)'):
        model(torch.tensor([[-1, 3]]))


# -----------------------------------------------------------------------------
# Qwen3 checkpoints: equality with Hugging Face transformers (a test-only dependency)

def write_hf_qwen3(path, tie=True, **extra):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
                      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie, **extra)
    hf = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():   # random norm weights too, so that a swapped or missing norm shows
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if 'norm' in name else 0.02))
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize('tie', [True, False])
def test_standard_matches_transformers_qwen3(tmp_path, tie):
    hf = write_hf_qwen3(tmp_path, tie=tie)
    model = load_hf(tmp_path).eval()
    assert model.config.rope_theta == 10000.0 and model.config.tie_embeddings == tie
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_from_qwen3_any_mode_and_sharded(tmp_path):
    write_hf_qwen3(tmp_path)
    sd = load_file(tmp_path / 'model.safetensors')
    (tmp_path / 'model.safetensors').unlink()
    keys = sorted(sd)
    shards = {'model-00001-of-00002.safetensors': keys[:10], 'model-00002-of-00002.safetensors': keys[10:]}
    for file, ks in shards.items():
        save_file({k: sd[k] for k in ks}, tmp_path / file)
    (tmp_path / 'model.safetensors.index.json').write_text(json.dumps(
        {'weight_map': {k: f for f, ks in shards.items() for k in ks}}))
    base = load_hf(tmp_path)
    for mode in ROUTED:
        model = load_hf(tmp_path, residual=mode, n_blocks=2)
        own = model.state_dict()
        for k, v in base.state_dict().items():
            assert torch.equal(own[k], v), k
        assert all(torch.count_nonzero(v) == 0 for k, v in own.items() if k.endswith('_res_proj.weight'))


def test_from_qwen3_errors(tmp_path):
    with pytest.raises(ValueError, match='no config.json'):
        load_hf(tmp_path)
    write_hf_qwen3(tmp_path)
    cfg = json.loads((tmp_path / 'config.json').read_text())

    def with_config(**changes):
        (tmp_path / 'config.json').write_text(json.dumps({**cfg, **changes}))
        return tmp_path

    for changes, message in [(dict(model_type='llama'), "expected model_type 'qwen3'"),
                             (dict(rope_scaling={'rope_type': 'yarn', 'factor': 4.0}), 'rope scaling'),
                             (dict(rope_parameters={'rope_type': 'linear', 'factor': 2.0}), 'rope scaling'),
                             (dict(use_sliding_window=True), 'sliding-window'),
                             (dict(attention_bias=True), 'attention biases')]:
        with pytest.raises(ValueError, match=message):
            load_hf(with_config(**changes))
    # both places HF writers keep rope_theta: rope_parameters (newer) and top level (older)
    assert load_hf(with_config(rope_parameters={'rope_type': 'default', 'rope_theta': 5e5})).config.rope_theta == 5e5
    older = {k: v for k, v in cfg.items() if k != 'rope_parameters'}
    (tmp_path / 'config.json').write_text(json.dumps({**older, 'rope_theta': 2e5, 'rope_scaling': None}))
    assert load_hf(tmp_path).config.rope_theta == 2e5
    with_config()
    sd = load_file(tmp_path / 'model.safetensors')
    del sd['model.layers.1.mlp.up_proj.weight']
    save_file(sd, tmp_path / 'model.safetensors')
    with pytest.raises(ValueError, match=r'missing tensors \[.layers\.1\.mlp\.up_proj\.weight.\]'):
        load_hf(tmp_path)
    (tmp_path / 'model.safetensors').unlink()
    with pytest.raises(ValueError, match='neither model.safetensors'):
        load_hf(tmp_path)


if __name__ == '__main__':
    # docs/fidelity.md's table: how far each cause alone moves Delta Block's logits from the paper's
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    names = ['telescoping', 'lag', 'no open block', 'unrouted first attention']
    for n_blocks in (2, 3, 5):
        paper = make_model('delta_block', n_blocks=n_blocks)
        with torch.no_grad():
            P = paper(idx)[0]
            rel = lambda flags: ((reference_forward_causes(paper, idx, *flags) - P).abs().max() / P.abs().max()).item()
            alone = [rel([int(i == k) for i in range(4)]) for k in range(4)]
            cumulative = [rel(f) for f in ((0, 0, 0, 1), (0, 0, 1, 1), (0, 1, 1, 1), (1, 1, 1, 1))]
        print(f"n_layer 5, n_blocks {n_blocks}: " + ', '.join(f"{n} {a:.3f}" for n, a in zip(names, alone))
              + f" | cumulative 4, +3, +2, +1: {', '.join(f'{c:.3f}' for c in cumulative)}")


def test_model_imports_nothing_of_the_repo():
    # an exported directory carries copies of model.py and fast_routing.py as transformers remote code
    # (checkpoints.REMOTE_CODE), where no other file of this repo can be imported: every import in them (at any
    # depth) must name an installed package or one of the two
    import ast
    from pathlib import Path
    from checkpoints import REMOTE_CODE
    here = Path(__file__).parent
    carried = {'model', 'fast_routing'}
    assert {f'{m}.py' for m in carried} <= set(REMOTE_CODE)
    ours = {p.stem for p in here.glob('*.py')} - carried
    for name in carried:
        tree = ast.parse((here / f'{name}.py').read_text())
        names = {a.name.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert names and not names & ours, (name, names & ours)
