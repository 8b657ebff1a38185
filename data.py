"""
The token-shard format and how training reads it.

A dataset is a folder data/<name>/ holding
  meta.json                 tokenizer name, vocab size, token counts, the shards and their lengths
                            (written by prepare_fineweb.py, last)
  <name>_val_000000.bin     the held-out validation split (whole documents, never in training)
  <name>_train_000001.bin   training shards, ...
Each .bin file is llm.c's format: a 256 x int32 header (magic, version, token count, then zeros)
followed by the tokens: uint16 in version 1 (llm.c's), uint32 in version 2 (ours, for vocabularies
over 65,536 such as Qwen3's 151,936). The header lets us catch the two usual accidents loudly: a file that
is not a shard at all (bad magic) and a file that was cut short by a crash or a full disk (truncated).
ShardLoader also checks the shards against meta.json (the same files and token counts, every token id
inside the vocabulary), so a dataset left half-replaced or mixed with another one is refused, not trained on.
Every error names the file it is about.
"""

import glob
import json
import os

import numpy as np

from checks import InvalidValue, Missing, is_count

MAGIC = 20240520  # same magic and version as llm.c, so its tools read our shards and vice versa
VERSIONS = {1: np.uint16, 2: np.uint32}  # format version -> token dtype
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


def token_dtype(vocab_size):
    """The narrowest token dtype of the format for this vocabulary."""
    return np.uint16 if vocab_size <= 2 ** 16 else np.uint32


def write_shard(path, tokens, dtype=np.uint16):
    """Write one shard atomically: a reader never sees a half-written file under the final name."""
    tokens = np.asarray(tokens)
    assert tokens.ndim == 1
    version = {np.dtype(d): v for v, d in VERSIONS.items()}[np.dtype(dtype)]
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise InvalidValue(f"token id {int(tokens.max())} does not fit in {np.dtype(dtype).name} (shard format version {version})")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = MAGIC, version, len(tokens)
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())
    os.replace(tmp, path)


def read_shard(path, vocab_size=None):
    """Memory-map the tokens of one shard after checking its header against the file size and, given the
    dataset's vocab_size, every token id against it (one pass over the file: ~0.04 s per 100M tokens from the page cache)."""
    if not os.path.isfile(path):
        raise Missing(f"data shard {path} does not exist")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise InvalidValue(f"data shard {path} is corrupt: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise InvalidValue(f"data shard {path} is corrupt: bad magic {header[0]} (expected {MAGIC}); "
                         f"is it a shard written by prepare_fineweb.py?")
    if header[1] not in VERSIONS:
        raise InvalidValue(f"data shard {path} has format version {header[1]}; this code reads versions {sorted(VERSIONS)}")
    dtype = VERSIONS[int(header[1])]
    ntok = int(header[2])
    expected = HEADER_BYTES + ntok * np.dtype(dtype).itemsize
    if size != expected:
        raise InvalidValue(f"data shard {path} is corrupt: the header says {ntok:,} tokens ({expected:,} bytes) "
                         f"but the file has {size:,} bytes (truncated or overwritten?); re-run prepare_fineweb.py")
    tokens = np.memmap(path, dtype=dtype, mode='r', offset=HEADER_BYTES, shape=(ntok,))
    if vocab_size is not None and ntok and (top := int(tokens.max())) >= vocab_size:
        raise InvalidValue(f"data shard {path} holds token id {top}, outside the dataset's vocabulary of {vocab_size} "
                         f"(meta.json): the shard belongs to another tokenizer or is corrupt; re-run prepare_fineweb.py")
    return tokens


META_KEYS = ('tokenizer', 'vocab_size')  # what every reader needs; prepare_fineweb.py writes more


def load_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise Missing(f"no dataset at {data_dir} (missing {path}); "
                                f"prepare one first, e.g. `python prepare_fineweb.py --demo`")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise InvalidValue(f"{path} is corrupt ({e}); re-run prepare_fineweb.py") from None
    if not isinstance(meta, dict) or any(k not in meta for k in META_KEYS):
        raise InvalidValue(f"{path} is not a prepare_fineweb.py meta.json (it needs {', '.join(META_KEYS)}); "
                         f"re-run prepare_fineweb.py")
    wrong = [k for k, ok in (('tokenizer', isinstance(meta['tokenizer'], str)),
                             ('vocab_size', is_count(meta['vocab_size']) and meta['vocab_size'] >= 1),
                             ('val_tokens', is_count(meta.get('val_tokens', 0))),
                             ('train_tokens', is_count(meta.get('train_tokens', 0))),
                             ('shards', isinstance(meta.get('shards', {}), dict)
                              and all(isinstance(n, str) and is_count(c) for n, c in meta.get('shards', {}).items())))
             if not ok]
    if wrong:
        raise InvalidValue(f"{path} has fields of the wrong type ({', '.join(f'{k}={meta[k]!r}' for k in wrong)}); "
                         f"re-run prepare_fineweb.py")
    return meta


def check_split(data_dir, split, paths, shards, meta):
    """The split's shards are the ones meta.json lists (newer datasets record them) and hold its token count
    (every prepare_fineweb.py dataset records that)."""
    path = os.path.join(data_dir, 'meta.json')
    if 'shards' in meta:
        listed = {n for n in meta['shards'] if f'_{split}_' in n}
        present = {os.path.basename(p) for p in paths}
        if listed != present:
            raise InvalidValue(f"the {split} shards in {data_dir} do not match {path}: missing {sorted(listed - present)}, "
                             f"not listed {sorted(present - listed)}; an interrupted or mixed dataset? re-run prepare_fineweb.py")
    ntok = sum(len(s) for s in shards)
    if f'{split}_tokens' in meta and ntok != meta[f'{split}_tokens']:
        raise InvalidValue(f"the {split} shards in {data_dir} hold {ntok:,} tokens but {path} says {meta[f'{split}_tokens']:,}; "
                         f"an interrupted or mixed dataset? re-run prepare_fineweb.py")


