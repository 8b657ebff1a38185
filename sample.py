"""
Sample from a model of any residual mode, with a KV cache.

From a train.py checkpoint (out_dir/ckpt; its dataset's tokenizer is recorded in it):
    python sample.py --out_dir=out/tiny --start="def " --max_new_tokens=200      # the quick start's run
From a Hugging Face Qwen3 directory (its tokenizer.json is used), converted to a residual mode on the
fly (additive modes with the exact identity init, so they sample like the checkpoint itself), or from
a directory that checkpoints.save_hf exported (it loads in the mode it was saved in):
    python sample.py --init_from=/path/to/Qwen3-0.6B --residual=delta_block --start=FILE:prompt.txt

Routing mixes over depth, separately for every token, so only attention needs a cache: each new token
builds its own sources (and partial block) from its own sublayer outputs, reading the past only
through the cached keys and values.
"""
import math
import os
import sys
import time
from pathlib import Path

from checks import InvalidValue, check_settings, print_mistakes

# -----------------------------------------------------------------------------
init_from = 'resume'        # 'resume' (out_dir/ckpt, from train.py) or a Hugging Face-style checkpoint directory
out_dir = 'out'
residual = None             # checkpoint directory only: convert to this mode (None: as saved)
n_blocks = None             # checkpoint directory only: blocks of the converted mode (None: as saved)
tokenizer = None            # None: the checkpoint's own; or 'byte', 'gpt2', a tokenizer.json / directory / hub name
start = '\n'                # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 200
temperature = 0.8           # 1.0 = the model's distribution; lower is more conservative; 0 = greedy
top_k = 200                 # sample among the k most likely tokens only (0: all)
seed = 1337
device = None               # None: 'cuda' where torch sees a GPU, else 'cpu'
dtype = None                # None: 'bfloat16' on a GPU, else 'float32'
use_kv_cache = True         # False recomputes the whole sequence for every new token (same tokens, slower)
fast_routing = True         # False: model.route() at every site (after editing it; train.py's setting)
# -----------------------------------------------------------------------------
if __name__ == '__main__':  # the overrides come before torch loads, so that --help answers at once
    print_mistakes()    # a mistake in a setting or a file: one line (checks.py); a bug: its traceback
    exec(open(os.path.join(os.path.dirname(__file__), 'configurator.py')).read())  # overrides: command line, config file

import torch

from checkpoints import load_model
from model import KVCache
from tokenizer import get_tokenizer


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0, n_vocab=None, use_kv_cache=True, generator=None):
    """Append max_new_tokens sampled tokens to idx (B, T). n_vocab: never sample ids at or above it
    (train.py pads the vocabulary to a multiple of 64; Qwen3's embedding is larger than its tokenizer)."""
    if idx.size(1) + max_new_tokens > model.config.block_size:
        raise InvalidValue(f"prompt ({idx.size(1)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"block_size {model.config.block_size}")
    cache = KVCache(model.config.n_layer) if use_kv_cache else None
    new = idx                                    # with a cache, only the tokens the model has not seen yet
    for _ in range(max_new_tokens):
        logits, _ = model(new, kv_cache=cache) if use_kv_cache else model(idx)
        logits = logits[:, -1, :].float()
        if n_vocab is not None:
            logits[:, n_vocab:] = float('-inf')
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = float('-inf')
            nxt = torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, nxt), dim=1)
        new = nxt
    return idx


if __name__ == '__main__':
    gpu = torch.cuda.is_available()     # None: what suits this machine
    device = ('cuda' if gpu else 'cpu') if device is None else device
    dtype = ('bfloat16' if gpu else 'float32') if dtype is None else dtype
    check_settings(globals(), {  # setting: (holds?, what is expected); all checked before the model is loaded
        'temperature': (temperature == 0 or 1e-4 <= temperature < math.inf,
                        '0 (greedy, always the most likely token) or a number from 1e-4 up'),
        'top_k': (top_k >= 0, '>= 0 (0: all tokens)'),
        'num_samples': (num_samples >= 1, '>= 1'),
        'max_new_tokens': (max_new_tokens >= 1, '>= 1'),
        'dtype': (dtype in ('float32', 'bfloat16', 'float16'), "'float32', 'bfloat16' or 'float16'"),
        'start': (not start.startswith('FILE:') or os.path.isfile(start[5:]), 'a prompt, or FILE:path of a file'),
        'device': (isinstance(device, str) and (device == 'cpu' or (device.startswith('cuda') and gpu)),
                   "'cpu', or 'cuda' / 'cuda:N' on a machine with CUDA"),
    })
    torch.manual_seed(seed)
    model, recorded_tokenizer = load_model(init_from, out_dir, residual, n_blocks)
    tokenizer = tokenizer or recorded_tokenizer
    if tokenizer is None:
        raise InvalidValue(f"{init_from} has no tokenizer.json; pass --tokenizer (byte, gpt2, a tokenizer.json or hub name)")
    enc = get_tokenizer(tokenizer)
    if enc.n_vocab > model.config.vocab_size:
        raise InvalidValue(f"tokenizer {tokenizer} has {enc.n_vocab} tokens, more than the model's vocab_size {model.config.vocab_size}")
    model.to(device=device, dtype=getattr(torch, dtype)).eval()
    model.fast_routing = fast_routing
    if start.startswith('FILE:'):
        start = Path(start[5:]).read_text(encoding='utf-8')
    ids = enc.encode_ordinary(start)
    if not ids:
        ids = [enc.eot_token]   # an empty prompt: start as at a document boundary
    x = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    t0 = time.time()
    y = generate(model, x, max_new_tokens, temperature, top_k, enc.n_vocab, use_kv_cache)
    dt = time.time() - t0
    for row in y.tolist():
        print(enc.decode(row))
        print('---------------')
    print(f"{model.config.residual}: {num_samples} x {max_new_tokens} tokens in {dt:.2f} s "
          f"({num_samples * max_new_tokens / dt:.1f} tok/s, KV cache {'on' if use_kv_cache else 'off'})", file=sys.stderr)
