"""Tests for pretrained checkpoints: conversion with exact identity, KV cache, export round trip.
Everything runs offline on tiny checkpoints the tests write. Run: python -m pytest -q"""

import json
from pathlib import Path

import pytest
import torch

from checkpoints import load_hf, save_hf
from model import GPT, KVCache, RESIDUAL_MODES
from test_model import make_model, write_hf_qwen3

MODES = list(RESIDUAL_MODES)
ADDITIVE = [m for m, (_, mixing) in RESIDUAL_MODES.items() if mixing == 'add']
REPLACE = [m for m, (_, mixing) in RESIDUAL_MODES.items() if mixing == 'replace']


def randomize_gates(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('_res_gate'):
                p.copy_(torch.randn((), generator=g))
    return model


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
    """A tiny random Qwen3 checkpoint written by transformers (random norm weights too)."""
    path = tmp_path_factory.mktemp('qwen3')
    write_hf_qwen3(path)
    return path


def pattern_batch(n, T=16, vocab=61, seed=0):
    """Arithmetic sequences mod vocab with a random start and a stride in 1..4: learnable in context."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, vocab, (n, 1), generator=g), torch.randint(1, 5, (n, 1), generator=g)
    seq = (start + stride * torch.arange(T + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


@pytest.fixture(scope='module')
def trained_dir(tmp_path_factory, hf_dir):
    """A 'pretrained' tiny Qwen3: the random checkpoint fine-tuned on the pattern task, re-exported.
    A loss jump at conversion only means something for a model that has learned something."""
    torch.manual_seed(0)
    model = load_hf(hf_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(40):
        x, y = pattern_batch(16, seed=step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp('trained')
    save_hf(model, path)
    return path


# -----------------------------------------------------------------------------
# Conversion

@pytest.mark.parametrize('mode', ADDITIVE)
def test_identity_init_is_exact_and_can_learn(hf_dir, mode):
    base = load_hf(hf_dir).eval()
    model = load_hf(hf_dir, residual=mode, n_blocks=2, identity_init=True)
    assert model.config.res_gate
    x, y = pattern_batch(4)
    with torch.no_grad():
        ref, ref_loss = base(x, y)
        out, loss = model(x, y)
    assert (out - ref).abs().max().item() <= 1e-5
    # without the gate, zero queries give x = h + mean(sources): close, but the scale leaks through
    plain = load_hf(hf_dir, residual=mode, n_blocks=2)
    with torch.no_grad():
        assert (plain(x)[0] - ref).abs().max().item() > 1e-5

    # step 0: only the gates have a gradient (the routed mix is multiplied by 0) ...
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    _, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if '_res_' in n}
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    assert all(grads[n].abs() > 0 for n in grads if n.endswith('_res_gate'))
    assert all(grads[n] is None or torch.count_nonzero(grads[n]) == 0 for n in grads if n.endswith('_res_proj.weight'))
    # ... the first step opens every gate, which changes the model's output, ...
    opt.step()
    opt.zero_grad()
    assert all(p.abs() > 0 for n, p in model.named_parameters() if n.endswith('_res_gate'))
    with torch.no_grad():
        assert (model(x)[0] - ref).abs().max() > 1e-4
    # ... and from the second step on the queries learn too (every site with more than one source)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    queries = [p for n, p in model.named_parameters() if n.endswith('_res_proj.weight')]
    assert sum(torch.count_nonzero(q) > 0 for q in queries) >= len(queries) - 1   # the first site sees only E


@pytest.mark.parametrize('mode', REPLACE)
def test_replacement_modes_convert_inexactly(trained_dir, mode):
    # uniform routing makes the sublayer input h/N (the sources sum to h), which pre-norm sees as h
    # with eps scaled by N^2: close to the pretrained model, but not equal, and no gate can fix it
    with pytest.raises(ValueError, match='cannot be exact'):
        load_hf(trained_dir, residual=mode, identity_init=True)
    x, y = pattern_batch(64, seed=1000)
    with torch.no_grad():
        base_logits, base_loss = load_hf(trained_dir)(x, y)
    model = load_hf(trained_dir, residual=mode, n_blocks=2)
    logits, loss = model(x, y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    diff = (logits - base_logits).abs().max().item()
    print(f"\n{mode}: loss {base_loss.item():.4f} (pretrained) -> {loss.item():.4f} (converted), "
          f"max abs logit diff {diff:.2e}")
    assert base_loss < 2.0 and diff > 1e-4


def test_converting_with_the_authors_random_queries(trained_dir, tmp_path):
    # The authors' code converts with its new queries at Hugging Face's normal init, not zero. Then a replacement
    # mode's input is a non-uniform mix of the sources, no longer h/N: its loss moves far more than with zero
    # queries; an additive mode with identity_init stays exact (its gates are 0).
    x, y = pattern_batch(64, seed=1000)
    with torch.no_grad():
        _, base = load_hf(trained_dir)(x, y)
        _, uniform = load_hf(trained_dir, residual='attnres', n_blocks=2)(x, y)
        torch.manual_seed(0)
        model = load_hf(trained_dir, residual='attnres', n_blocks=2, routing_init_std=0.5)
        _, drawn = model(x, y)
        queries = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith('_res_proj.weight')])
        assert queries.abs().min() > 0 and 0.4 < queries.std().item() < 0.6
        assert abs(drawn - base) > 10 * abs(uniform - base)
        _, gated = load_hf(trained_dir, residual='delta_block', identity_init=True, routing_init_std=0.5)(x, y)
        assert abs(gated.item() - base.item()) <= 1e-5
    print(f"\npretrained {base.item():.4f}; attnres, zero queries {uniform.item():.4f}, N(0, 0.5^2) queries "
          f"{drawn.item():.4f}")
    save_hf(model, tmp_path)     # a directory that holds trained routing: its queries are not redrawn
    with pytest.raises(ValueError, match='would overwrite its routing queries'):
        load_hf(tmp_path, routing_init_std=0.02)


def test_identity_holds_on_a_trained_checkpoint(trained_dir):
    x, y = pattern_batch(64, seed=1000)
    with torch.no_grad():
        _, base_loss = load_hf(trained_dir)(x, y)
        for mode in ADDITIVE:
            _, loss = load_hf(trained_dir, residual=mode, identity_init=True)(x, y)
            assert abs(loss.item() - base_loss.item()) <= 1e-5
        print(f"\npretrained loss {base_loss.item():.4f}; additive modes with identity_init: equal")


# -----------------------------------------------------------------------------
# KV cache

@pytest.mark.parametrize('mode', MODES + ['delta_block+gate', 'delta_block+official', 'delta_attnres+official'])
def test_kv_cache_matches_full_forward(mode):
    residual, *flags = mode.split('+')
    model = randomize_gates(make_model(residual, n_blocks=2, res_gate='gate' in flags,
                                       variant='official' if 'official' in flags else 'paper'))
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(3))
    cache = KVCache(model.config.n_layer)
    with torch.no_grad():
        full, _ = model(idx)
        # a prompt of 5, then one token at a time, then a chunk of 3 (a mask over cached + new keys)
        parts = [model(idx[:, :5], kv_cache=cache)[0]]
        parts += [model(idx[:, t:t + 1], kv_cache=cache)[0] for t in range(5, 13)]
        parts.append(model(idx[:, 13:], kv_cache=cache)[0])
    assert cache.pos == 16
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r'17 \(16 cached \+ 1 new\) exceeds block_size 16'):
        model(idx[:, :1], kv_cache=cache)


# -----------------------------------------------------------------------------
# Export

@pytest.mark.parametrize('tie', [True, False])
@pytest.mark.parametrize('mode', MODES + ['delta_attnres+gate'])
def test_export_round_trip(tmp_path, mode, tie):
    gate = mode.endswith('+gate')
    model = randomize_gates(make_model(mode.removesuffix('+gate'), n_blocks=2, res_gate=gate, tie_embeddings=tie))
    save_hf(model, tmp_path)
    back = load_hf(tmp_path).eval()
    assert back.config == model.config
    own, theirs = model.state_dict(), back.state_dict()
    assert own.keys() == theirs.keys()
    assert all(torch.equal(own[k], theirs[k]) for k in own)
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], back(idx)[0])


def test_export_standard_loads_in_transformers(tmp_path, hf_dir):
    from transformers import Qwen3ForCausalLM
    model = load_hf(hf_dir).eval()
    save_hf(model, tmp_path)
    hf = Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], rtol=1e-5, atol=1e-5)


def test_export_refuses_mismatched_loads(tmp_path):
    save_hf(make_model('delta_block', n_blocks=2), tmp_path)
    assert json.loads((tmp_path / 'config.json').read_text())['attention_residuals']['residual'] == 'delta_block'
    with pytest.raises(ValueError, match="residual='delta_block' stored, 'attnres' requested"):
        load_hf(tmp_path, residual='attnres')
    with pytest.raises(ValueError, match='already holds a trained'):
        load_hf(tmp_path, identity_init=True)
    with pytest.raises(ValueError, match='res_gate applies to the additive modes'):
        make_model('attnres', res_gate=True)


# -----------------------------------------------------------------------------
# Tokenizers: a checkpoint's own tokenizer.json for data preparation and sampling

CORPUS = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog", "on the mat the cat sat"] * 5


def write_tiny_tokenizer(path):
    """A byte-level BPE tokenizer.json like Qwen3's, trained on a toy corpus, small enough (< 61 ids)
    for the tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=50, special_tokens=['<|endoftext|>'], initial_alphabet=[]))
    tok.save(str(path / 'tokenizer.json'))
    return path / 'tokenizer.json'


