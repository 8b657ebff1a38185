"""Tests for the Hugging Face ecosystem: every mode through transformers (logits, generate()), tokenizers
as Hugging Face files, checkpoints of the official code, and downstream evaluation with lm-eval on a
local task. Offline, on tiny models and files the tests write. Run: python -m pytest -q test_hf.py"""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tokenizer import get_tokenizer, save_hf_tokenizer
from checkpoints import load_hf, save_hf
from model import RESIDUAL_MODES
from test_model import make_model, write_hf_qwen3
from test_pretrained import randomize_gates
from test_train import write_checkpoint

transformers = pytest.importorskip('transformers')
transformers.logging.set_verbosity_error()

MODES = list(RESIDUAL_MODES)


def load_transformers(path, **kw):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw).eval()


# -----------------------------------------------------------------------------
# Every mode as a transformers model

@pytest.mark.parametrize('mode', MODES + ['delta_block+gate', 'delta_attnres+official', 'full_attnres+untied'])
def test_every_mode_round_trips_through_transformers(tmp_path, mode):
    mode, _, extra = mode.partition('+')
    kw = dict(res_gate=extra == 'gate', tie_embeddings=extra != 'untied', variant='official' if extra == 'official' else 'paper')
    model = randomize_gates(make_model(mode, n_blocks=2, **kw))
    save_hf(model, tmp_path)
    hf = load_transformers(tmp_path)
    # standard is a plain Qwen3; the routed modes are model.py's GPT itself, inside the remote-code wrapper
    assert type(hf).__name__ == ('Qwen3ForCausalLM' if mode == 'standard' else 'GPTForCausalLM')
    if mode != 'standard':
        assert asdict(hf.model.config) == asdict(model.config)   # (a GPTConfig of the copied model.py)
        assert sorted(p.name for p in tmp_path.glob('*.py')) == ['fast_routing.py', 'hf_model.py', 'model.py']
        assert (tmp_path / 'model.py').read_text() == (Path(__file__).parent / 'model.py').read_text()
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx)[0], hf(idx).logits
    err = ((theirs - ours).abs().max() / ours.abs().max()).item()
    print(f"\n{mode}{'+' + extra if extra else ''}: max |logit difference| / max |logit| = {err:.1e}")
    assert err <= 1e-5
    # generate(): greedy decoding equals sample.generate's, with transformers' loop, with and without the cache
    from sample import generate
    prompt = idx[:, :5]
    ref = generate(model, prompt, 9, temperature=0)
    seen = []
    if mode != 'standard':
        hf.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    for use_cache in (True, False):
        out = hf.generate(prompt, max_new_tokens=9, do_sample=False, use_cache=use_cache, pad_token_id=0)
        assert torch.equal(out, ref), (use_cache, out, ref)
    if mode != 'standard':   # with the cache only the new token goes in; without, the whole sequence
        assert seen == [5] + [1] * 8 + list(range(5, 14))
    # what transformers saves (save_pretrained, push_to_hub: with the code files) loads back here too
    hf.save_pretrained(tmp_path / 'resaved')
    back = load_hf(tmp_path / 'resaved')
    assert back.config == model.config
    with torch.no_grad():
        assert torch.equal(back(idx)[0], ours)


def test_routed_directory_is_refused_without_remote_code(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
    save_hf(make_model('delta_block', n_blocks=2), tmp_path)
    # transformers must not load it as a plain Qwen3 with the routing silently dropped
    with pytest.raises(ValueError, match='trust_remote_code'):
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False)
    save_hf(make_model('standard'), tmp_path / 'std')
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / 'std'), Qwen3ForCausalLM)


def test_export_loads_in_a_fresh_python_elsewhere(tmp_path):
    # a user's process: another working directory, nothing of this repo on the path but the directory itself
    import subprocess
    import sys
    model = make_model('delta_block', n_blocks=2)
    save_hf(model, tmp_path / 'm')
    code = ("import torch; from transformers import AutoModelForCausalLM; "
            "m = AutoModelForCausalLM.from_pretrained('m', trust_remote_code=True); "
            "print(m(torch.arange(16)[None] % 61).logits.double().sum().item())")
    p = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={'OMP_NUM_THREADS': '1', 'PATH': '/usr/bin:/bin', 'HF_HUB_OFFLINE': '1',
                            'HF_MODULES_CACHE': str(tmp_path / 'modules')})
    assert p.returncode == 0, p.stderr[-2000:]
    with torch.no_grad():
        assert float(p.stdout.split()[-1]) == pytest.approx(model(torch.arange(16)[None] % 61)[0].double().sum().item(), rel=1e-6)


def test_remote_model_refuses_padding(tmp_path):
    save_hf(make_model('attnres', n_blocks=2), tmp_path)
    hf = load_transformers(tmp_path)
    idx = torch.randint(0, 61, (2, 8))
    mask = torch.ones_like(idx)
    torch.testing.assert_close(hf(idx, attention_mask=mask).logits, hf(idx).logits, rtol=0, atol=0)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match='padding'):
        hf(idx, attention_mask=mask)


