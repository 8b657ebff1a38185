"""
Checkpoints in and out of this repo, below the scripts that use them (sample.py, export.py, eval_lm.py,
report.py). model.py is the model's math; this file is the formats (tokenizers: tokenizer.py):

- Hugging Face directories (config.json + safetensors): load_hf reads a Qwen3 checkpoint, a directory
  that save_hf wrote, or one that the authors' official code saved (model_type 'qwen3_attnres');
  save_hf writes a plain Qwen3 checkpoint for 'standard' and, for the routed modes, a directory that
  transformers loads with trust_remote_code=True, its remote code being hf_model.py + model.py itself;
- train.py checkpoints (runs.py's format): load_model(init_from, out_dir), load_trained(path).
"""
import json
import shutil
from pathlib import Path

import torch

from checks import InvalidValue, Missing
from model import GPT, GPTConfig, RESIDUAL_MODES
from runs import latest, read_checkpoint

# -----------------------------------------------------------------------------
# Hugging Face directories (config.json + safetensors), read and written without `transformers`

# Exact identity at conversion (identity_init=True, additive modes). With zero queries the routed
# mix is the mean of the sources, and in the additive modes the sources sum to h, so the sublayer
# would read x = h + h/N: pre-norm hides the scale only up to RMSNorm's eps and rounding. Instead
# a learnable scalar gate per site, x = h + gate * routed, starts at 0: every sublayer reads exactly
# the pretrained h, so the logits are the pretrained model's. It is no dead end: dL/dgate =
# <dL/dx, routed> is non-zero at step 0, so the first optimizer step opens the gates, and from then
# on the queries and key norms get gradients too. The replacement modes (attnres, full_attnres)
# have no such point: x = sum_i alpha_i s_i is never h (the sublayer sees a convex mix of sources
# whose sum is h, e.g. h/N at uniform routing, and the final norm reads a mix too), so they start
# from the from-scratch routing init and pay a loss jump at conversion.
ROUTING_CONFIG_KEY = 'attention_residuals'   # our config.json entry: residual, n_blocks, res_gate, variant
ROUTING_FIELDS = ('residual', 'n_blocks', 'res_gate', 'variant')
# A routed mode's directory has its own model_type, so that transformers without trust_remote_code
# refuses it instead of loading it as a plain Qwen3 with the routing dropped.
MODEL_TYPE = 'qwen3_attention_residuals'
REMOTE_CODE = ('hf_model.py', 'model.py', 'fast_routing.py')    # copied into the directory: transformers imports them

# The authors' code (wdlctc/delta-attention-residuals-code, Attention-Residuals/modeling_qwen3_attnres.py)
# saves model_type 'qwen3_attnres' with its mode in attnres_mode. Its routing tensors are named as ours
# (model.layers.N.{attn,mlp}_res_{proj,norm}.weight, and model.final_res_{proj,norm}.weight where the
# mode routes the final norm's input: block and full). Its baseline is a plain Qwen3ForCausalLM
# checkpoint (model_type 'qwen3'), which loads as 'standard' like any Qwen3.
OFFICIAL_MODES = {'full': 'full_attnres', 'block': 'attnres', 'delta': 'delta_attnres', 'delta_block': 'delta_block'}


def official_routing(hf, path):
    """config.json of the official code -> our ROUTING_CONFIG_KEY entry; a ValueError for what it runs
    that no mode here computes exactly. Defaults are its config class's (mode 'block', 8 blocks)."""
    mode, gate = hf.get('attnres_mode', 'block'), hf.get('attnres_gate_type', 'bias')
    if mode == 'baseline':
        raise InvalidValue(f"{path}: attnres_mode 'baseline' in a qwen3_attnres config is not what the official code "
                         f"trains (its baseline is a plain Qwen3 checkpoint, model_type 'qwen3', which loads here as "
                         f"'standard'); its qwen3_attnres layers have no baseline branch and would route it as 'full' "
                         f"without the final routing site, which no mode here computes")
    if mode not in OFFICIAL_MODES:
        raise InvalidValue(f"{path}: attnres_mode {mode!r} of the official code has no counterpart here (the '_v' modes "
                         f"route the attention values separately, the others change the sources or gate them before the "
                         f"softmax); loadable: {', '.join(OFFICIAL_MODES)}")
    if gate != 'bias':
        raise InvalidValue(f"{path}: attnres_gate_type {gate!r} mixes the routed input with the residual stream through a "
                         f"gate no mode here has; only 'bias' (despite its name: no gate, the routed input used as is) loads")
    if hf.get('attnres_use_null_source'):
        raise InvalidValue(f"{path}: attnres_use_null_source=true adds a learned null source to every routing site, "
                         f"which no mode here has")
    # the official layers_per_block is max(1, ceil(L / n)): more blocks than layers is one layer per block
    n_blocks = min(hf.get('attnres_num_blocks', 8), hf['num_hidden_layers'])
    residual = OFFICIAL_MODES[mode]
    # the Delta modes as the official code runs them (GPTConfig.variant); for the others both agree
    variant = 'official' if residual in ('delta_attnres', 'delta_block') else 'paper'
    return {'residual': residual, 'n_blocks': n_blocks, 'res_gate': False, 'variant': variant}


