"""Per-GPU memory of every paper config (config/MODE_SCALE.py) at its own batch and parallelism, counted with fake
tensors (no memory is allocated and no GPU is needed), against an 80 GiB H100 with headroom.

    python test_memory.py        # the table in docs/training.md

What a GPU holds during a training step, per process (8 GPUs, the configs' torchrun):
  weights, gradients, AdamW   fp32: 4 + 4 + 8 bytes per parameter; FSDP2 (8b) keeps 1/8 of each, and gathers the root
                              (embedding, LM head, norms, routing: fp32) and two units at a time (BF16, prefetch)
  DDP buckets                 DDP copies the gradients into its own buckets: 4 bytes per parameter more
  activations                 every tensor autograd saves for backward in one micro-batch (batch_size x block_size)
                              under BF16 autocast, counted once per storage with saved_tensors_hooks while the model,
                              made of fake tensors, runs forward (with the config's activation checkpointing)
  working memory              the largest tensors that live only while the loss and its backward run: the fp32 logits'
                              gradient and a BF16 copy (B x T x vocab x 6 bytes)
The vocabulary is Qwen3's (151,936, the paper's), larger than GPT-2's: the larger embedding and logits."""
import math
import os
import sys

import pytest
import torch

from model import GPT, GPTConfig, check_fast_routing

REPO = os.path.dirname(os.path.abspath(__file__))
GiB = 2 ** 30
H100 = 80 * GiB
FITS = 0.85         # of the GPU's memory, the rest for the CUDA context, NCCL buffers and the allocator's fragmentation
GPUS = 8
VOCAB = 151936
SCALES = {'220m': ['standard', 'full_attnres', 'attnres', 'delta_attnres', 'delta_block'],
          '533m': ['standard', 'full_attnres', 'attnres', 'delta_attnres', 'delta_block'],
          '1b': ['standard', 'full_attnres', 'attnres', 'delta_attnres', 'delta_block'],
          '8b': ['standard', 'attnres', 'delta_block']}


def settings(name):
    """The config file's settings (it runs as train.py runs it: from the repository, over the _paper.py defaults)."""
    g, cwd = {}, os.getcwd()
    os.chdir(REPO)
    try:
        exec(open(os.path.join('config', name)).read(), g)
    finally:
        os.chdir(cwd)
    return g


def saved_activation_bytes(cfg, batch, checkpointing):
    """Bytes autograd saves in one forward of batch x cfg.block_size tokens under BF16 autocast, each storage once."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    check_fast_routing(cfg)             # (a real check, before the fake tensors: its tiny model is not this one)
    compiling, torch.compiler.is_compiling = torch.compiler.is_compiling, lambda: True    # as compiled: no checks
    try:                                                                                 # that read values
        with FakeTensorMode():
            model = GPT(cfg)
            if checkpointing:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
                for layer in model.layers:
                    layer.self_attn, layer.mlp = checkpoint_wrapper(layer.self_attn), checkpoint_wrapper(layer.mlp)
            params = {id(p.untyped_storage()) for p in model.parameters()}
            seen = {}

            def pack(t):
                if id(t.untyped_storage()) not in params:
                    seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
                return t
            x = torch.zeros(batch, cfg.block_size, dtype=torch.long)
            with torch.autocast('cpu', dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(x, x)
    finally:
        torch.compiler.is_compiling = compiling
    return sum(seen.values())


def budget(name):
    """{part: bytes} per GPU for config/name."""
    g = settings(name)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=g['block_size'], n_layer=g['n_layer'], n_head=g['n_head'],
                    n_kv_head=g['n_kv_head'], n_embd=g['n_embd'], head_dim=g['head_dim'],
                    intermediate_size=g['intermediate_size'], tie_embeddings=g.get('tie_embeddings', True),
                    residual=g['residual'], n_blocks=g['n_blocks'])
    with torch.device('meta'):
        model = GPT(cfg)
    n = model.get_num_params()
    parts = {}
    if g.get('fsdp', False):
        root = sum(p.numel() for name_, p in model.named_parameters() if '.self_attn.' not in name_ and '.mlp.' not in name_)
        unit = max(sum(p.numel() for p in u.parameters()) for layer in model.layers for u in (layer.self_attn, layer.mlp))
        parts['weights, grads, AdamW'] = 16 * n / GPUS
        parts['gathered'] = (4 + 4) * root + 2 * (2 + 4) * unit      # root fp32 + its grads; 2 units BF16 + fp32 grads
    else:
        parts['weights, grads, AdamW'] = 16 * n
        parts['DDP buckets'] = 4 * n
    parts['activations'] = saved_activation_bytes(cfg, g['batch_size'], g.get('activation_checkpointing', False))
    parts['working'] = g['batch_size'] * g['block_size'] * VOCAB * 6
    return parts


@pytest.mark.parametrize('scale', list(SCALES))
def test_every_paper_config_fits_an_h100(scale):
    for mode in SCALES[scale]:
        parts = budget(f'{mode}_{scale}.py')
        total = sum(parts.values())
        assert total <= FITS * H100, (f"config/{mode}_{scale}.py needs about {total / GiB:.1f} GiB per GPU, more than "
                                      f"{FITS:.0%} of an 80 GiB H100: {({k: round(v / GiB, 1) for k, v in parts.items()})}")
        assert parts['activations'] > 0.1 * GiB        # (the count saw the model's tensors)


if __name__ == '__main__':
    print(f"| config | parallelism | weights, grads, AdamW | DDP buckets / FSDP gathered | activations (saved, BF16) "
          f"| working | total per GPU | of 80 GiB |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for scale, modes in SCALES.items():
        for mode in modes:
            parts = budget(f'{mode}_{scale}.py')
            total = sum(parts.values())
            g = settings(f'{mode}_{scale}.py')
            par = 'FSDP2 + checkpointing' if g.get('fsdp') else 'DDP'
            other = parts.get('DDP buckets', parts.get('gathered', 0))
            print(f"| {mode}_{scale} | {par}, {g['batch_size']} x {g['block_size']} | "
                  f"{parts['weights, grads, AdamW'] / GiB:.1f} | {other / GiB:.1f} | {parts['activations'] / GiB:.1f} | "
                  f"{parts['working'] / GiB:.1f} | {total / GiB:.1f} GiB | {total / H100:.0%} |", flush=True)
    sys.exit(0)