def test_prepare_with_a_tokenizer_json(tmp_path):
    import data
    import prepare_fineweb
    file = write_tiny_tokenizer(tmp_path)
    enc = prepare_fineweb.get_tokenizer(str(tmp_path))          # a checkpoint directory holding tokenizer.json
    assert enc.name == str(file) and enc.n_vocab <= 50 and enc.eot_token == 0
    assert enc.decode(enc.encode_ordinary('the cat sat')) == 'the cat sat'
    assert enc.encode_ordinary('<|endoftext|>') != [enc.eot_token]   # in a text it is text, as in tiktoken
    meta = prepare_fineweb.prepare(iter(CORPUS), str(tmp_path / 'toy'), 'toy', str(file), None, 10, 1000, 1)
    assert meta['tokenizer'] == str(file) and meta['vocab_size'] == enc.n_vocab
    val = data.read_shard(str(tmp_path / 'toy' / 'toy_val_000000.bin'))
    assert val.dtype == 'uint16' and list(val[:1 + len(enc.encode_ordinary(CORPUS[0]))]) == [0] + enc.encode_ordinary(CORPUS[0])
    with pytest.raises(FileNotFoundError, match='without tokenizer.json'):
        prepare_fineweb.get_tokenizer(str(tmp_path / 'toy'))