def shard_paths(data_dir, split):
    paths = sorted(glob.glob(os.path.join(data_dir, f'*_{split}_*.bin')))
    if not paths:
        raise Missing(f"no {split} shards (*_{split}_*.bin) in {data_dir}; re-run prepare_fineweb.py")
    return paths


class ShardLoader:
    """
    Cuts a split into non-overlapping windows of block_size+1 tokens (inputs and the next-token targets)
    and serves them as batches.

    train: the windows of all shards are visited in a random order, a fresh permutation per epoch, so
    every token is seen once per epoch. The order is a pure function of (seed, epoch), and the loader's
    only state is `pos`, the number of sequences the whole job has consumed: a resumed run that restores
    `pos` sees exactly the batches the uninterrupted run would have seen. Each optimizer step consumes
    one global batch of world_size * grad_accum * batch_size sequences; rank r, micro-step m takes its
    own slice of it, so ranks read different sequences and the global batch does not depend on how it
    is split across processes (a 2-process DDP run sees the same data as 1 process with 2x accumulation).
    val: windows spread evenly over the whole split (val_batches), always the same ones, so every evaluation
    is comparable, also between runs on different numbers of processes.
    """

    def __init__(self, data_dir, split, batch_size, block_size, rank=0, world_size=1, grad_accum=1, seed=0, meta=None):
        """meta: the dataset's meta.json (load_meta); given, the shards are checked against it."""
        self.split, self.B, self.T = split, batch_size, block_size
        self.rank, self.world_size, self.grad_accum, self.seed = rank, world_size, grad_accum, seed
        paths = shard_paths(data_dir, split)
        self.shards = [read_shard(p, meta and meta['vocab_size']) for p in paths]
        if meta is not None:
            check_split(data_dir, split, paths, self.shards, meta)
        # window i of shard s starts at token i*T; it needs T+1 tokens (the last one is only a target)
        counts = np.array([max(0, (len(s) - 1) // block_size) for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.n_windows = int(self.offsets[-1])
        self.pos = 0
        self._epoch, self._perm = None, None
        need = batch_size * world_size * (grad_accum if split == 'train' else 1)
        if self.n_windows < need:
            ntok = sum(len(s) for s in self.shards)
            raise InvalidValue(
                f"the {split} split of {data_dir} has {ntok:,} tokens = {self.n_windows:,} sequences of "
                f"{block_size}+1 tokens, but one {'step' if split == 'train' else 'eval batch'} needs {need:,} "
                f"(batch_size={batch_size} x world_size={world_size}"
                f"{f' x gradient_accumulation_steps={grad_accum}' if split == 'train' else ''}); "
                f"use a smaller batch_size/block_size or prepare more data")

    def _window(self, i):
        s = int(np.searchsorted(self.offsets, i, side='right')) - 1
        start = (i - int(self.offsets[s])) * self.T
        return self.shards[s][start:start + self.T + 1]

    def _train_index(self, q):
        epoch, j = divmod(q, self.n_windows)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._perm = epoch, rng.permutation(self.n_windows)
        return int(self._perm[j])

    def _batch(self, indices):
        buf = np.stack([self._window(i) for i in indices]).astype(np.int64)
        return np.ascontiguousarray(buf[:, :-1]), np.ascontiguousarray(buf[:, 1:])

    def train_batches(self):
        """The micro-batches (x, y) of this rank for the next optimizer step, as numpy int64 arrays."""
        per_rank = self.B * self.grad_accum
        base = self.pos + self.rank * per_rank
        batches = []
        for m in range(self.grad_accum):
            first = base + m * self.B
            batches.append(self._batch([self._train_index(q) for q in range(first, first + self.B)]))
        self.pos += per_rank * self.world_size
        return batches

    def val_batches(self, n=None):
        """This rank's share of n val batches, or (n=None) of the whole val split.

        The n * batch_size windows are spread evenly over the split (window j of them is the split's window
        floor((j + 1/2) * n_windows / (n * batch_size))), so a short evaluation still samples every part of
        the held-out text, not only its first documents; they are the same at every evaluation and for any
        number of processes (rank r takes batches r, r + world_size, ...). n is rounded down to a multiple of
        world_size so that every rank runs the same number of forward passes (FSDP needs that).
        n=None: every window once. The last global batch is filled up with windows whose targets are all -1
        (the loss ignores them), so every rank still runs the same number of forward passes; weigh each
        batch's mean loss by its count of targets >= 0."""
        B, W, N = self.B, self.world_size, self.n_windows
        if n is None:
            picked = np.arange(N)
            padded = -(-N // (B * W)) * B * W
        else:
            n = min(n, N // B)
            n -= n % W
            picked = (2 * np.arange(n * B) + 1) * N // (2 * n * B)
            padded = n * B
        batches = []
        for k in range(self.rank, padded // B, W):
            rows = picked[k * B:(k + 1) * B]
            x, y = self._batch(np.concatenate([rows, np.zeros(B - len(rows), dtype=rows.dtype)]))
            y[len(rows):] = -1     # filler rows: no targets
            batches.append((x, y))
        return batches
