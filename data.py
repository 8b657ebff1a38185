"""
The token-shard format and how training reads it.

A dataset is a folder data/<name>/ holding
  meta.json                 tokenizer name, vocab size, token counts (written by prepare_fineweb.py)
  <name>_val_000000.bin     the held-out validation split (whole documents, never in training)
  <name>_train_000001.bin   training shards, ...
Each .bin file is llm.c's format: a 256 x int32 header (magic, version, token count, then zeros)
followed by the tokens: uint16 in version 1 (llm.c's), uint32 in version 2 (ours, for vocabularies
over 65,536 such as Qwen3's 151,936). The header lets us catch the two usual accidents loudly: a file that
is not a shard at all (bad magic) and a file that was cut short by a crash or a full disk (truncated).
"""

import glob
import json
import os

import numpy as np

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
        raise ValueError(f"token id {int(tokens.max())} does not fit in {np.dtype(dtype).name} (shard format version {version})")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = MAGIC, version, len(tokens)
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())
    os.replace(tmp, path)


def read_shard(path):
    """Memory-map the tokens of one shard after checking its header against the file size."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data shard {path} does not exist")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"data shard {path} is corrupt: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ValueError(f"data shard {path} is corrupt: bad magic {header[0]} (expected {MAGIC}); "
                         f"is it a shard written by prepare_fineweb.py?")
    if header[1] not in VERSIONS:
        raise ValueError(f"data shard {path} has format version {header[1]}; this code reads versions {sorted(VERSIONS)}")
    dtype = VERSIONS[int(header[1])]
    ntok = int(header[2])
    expected = HEADER_BYTES + ntok * np.dtype(dtype).itemsize
    if size != expected:
        raise ValueError(f"data shard {path} is corrupt: the header says {ntok:,} tokens ({expected:,} bytes) "
                         f"but the file has {size:,} bytes (truncated or overwritten?); re-run prepare_fineweb.py")
    return np.memmap(path, dtype=dtype, mode='r', offset=HEADER_BYTES, shape=(ntok,))


def load_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no dataset at {data_dir} (missing {path}); "
                                f"prepare one first, e.g. `python prepare_fineweb.py --demo`")
    with open(path) as f:
        return json.load(f)


def shard_paths(data_dir, split):
    paths = sorted(glob.glob(os.path.join(data_dir, f'*_{split}_*.bin')))
    if not paths:
        raise FileNotFoundError(f"no {split} shards (*_{split}_*.bin) in {data_dir}; re-run prepare_fineweb.py")
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
    val: the windows in file order, always the same ones, so every evaluation is comparable, also
    between runs on different numbers of processes.
    """

    def __init__(self, data_dir, split, batch_size, block_size, rank=0, world_size=1, grad_accum=1, seed=0):
        self.split, self.B, self.T = split, batch_size, block_size
        self.rank, self.world_size, self.grad_accum, self.seed = rank, world_size, grad_accum, seed
        self.shards = [read_shard(p) for p in shard_paths(data_dir, split)]
        # window i of shard s starts at token i*T; it needs T+1 tokens (the last one is only a target)
        counts = np.array([max(0, (len(s) - 1) // block_size) for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.n_windows = int(self.offsets[-1])
        self.pos = 0
        self._epoch, self._perm = None, None
        need = batch_size * world_size * (grad_accum if split == 'train' else 1)
        if self.n_windows < need:
            ntok = sum(len(s) for s in self.shards)
            raise ValueError(
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

    def val_batches(self, n):
        """This rank's share of the first n val batches. The n batches are the same for any number of
        processes (rank r takes batches r, r + world_size, ...); n is rounded down to a multiple of
        world_size so that every rank runs the same number of forward passes (FSDP needs that)."""
        n = min(n, self.n_windows // self.B)
        n -= n % self.world_size
        return [self._batch(range(k * self.B, (k + 1) * self.B)) for k in range(self.rank, n, self.world_size)]