def test_vocabularies_over_65536_use_uint32_shards(tmp_path):
    # Qwen3's 151,936 ids do not fit llm.c's uint16 format: version 2 stores uint32
    import data
    import prepare_fineweb
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f'w{i}': i for i in range(70_000)} | {'<unk>': 70_000, '<|endoftext|>': 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(['<|endoftext|>'])
    tok.save(str(tmp_path / 'tokenizer.json'))
    docs = ['w69999 w3', 'w65536 w1 w2', 'w7']
    prepare_fineweb.prepare(iter(docs), str(tmp_path / 'big'), 'big', str(tmp_path / 'tokenizer.json'), None, 3, 1000, 1)
    val = data.read_shard(str(tmp_path / 'big' / 'big_val_000000.bin'))
    train = data.read_shard(str(tmp_path / 'big' / 'big_train_000001.bin'))
    assert val.dtype == 'uint32' and list(val) == [70_001, 69_999, 3]
    assert list(train) == [70_001, 65_536, 1, 2, 70_001, 7]


# -----------------------------------------------------------------------------
# sample.py

@pytest.mark.parametrize('mode', MODES)
def test_generate_with_and_without_cache_agree(mode):
    from sample import generate
    model = randomize_gates(make_model(mode, n_blocks=2, res_gate=mode in ADDITIVE))
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(0))
    runs = [generate(model, prompt, 10, temperature=0.9, top_k=20, n_vocab=50, use_kv_cache=cache,
                     generator=torch.Generator().manual_seed(7)) for cache in (True, False)]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (2, 14)
    assert torch.equal(runs[0][:, :4], prompt) and runs[0][:, 4:].max() < 50
    with pytest.raises(ValueError, match='exceeds the model'):
        generate(model, prompt, 13)


