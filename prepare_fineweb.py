"""
Tokenize a text corpus into the token shards train.py reads (format: data.py).

    python prepare_fineweb.py                          # FineWeb-Edu sample-10BT, GPT-2 BPE, 1.4B tokens
    python prepare_fineweb.py --demo                   # offline: the Python standard library, byte tokens
    python prepare_fineweb.py --local a.jsonl b.jsonl --tokenizer=byte --name=mine   # offline: your files
    python prepare_fineweb.py --tokenizer=Qwen/Qwen3-0.6B --name=fineweb_edu_qwen3  # a checkpoint's own tokenizer

FineWeb-Edu is read in streaming mode, so only the documents needed for --max_tokens are downloaded.
Every document is preceded by <|endoftext|>. The first documents (at least --val_tokens tokens of
them) form the validation shard; all later documents go to the training shards, and any later document
whose text is identical to a validation document is dropped, so validation text never appears in
training. (The official Attention Residuals code evaluates on its training stream with another seed.)
The result is written to data/<name>.partial/ (meta.json last, listing every shard and its length) and
renamed to data/<name>/ only when complete; an existing data/<name>/ is first renamed aside and deleted
only after the swap, and only if it is a dataset this script wrote (meta.json and .bin shards, nothing else). So an interrupted run never leaves a half dataset that looks finished, and train.py
checks the shards against meta.json anyway.
"""

import argparse
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tqdm import tqdm

from checks import InvalidValue, Missing
from tokenizer import get_tokenizer
from data import MAGIC, token_dtype, write_shard

LOCAL_BUILDERS = {'.parquet': 'parquet', '.jsonl': 'json', '.json': 'json', '.txt': 'text'}


def demo_documents():
    """The .py files of the standard library that ships with this interpreter, one document each,
    in a fixed shuffled order (so the validation split is a random sample of modules, not 'a*.py')."""
    stdlib = Path(sysconfig.get_paths()['stdlib'])
    files = sorted(p for p in stdlib.rglob('*.py')
                   if not {'site-packages', 'dist-packages'} & set(p.relative_to(stdlib).parts))
    if not files:
        raise Missing(f"no .py files under {stdlib}; this Python ships without its standard library "
                                f"sources, so the demo corpus is unavailable: use --local FILE... instead")
    random.Random(0).shuffle(files)
    for p in files:
        yield p.read_text(encoding='utf-8', errors='replace')


def local_documents(files, text_column, sample_by):
    """Documents from local parquet/jsonl/txt files through datasets' own builders (streamed), one file
    after the other. The files are checked here, before any work; a file that fails to parse later names itself."""
    files = [str(f) for f in files]
    for f in files:
        if os.path.isdir(f):
            raise InvalidValue(f"--local {f} is a directory; pass the files in it (e.g. {os.path.join(f, '*.jsonl')})")
        if not os.path.isfile(f):
            raise Missing(f"--local file {f} does not exist")
        if os.path.getsize(f) == 0:
            raise InvalidValue(f"--local file {f} is empty")
    kinds = {LOCAL_BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) > 1:
        raise InvalidValue(f"--local files must all be one kind, with suffix one of {sorted(LOCAL_BUILDERS)}; got {files}")
    return _local_rows(files, kinds.pop(), text_column, sample_by)