def test_export_script_writes_a_transformers_model_with_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    import export
    model = make_model('delta_block', n_blocks=2, vocab_size=257, variant='official')
    ckpt = write_checkpoint(tmp_path / 'run' / 'step_000000', model.state_dict(), asdict(model.config),
                            meta={'tokenizer': 'byte'})
    export.main([ckpt, str(tmp_path / 'out')])
    stored = json.loads((tmp_path / 'out' / 'config.json').read_text())['attention_residuals']
    assert stored == {'residual': 'delta_block', 'n_blocks': 2, 'res_gate': False, 'variant': 'official'}
    assert load_hf(tmp_path / 'out').config == model.config
    tok = AutoTokenizer.from_pretrained(tmp_path / 'out')
    text = 'the cat sat'
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    assert ids.tolist()[0] == get_tokenizer('byte').encode_ordinary(text)
    with torch.no_grad():
        assert torch.equal(load_transformers(tmp_path / 'out')(ids).logits, model(ids)[0])


# -----------------------------------------------------------------------------
# Tokenizers as Hugging Face files

TEXT = "Hello wörld, ñ 日本語 \n\n  def f(x):\treturn x ** 2  # the end"


def test_byte_tokenizer_as_hf_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    save_hf_tokenizer('byte', tmp_path, model_max_length=64)
    tok, enc = AutoTokenizer.from_pretrained(tmp_path), get_tokenizer('byte')
    assert tok.encode(TEXT, add_special_tokens=False) == enc.encode_ordinary(TEXT) == list(TEXT.encode())
    assert tok.decode(enc.encode_ordinary(TEXT)) == TEXT
    assert tok.eos_token_id == enc.eot_token == 256 and tok.bos_token is None and tok.model_max_length == 64