def run_script(*args, cwd=None):
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).parent
    return subprocess.run([sys.executable, str(here / args[0]), *args[1:]], capture_output=True, text=True,
                          cwd=cwd or here, env={'OMP_NUM_THREADS': '1', 'PATH': '/usr/bin:/bin'}, timeout=120)


def test_sample_script_from_a_checkpoint_directory(tmp_path, hf_dir):
    import shutil
    for f in ('config.json', 'model.safetensors'):
        shutil.copy(hf_dir / f, tmp_path / f)
    write_tiny_tokenizer(tmp_path)
    (tmp_path / 'prompt.txt').write_text('the cat')
    out = run_script('sample.py', f'--init_from={tmp_path}', '--residual=delta_block', '--n_blocks=2',
                     f'--start=FILE:{tmp_path / "prompt.txt"}', '--max_new_tokens=8', '--num_samples=2', '--device=cpu',
                     cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr
    printed = ''.join(l for l in out.stdout.splitlines(keepends=True) if not l.startswith('Overriding'))
    samples = printed.split('---------------\n')
    assert len(samples) == 3 and all(s.startswith('the cat') for s in samples[:2])
    assert 'delta_block: 2 x 8 tokens' in out.stderr and 'KV cache on' in out.stderr


# -----------------------------------------------------------------------------
# train.py: fine-tuning a Qwen3 directory; export.py; the fine-tuning configs

def finetune(hf_dir, data_root, out_dir, *args, check=True):
    import subprocess
    import sys
    here = Path(__file__).parent
    cmd = [sys.executable, 'train.py', f'--init_from={hf_dir}', '--dataset=toy', f'--data_root={data_root}',
           f'--out_dir={out_dir}', '--vocab_size=61', '--n_layer=4', '--n_embd=32', '--n_head=4', '--n_kv_head=2',
           '--head_dim=8', '--intermediate_size=48', '--rope_theta=10000.0', '--block_size=16', '--batch_size=4',
           '--gradient_accumulation_steps=1', '--device=cpu', '--dtype=float32', '--compile=False', '--max_iters=3',
           '--eval_interval=3', '--eval_iters=2', '--log_interval=1', '--warmup_iters=0', '--lr_decay_iters=3',
           '--learning_rate=1e-3', '--min_lr=1e-4', *args]
    p = subprocess.run(cmd, cwd=here, capture_output=True, text=True, timeout=300,
                       env={'OMP_NUM_THREADS': '1', 'PATH': '/usr/bin:/bin'})
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    log = Path(out_dir) / 'log.jsonl'
    return p, [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope='module')
def toy_data(tmp_path_factory):
    """data_root/toy: the toy corpus tokenized with the tiny tokenizer.json."""
    import random
    import prepare_fineweb
    root = tmp_path_factory.mktemp('toydata')
    file = write_tiny_tokenizer(root)
    rng = random.Random(0)
    docs = [' '.join(rng.choice(CORPUS) for _ in range(rng.randint(2, 6))) for _ in range(200)]
    prepare_fineweb.prepare(iter(docs), str(root / 'toy'), 'toy', str(file), None, 400, 100_000, 1)
    return root


def test_finetune_from_qwen3(tmp_path, hf_dir, toy_data):
    from safetensors.torch import load_file
    import export
    _, base = finetune(hf_dir, toy_data, tmp_path / 'standard', '--residual=standard')
    p, delta = finetune(hf_dir, toy_data, tmp_path / 'delta', '--residual=delta_block', '--n_blocks=2', '--res_gate=True',
                        '--routing_learning_rate=1e-1', '--freeze_base=True')
    assert 'zero gates: exactly the pretrained model at step 0' in p.stdout
    val = lambda records: {r['step']: r['val_loss'] for r in records if 'val_loss' in r}
    assert abs(val(delta)[0] - val(base)[0]) <= 1e-6         # the exact identity, through train.py
    from runs import read_checkpoint
    ckpt = read_checkpoint(str(tmp_path / 'delta' / 'ckpt'), optimizer=True)
    # freeze_base: the pretrained weights are untouched; the routing learned with 100x the learning rate
    pretrained = {k.removeprefix('model.'): v for k, v in load_file(hf_dir / 'model.safetensors').items()}
    for k, v in ckpt['model'].items():
        if '_res_' in k or k == 'lm_head.weight':    # the head is the (tied) embedding
            continue
        assert torch.equal(v, pretrained[k]), k
    assert all(ckpt['model'][f'layers.{i}.{s}_res_gate'].abs() > 0 for i in range(4) for s in ('attn', 'mlp'))
    (group,) = ckpt['optimizer']['param_groups']                 # only the routing parameters are optimized
    last_lr = [r['lr'] for r in delta if 'lr' in r][-1]           # the base rate of the last step
    assert group['lr_scale'] == pytest.approx(100.0) and group['lr'] == pytest.approx(100 * last_lr)
    # export -> load back: the same model
    model = export.export(tmp_path / 'delta' / 'ckpt', tmp_path / 'exported')
    back = load_hf(tmp_path / 'exported')
    assert (tmp_path / 'exported' / 'tokenizer.json').read_text() == (toy_data / 'tokenizer.json').read_text()
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], back(idx)[0])
    # a config whose shapes differ from the checkpoint fails with the fields to fix
    p, _ = finetune(hf_dir, toy_data, tmp_path / 'bad', '--residual=delta_block', '--intermediate_size=64', check=False)
    assert p.returncode != 0 and "'intermediate_size': (48, 64)" in p.stderr