def _local_rows(files, builder, text_column, sample_by):
    from datasets import load_dataset
    kwargs = {'sample_by': sample_by} if builder == 'text' else {}
    for f in files:
        rows = iter(load_dataset(builder, data_files=[f], split='train', streaming=True, **kwargs))
        while True:
            try:
                row = next(rows)
            except StopIteration:
                break
            except Exception as e:  # a parse error (pyarrow's, a UnicodeDecodeError, ...) that does not say where
                raise InvalidValue(f"--local file {f} is not readable as {builder} "
                                 f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
            if text_column not in row:
                raise InvalidValue(f"--local file {f}: rows have no {text_column!r} column (columns: {sorted(row)}); "
                                 f"set --text_column")
            yield row[text_column]


def fineweb_documents(dataset, subset):
    from datasets import load_dataset
    try:
        rows = iter(load_dataset(dataset, name=subset, split='train', streaming=True))
        first = next(rows)
    except Exception as e:
        raise RuntimeError(f"could not stream {dataset} ({subset}) from the Hugging Face Hub ({type(e).__name__}: {e}). "
                           f"Offline options: `--demo`, or your own files with `--local FILE...`") from e
    yield first['text']
    for row in rows:
        yield row['text']


_enc = None


def _init_worker(tokenizer):
    global _enc
    _enc = get_tokenizer(tokenizer)


def _tokenize(text):
    """-> (hash of the text, its tokens). <|endoftext|> goes *before* each document, so the model always
    starts a document right after it. The hash lets the main process spot training copies of val texts."""
    digest = hashlib.blake2b(text.encode('utf-8', errors='replace'), digest_size=16).digest()
    return digest, np.array([_enc.eot_token] + _enc.encode_ordinary(text), dtype=token_dtype(_enc.n_vocab))


def _tokenize_stream(pool, documents, chunk=256):
    """Pool.imap would read the whole (possibly endless, streamed) input ahead; feeding it a chunk of
    documents at a time bounds what is downloaded and held in memory. imap keeps document order, so
    the output is the same for any number of processes."""
    documents = iter(documents)
    while texts := list(itertools.islice(documents, chunk)):
        yield from pool.imap(_tokenize, texts, chunksize=16)


def prepare(documents, out_dir, name, tokenizer, max_tokens, val_tokens, shard_size, num_proc):
    """Tokenize `documents` (an iterable of str) into out_dir; returns the meta dict written to meta.json."""
    enc = get_tokenizer(tokenizer)  # fail early (e.g. no network for GPT-2) before starting any work
    tokenizer = enc.name   # a hub name is now a local file, for the workers
    if max_tokens is not None and max_tokens <= val_tokens:
        raise InvalidValue(f"--max_tokens ({max_tokens:,}) must exceed --val_tokens ({val_tokens:,}) to leave training data")
    partial, old = out_dir + '.partial', out_dir + '.old'
    for path in (out_dir, partial, old):    # replace (or clear up) only what this script wrote
        if os.path.lexists(path) and not is_dataset_folder(path):
            raise InvalidValue(f"{path} exists and is not a dataset that prepare_fineweb.py wrote (it holds more than "
                             f"meta.json and .bin shards); choose another --name or --data_root, or move it away")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        meta = _write_shards(documents, partial, name, enc, tokenizer, max_tokens, val_tokens, shard_size, num_proc)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # no half-written dataset left behind, whatever stopped us
        raise
    # Replace an existing dataset by two renames (atomic each); deleting it in place could be interrupted
    # half-way and leave meta.json beside missing shards. Killed between the renames, the old dataset is
    # complete in <name>.old and the new one in <name>.partial; data/<name>/ is missing, which train.py says.
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return meta


def is_dataset_folder(path):
    """A folder of this script's making (a dataset, or one left half-written or set aside): plain files only, a
    meta.json that is JSON and shards (*.bin, or *.bin.tmp cut short while written) that begin with the shard
    format's magic number. Only such a folder is ever replaced or deleted: a user's own day1.bin is not a shard."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False

    def ours(e):
        if not e.is_file(follow_symlinks=False):
            return False
        with open(e.path, 'rb') as f:
            head = f.read(4)
        if e.name == 'meta.json':
            try:
                with open(e.path) as f:
                    return isinstance(json.load(f), dict)
            except ValueError:
                return False
        if e.name.endswith('.bin.tmp'):
            return len(head) < 4 or int.from_bytes(head, 'little', signed=True) == MAGIC
        return e.name.endswith('.bin') and len(head) == 4 and int.from_bytes(head, 'little', signed=True) == MAGIC
    return all(ours(e) for e in os.scandir(path))


def _write_shards(documents, partial, name, enc, tokenizer, max_tokens, val_tokens, shard_size, num_proc):
    """The work of prepare(): val documents are kept in memory until the end, training shards are
    written as they fill up."""
    val, val_hashes, dtype, shards = [], set(), token_dtype(enc.n_vocab), {}

    def write(kind, index, tokens):
        shards[f'{name}_{kind}_{index:06d}.bin'] = len(tokens)
        write_shard(os.path.join(partial, f'{name}_{kind}_{index:06d}.bin'), tokens, dtype)
    n_val = n_train = n_docs_val = n_docs_train = n_dupes = 0
    shard, shard_fill, shard_index = np.empty(shard_size, dtype=dtype), 0, 1
    bar = tqdm(total=max_tokens, unit='tok', unit_scale=True, desc=f'tokenizing {name}')
    # forkserver, not fork: a process that forks while other threads hold locks (torch's, a library's) can leave the
    # child deadlocked or dead, and Pool.imap then waits forever (seen once in the test suite, after torch ran)
    with mp.get_context('forkserver').Pool(num_proc, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        for digest, toks in _tokenize_stream(pool, documents):
            if n_val < val_tokens:  # still filling the validation split with whole documents
                val.append(toks)
                val_hashes.add(digest)
                n_val += len(toks)
                n_docs_val += 1
                bar.update(len(toks))
                continue
            if digest in val_hashes:
                n_dupes += 1
                continue
            if max_tokens is not None:
                toks = toks[:max_tokens - n_val - n_train]  # the last document may be cut to respect the budget
            n_docs_train += 1
            n_train += len(toks)
            bar.update(len(toks))
            while len(toks):  # documents may span shard boundaries (training samples windows anyway)
                k = min(len(toks), shard_size - shard_fill)
                shard[shard_fill:shard_fill + k] = toks[:k]
                shard_fill, toks = shard_fill + k, toks[k:]
                if shard_fill == shard_size:
                    write('train', shard_index, shard)
                    shard_fill, shard_index = 0, shard_index + 1
            if max_tokens is not None and n_val + n_train >= max_tokens:
                break  # nothing more is read from `documents`
        # Let the workers finish the chunk already sent (at most 256 documents) and exit, before the with-block
        # calls terminate(): terminating a pool whose task thread is still sending can deadlock (CPython's
        # _help_stuff_finish may take the queue's read lock while the pipe is momentarily empty, and the task
        # thread's next send then blocks forever; seen in the test suite under load).
        pool.close()
        pool.join()
    bar.close()
    if shard_fill:
        write('train', shard_index, shard[:shard_fill])
    if n_train == 0:
        raise InvalidValue(f"the corpus has only {n_val:,} tokens in {n_docs_val} documents, all taken by the "
                         f"validation split; lower --val_tokens or add data")
    write('val', 0, np.concatenate(val))
    meta = dict(name=name, tokenizer=tokenizer, vocab_size=enc.n_vocab, eot_token=enc.eot_token,
                val_tokens=n_val, val_documents=n_docs_val, train_tokens=n_train, train_documents=n_docs_train,
                train_duplicates_of_val_dropped=n_dupes, shard_size=shard_size, shards=dict(sorted(shards.items())))
    with open(os.path.join(partial, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=2)
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument('--demo', action='store_true', help='offline demo corpus: the Python standard library .py files')
    src.add_argument('--local', nargs='+', metavar='FILE', help='local .parquet, .jsonl/.json or .txt files')
    ap.add_argument('--dataset', default='HuggingFaceFW/fineweb-edu', help='Hugging Face dataset (streamed)')
    ap.add_argument('--subset', default='sample-10BT')
    ap.add_argument('--tokenizer', help="'byte', 'gpt2', or a checkpoint's own Hugging Face tokenizer: a tokenizer.json, "
                                        "a checkpoint directory holding one, or a hub repo such as Qwen/Qwen3-0.6B; "
                                        "default: byte for --demo, gpt2 otherwise")
    ap.add_argument('--name', help='output folder data/<name>; default: demo, local or fineweb_edu')
    ap.add_argument('--data_root', default='data')
    ap.add_argument('--max_tokens', type=int,
                    help='stop after this many tokens (val + train); default: 1.4B for FineWeb-Edu, enough for the '
                         "paper's 10,000 steps x 64 x 2048 = 1.31B training tokens; everything for --demo/--local")
    ap.add_argument('--val_tokens', type=int, help='size of the validation split, rounded up to whole documents; '
                                                   'default 10M for FineWeb-Edu, 256K otherwise')
    ap.add_argument('--shard_size', type=int, default=100_000_000, help='tokens per training shard')
    ap.add_argument('--text_column', default='text', help='--local parquet/jsonl: the column holding the text')
    ap.add_argument('--sample_by', default='paragraph', choices=['line', 'paragraph', 'document'],
                    help='--local .txt: what counts as one document (blank-line-separated paragraphs by default)')
    ap.add_argument('--num_proc', type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args(argv)

    remote = not (args.demo or args.local)
    tokenizer = args.tokenizer or ('byte' if args.demo else 'gpt2')
    max_tokens = args.max_tokens if args.max_tokens is not None else (1_400_000_000 if remote else None)
    val_tokens = args.val_tokens if args.val_tokens is not None else (10_000_000 if remote else 256 * 1024)
    name = args.name or ('demo' if args.demo else 'local' if args.local else 'fineweb_edu')
    out_dir = os.path.join(args.data_root, name)
    if name in ('.', '..') or not name or os.sep in name or (os.altsep and os.altsep in name):
        sys.exit(f"prepare_fineweb.py: error: --name={name!r} must be a folder name inside --data_root "
                 f"({args.data_root!r}), without '/'")
    try:
        if args.demo:
            documents = demo_documents()
        elif args.local:
            documents = local_documents(args.local, args.text_column, args.sample_by)
        else:
            documents = fineweb_documents(args.dataset, args.subset)
        meta = prepare(documents, out_dir, name, tokenizer, max_tokens, val_tokens, args.shard_size, args.num_proc)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        sys.exit(f"prepare_fineweb.py: error: {e}")
    print(f"wrote {out_dir}: val {meta['val_tokens']:,} tokens ({meta['val_documents']:,} documents), "
          f"train {meta['train_tokens']:,} tokens ({meta['train_documents']:,} documents), "
          f"{meta['train_duplicates_of_val_dropped']} duplicates of val documents dropped; "
          f"tokenizer {tokenizer} (vocab {meta['vocab_size']:,})")


if __name__ == '__main__':
    main()