def test_tiktoken_bpe_with_merges_as_hf_tokenizer(tmp_path, monkeypatch):
    # GPT-2's BPE needs the network; a small tiktoken BPE with merges takes the same conversion path
    import tiktoken
    from transformers import AutoTokenizer
    import tokenizer
    ranks = {bytes([i]): i for i in range(256)}
    for word in (b'th', b'he', b'the', b' t', b' the', b're', b'ret', b'ur', b'urn', b'return', b' return'):
        ranks[word] = len(ranks)     # each a merge of two earlier tokens
    toy = tiktoken.Encoding(name='toy', pat_str=get_tokenizer('byte')._pat_str, mergeable_ranks=ranks,
                            special_tokens={'<|endoftext|>': len(ranks)})
    monkeypatch.setattr(tokenizer, 'get_tokenizer', lambda name: toy)
    save_hf_tokenizer('gpt2', tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = TEXT + ' the theatre: return the other'
    assert len(toy.encode_ordinary(text)) < len(text.encode())        # merges happen
    assert tok.encode(text, add_special_tokens=False) == toy.encode_ordinary(text)
    assert tok.eos_token_id == toy.eot_token


# -----------------------------------------------------------------------------
# Checkpoints saved by the official code (wdlctc/delta-attention-residuals-code,
# Attention-Residuals/modeling_qwen3_attnres.py): model_type 'qwen3_attnres'; every layer has the
# routing tensors below, and the model a final routing site only in the modes listed in its
# _needs_final_routing (block, full; also block_v, delta_centered_reset, which are refused here)

OFFICIAL = {'block': 'attnres', 'full': 'full_attnres', 'delta': 'delta_attnres', 'delta_block': 'delta_block'}


def write_official(path, attnres_mode, **config):
    """A directory as the official code's save_pretrained writes it: a Qwen3 checkpoint plus routing tensors."""
    from safetensors.torch import load_file, save_file
    write_hf_qwen3(path)   # 4 layers, d=32, tied embeddings
    cfg = json.loads((path / 'config.json').read_text())
    cfg.update(model_type='qwen3_attnres', architectures=['Qwen3AttnResForCausalLM'], attnres_mode=attnres_mode,
               attnres_num_blocks=2, attnres_gate_type='bias', attnres_use_null_source=False)
    cfg.update(config)
    (path / 'config.json').write_text(json.dumps(cfg))
    tensors = load_file(path / 'model.safetensors')
    g = torch.Generator().manual_seed(0)
    names = [f'model.layers.{i}.{site}_res_{part}.weight' for i in range(4) for site in ('attn', 'mlp') for part in ('proj', 'norm')]
    if attnres_mode in ('block', 'full'):
        names += ['model.final_res_proj.weight', 'model.final_res_norm.weight']
    for name in names:
        shape = (1, 32) if '_proj' in name else (32,)
        tensors[name] = torch.randn(shape, generator=g) + (1.0 if '_norm' in name else 0.0)
    save_file(tensors, path / 'model.safetensors', metadata={'format': 'pt'})
    return tensors


@pytest.mark.parametrize('attnres_mode', list(OFFICIAL))
def test_official_checkpoint_loads(tmp_path, attnres_mode):
    tensors = write_official(tmp_path, attnres_mode)
    model = load_hf(tmp_path)
    cfg = model.config
    assert (cfg.residual, cfg.n_blocks, cfg.res_gate) == (OFFICIAL[attnres_mode], 2, False)
    assert cfg.variant == ('official' if attnres_mode.startswith('delta') else 'paper')
    own = model.state_dict()
    # the official Delta modes never use their first attention's site (it reads E unrouted): not loaded
    unused = {f'model.layers.0.attn_res_{p}.weight' for p in ('proj', 'norm')} if cfg.variant == 'official' else set()
    assert all(torch.equal(own[k.removeprefix('model.')], t) for k, t in tensors.items() if k not in unused)   # landed
    assert {k for k in own if '_res_' in k} == {k.removeprefix('model.') for k in tensors if '_res_' in k} - {
        k.removeprefix('model.') for k in unused}
    # its config class's default of 8 blocks (and any count above the 4 layers) is one layer per block
    write_official(tmp_path, attnres_mode, attnres_num_blocks=8)
    assert load_hf(tmp_path).config.layers_per_block == 1
    # and it is saved, exported and loaded back with its variant
    save_hf(model, tmp_path / 'ours')
    assert load_hf(tmp_path / 'ours').config == cfg


@pytest.mark.parametrize('change, message', [
    (dict(attnres_mode='delta_v'), "attnres_mode 'delta_v'"),
    (dict(attnres_mode='pre_gated'), "attnres_mode 'pre_gated'"),
    (dict(attnres_mode='baseline'), 'plain Qwen3 checkpoint'),
    (dict(attnres_gate_type='sigmoid_scalar'), "attnres_gate_type 'sigmoid_scalar'"),
    (dict(attnres_gate_type='learnable_alpha'), "attnres_gate_type 'learnable_alpha'"),
    (dict(attnres_use_null_source=True), 'null source'),
])
def test_official_checkpoint_refusals(tmp_path, change, message):
    write_official(tmp_path, **{'attnres_mode': 'delta_block', **change})
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


# -----------------------------------------------------------------------------
# Downstream evaluation: eval_lm.py with lm-evaluation-harness on a local multiple-choice task

TASK_ROWS = [dict(question='The sky is', choices=['blue', 'green', 'made of cheese'], answer=0),
             dict(question='2 + 2 =', choices=['4', '5'], answer=0),
             dict(question='Cats say', choices=['meow', 'woof', 'moo'], answer=0),
             dict(question='def f(x): return', choices=['x', 'None', 'x ** 2'], answer=2)]


def write_local_task(path):
    path.mkdir()
    (path / 'data.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in TASK_ROWS))
    (path / 'tiny_mc.yaml').write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path / 'data.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def test_eval_lm_local_task_matches_gpt(tmp_path, monkeypatch, capsys):
    pytest.importorskip('lm_eval')
    pytest.importorskip('accelerate')
    import eval_lm
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
    write_local_task(tmp_path / 'tasks')
    # a train.py run (a checkpoint folder, byte tokens): eval_lm exports it and evaluates it through transformers
    model = make_model('delta_block', n_blocks=2, vocab_size=320, block_size=64)
    out = tmp_path / 'run'
    write_checkpoint(out / 'step_000000', model.state_dict(), asdict(model.config), meta={'tokenizer': 'byte'})
    results = eval_lm.main([str(out), '--tasks=tiny_mc', f'--include_path={tmp_path / "tasks"}', '--batch_size=3',
                            '--device=cpu', '--dtype=float32'])
    # every log-likelihood lm-eval used equals the one computed directly with GPT
    enc = get_tokenizer('byte')
    correct = []
    for sample in results['samples']['tiny_mc']:
        lls = []
        for (context, continuation), ((ll, greedy),) in zip(sample['arguments'], sample['resps']):
            ctx, cont = enc.encode_ordinary(context), enc.encode_ordinary(continuation)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = model(ids[:, :-1])[0].log_softmax(-1)[0, len(ctx) - 1:]
            ref = logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()
            assert ll == pytest.approx(ref, rel=1e-5, abs=1e-5), (context, continuation)
            assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())
            lls.append(ref)
        correct.append(max(range(len(lls)), key=lls.__getitem__) == sample['doc']['answer'])
    assert len(correct) == len(TASK_ROWS)
    acc = sum(correct) / len(correct)
    assert results['results']['tiny_mc']['acc,none'] == pytest.approx(acc)
    printed = capsys.readouterr().out
    assert f"tiny_mc{acc:>19.4f}" in printed and f"average{acc:>19.4f}" in printed
    written = json.loads((out / 'eval_lm.json').read_text())
    assert written['acc'] == {'tiny_mc': pytest.approx(acc)} and written['tasks'] == ['tiny_mc']