def test_finetune_configs():
    from model import GPTConfig
    for mode in MODES:
        g, path = {}, Path(__file__).parent / f'config/finetune_qwen3_0.6b_{mode}.py'
        assert path.exists(), f"every mode has a fine-tuning config: add {path.name}, like finetune_qwen3_0.6b_delta_block.py"
        exec(path.read_text(), g)
        assert (g['residual'], g['init_from'], g['max_iters'], g['warmup_iters']) == (mode, 'Qwen3-0.6B', 20000, 500)
        assert (g['batch_size'], g['gradient_accumulation_steps']) == (2, 16)    # 4 GPUs x batch 2 x accumulation 4
        assert (g['learning_rate'], g['routing_learning_rate']) == (5e-5, 5e-3)
        assert g.get('res_gate', False) == (mode in ADDITIVE)
        with torch.device('meta'):    # Qwen3-0.6B: 0.6B parameters (0.44B without the embedding)
            model = GPT(GPTConfig(**{k: g[k] for k in ('vocab_size', 'n_layer', 'n_embd', 'n_head', 'n_kv_head', 'head_dim',
                                                         'intermediate_size', 'tie_embeddings', 'residual', 'n_blocks')}))
        assert model.get_num_params(non_embedding=True) == pytest.approx(0.44e9, rel=0.01)