def load_hf(path, identity_init=False, routing_init_std=0.0, **overrides):
    """Build a model of any residual mode from a LOCAL Hugging Face directory. Its tensors load by name.
    A plain Qwen3 checkpoint has no routing parameters: they keep their from-scratch init (zero queries:
    uniform routing), or with identity_init=True (additive modes) get zero gates, so the converted model
    computes exactly what the checkpoint does; routing_init_std > 0 draws the new queries from N(0, std^2) instead,
    as the authors' code does when it converts. A directory written by save_hf, or by the official code,
    also holds the routing parameters and its mode, and loads as it was saved."""
    from safetensors import safe_open
    path = Path(path)
    if not (path / 'config.json').is_file():
        raise InvalidValue(f"{path} is not a Hugging Face checkpoint directory: it has no config.json")
    hf = json.loads((path / 'config.json').read_text())
    if hf.get('model_type') not in ('qwen3', MODEL_TYPE, 'qwen3_attnres'):
        raise InvalidValue(f"{path} holds a {hf.get('model_type')!r} model; expected model_type 'qwen3' "
                         f"(or {MODEL_TYPE!r} from save_hf, 'qwen3_attnres' from the official code)")
    for rope in (hf.get('rope_scaling'), hf.get('rope_parameters')):   # older and newer HF writers
        if rope and rope.get('rope_type', rope.get('type', 'default')) != 'default':
            raise InvalidValue(f"rope scaling {rope} is not implemented; only plain RoPE ('default') is")
    rope_theta = hf.get('rope_theta', (hf.get('rope_parameters') or {}).get('rope_theta', 1e6))
    if hf.get('use_sliding_window') or 'sliding_attention' in hf.get('layer_types', []):
        raise InvalidValue("sliding-window attention layers are not implemented; only full causal attention is")
    if hf.get('attention_bias'):
        raise InvalidValue("attention biases are not implemented (attention_bias=true); Qwen3 has none")
    if hf.get('hidden_act', 'silu') != 'silu':
        raise InvalidValue(f"hidden_act {hf['hidden_act']!r} is not implemented; expected 'silu' (SwiGLU)")
    args = dict(
        vocab_size=hf['vocab_size'], block_size=hf['max_position_embeddings'],
        n_layer=hf['num_hidden_layers'], n_head=hf['num_attention_heads'],
        n_kv_head=hf.get('num_key_value_heads', hf['num_attention_heads']), n_embd=hf['hidden_size'],
        head_dim=hf.get('head_dim', hf['hidden_size'] // hf['num_attention_heads']),
        intermediate_size=hf['intermediate_size'],
        rope_theta=float(rope_theta),
        rms_norm_eps=hf.get('rms_norm_eps', 1e-6), tie_embeddings=hf.get('tie_word_embeddings', False),
    )
    stored = official_routing(hf, path) if hf['model_type'] == 'qwen3_attnres' else hf.get(ROUTING_CONFIG_KEY) or {}
    args.update(stored)
    mode = overrides.get('residual', args.get('residual', 'standard'))
    if identity_init:
        if stored.get('residual', 'standard') != 'standard':
            raise InvalidValue(f"{path} already holds a trained {stored['residual']!r} model with its routing "
                             f"parameters; identity_init only applies when converting a plain Qwen3 checkpoint")
        if RESIDUAL_MODES.get(mode, (None, None))[1] == 'replace':
            raise InvalidValue(f"identity_init cannot be exact for the replacement mode {mode!r}: its sublayers read "
                             f"a convex mix of sources, never the residual stream itself; convert it without "
                             f"identity_init (uniform routing) and expect a loss jump")
        if RESIDUAL_MODES.get(mode, (None, None))[1] == 'add':
            overrides = {**overrides, 'res_gate': True}
    conflicts = {k: (v, overrides[k]) for k, v in stored.items()
                 if k in overrides and overrides[k] != v and stored.get('residual', 'standard') != 'standard'}
    if conflicts:
        raise InvalidValue(f"{path} holds a trained {stored['residual']!r} model whose routing parameters do not fit "
                         f"other settings: {', '.join(f'{k}={a!r} stored, {b!r} requested' for k, (a, b) in conflicts.items())}")
    try:
        model = GPT(GPTConfig(**{**args, **overrides}))
    except ValueError as e:     # a shape or setting that model.py refuses (it imports nothing of this repo)
        raise InvalidValue(f"{path}: {e}") from None

    if (path / 'model.safetensors.index.json').is_file():
        shards = sorted(set(json.loads((path / 'model.safetensors.index.json').read_text())['weight_map'].values()))
    elif (path / 'model.safetensors').is_file():
        shards = ['model.safetensors']
    else:
        raise InvalidValue(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for shard in shards:
        with safe_open(path / shard, framework='pt') as f:
            for key in f.keys():
                tensors[key.removeprefix('model.')] = f.get_tensor(key)   # HF nests the decoder under 'model.'
    if model.config.tie_embeddings:
        tensors.pop('lm_head.weight', None)      # tied: the embedding is the head
    if hf['model_type'] == 'qwen3_attnres' and model.config.official:
        # the official code builds a routing site for the first attention too but never uses it (that
        # attention reads E unrouted); model.py's official variant has no such site
        for part in ('proj', 'norm'):
            tensors.pop(f'layers.0.attn_res_{part}.weight', None)
    own = model.state_dict()
    # routing parameters are expected only from a directory that holds a routed mode
    routed_dir = stored.get('residual', 'standard') != 'standard'
    expected = {k for k in own if (routed_dir or not GPT.is_routing(k))
                and not (model.config.tie_embeddings and k == 'lm_head.weight')}
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise InvalidValue(f"{path} does not match a Qwen3 model of this shape: missing tensors {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {unexpected[:8]}")
    for k, t in tensors.items():
        if t.shape != own[k].shape:
            raise InvalidValue(f"tensor {k} has shape {tuple(t.shape)} in {path}, expected {tuple(own[k].shape)}")
    with torch.no_grad():
        for k, t in tensors.items():
            own[k].copy_(t)
        if identity_init:
            for k in own:
                if k.endswith('_res_gate'):
                    own[k].zero_()
    if routing_init_std > 0:
        if routed_dir:
            raise InvalidValue(f"{path} holds a trained {stored['residual']!r} model: routing_init_std would overwrite "
                               f"its routing queries; it only applies when converting a plain Qwen3 checkpoint")
        model.init_queries(routing_init_std)
    return model


def save_hf(model, path, dtype=None):
    """Write a Hugging Face directory (config.json + model.safetensors) that load_hf reads back exactly.

    'standard' is a plain Qwen3 checkpoint: transformers' Qwen3ForCausalLM loads it, tensors named as
    Qwen3's ('model.layers.0.self_attn.q_proj.weight', ..., 'lm_head.weight'). A routed mode is a
    transformers model with remote code: AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    imports hf_model.py from the directory, which wraps model.py's GPT (copied next to it; transformers
    copies a remote module's relative imports) in a PreTrainedModel held as `model`, so every tensor is
    'model.' + the GPT's own name ('model.layers.0.attn_res_proj.weight', 'model.lm_head.weight') and
    config.json records the mode under 'attention_residuals'."""
    from safetensors.torch import save_file
    cfg, path = model.config, Path(path)
    path.mkdir(parents=True, exist_ok=True)
    routed = cfg.residual != 'standard'
    tensors = {}
    for k, t in model.state_dict().items():
        if k == 'lm_head.weight' and cfg.tie_embeddings:
            continue            # tied: stored once, as the embedding (as HF does)
        t = t.detach().to('cpu', dtype if dtype is not None and t.is_floating_point() else t.dtype)
        tensors[k if k == 'lm_head.weight' and not routed else 'model.' + k] = t.contiguous()
    save_file(tensors, path / 'model.safetensors', metadata={'format': 'pt'})
    hf = {
        'model_type': 'qwen3', 'vocab_size': cfg.vocab_size, 'max_position_embeddings': cfg.block_size,
        'num_hidden_layers': cfg.n_layer, 'num_attention_heads': cfg.n_head, 'num_key_value_heads': cfg.n_kv_head,
        'hidden_size': cfg.n_embd, 'head_dim': cfg.head_dim, 'intermediate_size': cfg.intermediate_size,
        'rope_theta': cfg.rope_theta, 'rms_norm_eps': cfg.rms_norm_eps, 'tie_word_embeddings': cfg.tie_embeddings,
        'hidden_act': 'silu', 'attention_bias': False, 'use_sliding_window': False,
        'torch_dtype': str(next(iter(tensors.values())).dtype).removeprefix('torch.'),
        'architectures': ['Qwen3ForCausalLM'],
        ROUTING_CONFIG_KEY: {k: getattr(cfg, k) for k in ROUTING_FIELDS},
    }
    if routed:
        hf.update(model_type=MODEL_TYPE, architectures=['GPTForCausalLM'],
                  auto_map={'AutoConfig': 'hf_model.GPTHFConfig', 'AutoModelForCausalLM': 'hf_model.GPTForCausalLM'})
        for f in REMOTE_CODE:
            shutil.copy(Path(__file__).parent / f, path / f)
    (path / 'config.json').write_text(json.dumps(hf, indent=2) + '\n')


# -----------------------------------------------------------------------------
# train.py checkpoints and Hugging Face directories, for the scripts

def trained_checkpoint(out_dir):
    """The checkpoint a train.py out_dir continues from (runs.latest)."""
    if path := latest(out_dir):
        return path
    raise Missing(f"no checkpoint in {out_dir} (out_dir/ckpt); train one with train.py or pass "
                            f"--init_from=<checkpoint dir>")


def load_trained(path, residual=None, n_blocks=None):
    """A train.py checkpoint (a folder such as out_dir/ckpt or out_dir/best), read safely
    (runs.read_checkpoint) -> (model, the name of its dataset's tokenizer)."""
    ckpt = read_checkpoint(path)  # a cut-short, corrupt or unsafe checkpoint: an error naming it and what to do
    cfg = GPTConfig(**ckpt['model_config'])
    changed = {k: v for k, v in dict(residual=residual, n_blocks=n_blocks).items() if v is not None and getattr(cfg, k) != v}
    if changed:
        raise InvalidValue(f"{path} was trained as residual={cfg.residual!r}, n_blocks={cfg.n_blocks}; a trained "
                         f"model is sampled as it was trained (asked for {changed})")
    model = GPT(cfg)
    model.load_state_dict(ckpt['model'])
    return model, ckpt['meta']['tokenizer']


def load_model(init_from, out_dir='out', residual=None, n_blocks=None):
    """init_from 'resume' (out_dir's latest train.py checkpoint) or a Hugging Face directory (load_hf; a plain
    Qwen3 converted to residual/n_blocks, additive modes with the exact identity init)
    -> (model, the name of its tokenizer for get_tokenizer, or None if it has none)."""
    overrides = {k: v for k, v in dict(residual=residual, n_blocks=n_blocks).items() if v is not None}
    if init_from == 'resume':
        return load_trained(trained_checkpoint(out_dir), residual, n_blocks)
    path = Path(init_from)
    if not (path / 'config.json').is_file():
        raise Missing(f"init_from={init_from!r} is neither 'resume' nor a checkpoint directory with a config.json")
    hf = json.loads((path / 'config.json').read_text())
    plain = hf.get('model_type') == 'qwen3' and (hf.get(ROUTING_CONFIG_KEY) or {}).get('residual', 'standard') == 'standard'
    # a plain Qwen3 converted to an additive mode starts as exactly the checkpoint (see load_hf)
    identity_init = plain and RESIDUAL_MODES[overrides.get('residual', 'standard')][1] == 'add'
    model = load_hf(path, identity_init=identity_init, **overrides)
    return model, str(path) if (path / 'tokenizer.json').is_file() else None
