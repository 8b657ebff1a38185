"""Tests of prepare_fineweb.py and data.py: offline, on small corpora the tests write themselves."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import data
import prepare_fineweb as prep

EOT = 256  # the byte tokenizer's <|endoftext|>


def make_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ['alpha', 'beta', 'gamma', 'delta', 'über', 'naïve', '日本', 'x=1;', '\n']
    return [' '.join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(n)]


def split_docs(tokens):
    """Decode a shard independently of the tokenizer: split at <|endoftext|>, bytes -> utf-8."""
    tokens = np.asarray(tokens)
    assert tokens[0] == EOT
    cuts = np.flatnonzero(tokens == EOT).tolist() + [len(tokens)]
    return [bytes(tokens[a + 1:b].astype(np.uint8)).decode('utf-8') for a, b in zip(cuts, cuts[1:])]


def read_split(out, split):
    return np.concatenate([data.read_shard(p) for p in data.shard_paths(out, split)])


def test_prepare_local_jsonl_roundtrip(tmp_path):
    docs = make_docs(60)
    docs[45] = docs[2]  # a later copy of a validation document: must not reach training
    path = tmp_path / 'corpus.jsonl'
    path.write_text(''.join(json.dumps({'text': d, 'id': i}) + '\n' for i, d in enumerate(docs)))
    prep.main(['--local', str(path), '--tokenizer=byte', '--name=t', f'--data_root={tmp_path}',
               '--val_tokens=1000', '--shard_size=777', '--num_proc=2'])
    out = tmp_path / 't'
    meta = json.loads((out / 'meta.json').read_text())

    # the byte tokenizer is utf-8 bytes; every document gets one <|endoftext|> in front
    sizes = [len(d.encode('utf-8')) + 1 for d in docs]
    n_val_docs = int(np.searchsorted(np.cumsum(sizes), 1000)) + 1  # whole documents until >= 1000 tokens
    val_docs, train_docs = docs[:n_val_docs], [d for i, d in enumerate(docs[n_val_docs:], n_val_docs) if i != 45]
    assert meta['val_tokens'] == sum(sizes[:n_val_docs]) >= 1000
    assert meta['train_tokens'] == sum(sizes[n_val_docs:]) - sizes[45]
    assert meta['train_duplicates_of_val_dropped'] == 1
    assert (meta['tokenizer'], meta['vocab_size'], meta['eot_token']) == ('byte', 257, EOT)

    # llm.c header: magic, version, token count; fixed-size training shards (the last one partial)
    paths = data.shard_paths(out, 'train')
    assert [os.path.basename(p) for p in data.shard_paths(out, 'val')] == ['t_val_000000.bin']
    for p in paths:
        header = np.fromfile(p, dtype=np.int32, count=256)
        assert (header[0], header[1]) == (20240520, 1)
        assert os.path.getsize(p) == 1024 + 2 * header[2]
    lengths = [len(data.read_shard(p)) for p in paths]
    assert lengths[:-1] == [777] * (len(paths) - 1) and 0 < lengths[-1] <= 777
    assert sum(lengths) == meta['train_tokens']

    # the split is by whole documents, in order, and validation text never appears in training
    assert split_docs(read_split(out, 'val')) == val_docs
    assert split_docs(read_split(out, 'train')) == train_docs
    assert not set(val_docs) & set(train_docs)


def test_prepare_txt_max_tokens_and_demo(tmp_path):
    docs = make_docs(40, seed=1)
    (tmp_path / 'a.txt').write_text('\n\n'.join(docs[:20]))
    (tmp_path / 'b.txt').write_text('\n\n'.join(docs[20:]))
    meta = prep.prepare(prep.local_documents([tmp_path / 'a.txt', tmp_path / 'b.txt'], 'text', 'paragraph'),
                        str(tmp_path / 'txt'), 'txt', 'byte', max_tokens=1500, val_tokens=300, shard_size=10_000, num_proc=1)
    train = read_split(tmp_path / 'txt', 'train')
    val = read_split(tmp_path / 'txt', 'val')
    assert len(val) + len(train) == meta['val_tokens'] + meta['train_tokens'] == 1500  # cut exactly at the budget
    # paragraphs are the documents; the last training document is truncated to fit the budget
    got = split_docs(val) + split_docs(train)
    assert got[:-1] == docs[:len(got) - 1] and docs[len(got) - 1].startswith(got[-1])

    # the offline demo corpus: the standard library's .py files, a budget read in streaming fashion
    meta = prep.prepare(prep.demo_documents(), str(tmp_path / 'demo'), 'demo', 'byte',
                        max_tokens=30_000, val_tokens=5_000, shard_size=100_000, num_proc=1)
    assert meta['train_tokens'] + meta['val_tokens'] == 30_000
    text = ''.join(split_docs(read_split(tmp_path / 'demo', 'val')))
    assert 'def ' in text or 'import ' in text


def test_early_stop_does_not_hang_on_a_pool_still_sending(tmp_path):
    """Stopping at --max_tokens while the pool's task thread is still sending a chunk of large documents.
    CPython's Pool.terminate() can deadlock then: its _help_stuff_finish takes the queue's read lock and returns
    if the pipe looks empty for an instant, and the task thread's next send blocks forever (seen in the suite
    under load). Here that unlucky instant is forced, in a subprocess with a timeout: prepare() must finish."""
    code = f"""if True:
        import multiprocessing.pool, prepare_fineweb as prep
        def unlucky(inqueue, task_handler, size):
            inqueue._rlock.acquire()   # as when the drain finds the pipe empty at the instant it looks
        multiprocessing.pool.Pool._help_stuff_finish = staticmethod(unlucky)
        docs = ('x = %d\\n' % i + 'abcdefgh ' * 20_000 for i in range(600))   # 180 KB each
        meta = prep.prepare(docs, {str(tmp_path / 'o')!r}, 'o', 'byte', max_tokens=500_000, val_tokens=200_000,
                            shard_size=1 << 20, num_proc=2)
        print('train', meta['train_tokens'])"""
    r = subprocess.run([sys.executable, '-c', code], cwd=os.path.dirname(os.path.abspath(__file__)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ['train', str(500_000 - json.loads((tmp_path / 'o' / 'meta.json').read_text())['val_tokens'])]


def test_gpt2_unavailable_offline_names_the_offline_options(tmp_path, monkeypatch):
    import tiktoken.load
    import tiktoken.registry

    def no_network(url):
        raise ConnectionError(f"no network to fetch {url}")
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', str(tmp_path / 'empty_cache'))
    monkeypatch.setattr(tiktoken.load, 'read_file', no_network)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, 'gpt2', raising=False)
    with pytest.raises(RuntimeError, match='GPT-2') as e:
        prep.get_tokenizer('gpt2')
    assert '--demo' in str(e.value) and '--local' in str(e.value) and 'no network' in str(e.value)
    (tmp_path / 'c.jsonl').write_text('{"text": "hello"}\n')
    with pytest.raises(SystemExit, match='--demo'):  # the command line says it too, without a traceback
        prep.main(['--local', str(tmp_path / 'c.jsonl'), f'--data_root={tmp_path}'])
    assert not (tmp_path / 'local').exists()


def test_fineweb_unreachable_names_the_offline_options(tmp_path, monkeypatch):
    import datasets

    def no_network(*args, **kwargs):
        raise ConnectionError('no network')
    monkeypatch.setattr(datasets, 'load_dataset', no_network)
    with pytest.raises(SystemExit, match='could not stream HuggingFaceFW/fineweb-edu.*--demo.*--local'):
        prep.main(['--tokenizer=byte', f'--data_root={tmp_path}', '--num_proc=1'])
    assert list(tmp_path.iterdir()) == []  # no half-written dataset left behind


def test_bad_inputs_give_clear_errors(tmp_path):
    (tmp_path / 'c.jsonl').write_text('{"body": "hello"}\n')
    with pytest.raises(ValueError, match="no 'text' column"):
        list(prep.local_documents([tmp_path / 'c.jsonl'], 'text', 'paragraph'))
    with pytest.raises(FileNotFoundError, match='does not exist'):
        list(prep.local_documents([tmp_path / 'nope.jsonl'], 'text', 'paragraph'))
    with pytest.raises(ValueError, match='all taken by the validation split'):
        prep.prepare(iter(['tiny doc']), str(tmp_path / 'x'), 'x', 'byte', None, 1000, 100, 1)

    good = tmp_path / 'good.bin'
    data.write_shard(str(good), np.arange(100))
    assert data.read_shard(str(good)).tolist() == list(range(100))
    raw = good.read_bytes()
    (tmp_path / 'short.bin').write_bytes(raw[:-10])
    with pytest.raises(ValueError, match='truncated'):
        data.read_shard(str(tmp_path / 'short.bin'))
    (tmp_path / 'magic.bin').write_bytes(b'\x00' * 4 + raw[4:])
    with pytest.raises(ValueError, match='bad magic'):
        data.read_shard(str(tmp_path / 'magic.bin'))
    (tmp_path / 'tiny.bin').write_bytes(raw[:100])
    with pytest.raises(ValueError, match='header'):
        data.read_shard(str(tmp_path / 'tiny.bin'))
    with pytest.raises(FileNotFoundError, match='prepare_fineweb.py --demo'):
        data.load_meta(str(tmp_path / 'no_such_dataset'))
    with pytest.raises(FileNotFoundError, match='no train shards'):
        data.shard_paths(str(tmp_path), 'train')


def loader_dir(tmp_path, sizes=(1000, 333, 700)):
    """Shards whose token at position i of shard s is s*10000 + i % 10000: a window's origin is readable."""
    for s, n in enumerate(sizes):
        data.write_shard(str(tmp_path / f'd_train_{s + 1:06d}.bin'), (s * 10000 + np.arange(n)) % 65536)
    data.write_shard(str(tmp_path / 'd_val_000000.bin'), np.arange(500))
    return str(tmp_path)


def test_loader_windows_epochs_resume_and_ranks(tmp_path):
    d = loader_dir(tmp_path)
    T, B = 10, 3
    n_windows = sum((n - 1) // T for n in (1000, 333, 700))
    loader = data.ShardLoader(d, 'train', B, T, grad_accum=2, seed=7)
    assert loader.n_windows == n_windows
    steps = [loader.train_batches() for _ in range(n_windows // (2 * B))]  # one epoch
    starts = []
    for batches in steps:
        for x, y in batches:
            assert x.shape == y.shape == (B, T) and x.dtype == np.int64
            assert (x[:, 1:] == y[:, :-1]).all()
            assert (np.diff(np.concatenate([x, y[:, -1:]], axis=1)) == 1).all()  # contiguous, within one shard
            assert (x[:, 0] % 10000 % T == 0).all()  # windows are aligned to the grid of T
            starts += x[:, 0].tolist()
    assert len(set(starts)) == len(starts) == (n_windows // (2 * B)) * 2 * B  # no window twice in an epoch

    # resume: a fresh loader with the saved position serves the same batches as the original
    again = data.ShardLoader(d, 'train', B, T, grad_accum=2, seed=7)
    again.pos = 2 * B * 5  # what a checkpoint after 5 steps stores
    for batches in steps[5:8]:
        for (x, y), (x2, y2) in zip(batches, again.train_batches()):
            assert (x == x2).all() and (y == y2).all()
    other_seed = data.ShardLoader(d, 'train', B, T, grad_accum=2, seed=8).train_batches()
    assert not all((a[0] == b[0]).all() for a, b in zip(other_seed, steps[0]))

    # 2 ranks x 1 micro-batch read different sequences, together the same as 1 process x 2 micro-batches
    ranks = [data.ShardLoader(d, 'train', B, T, rank=r, world_size=2, grad_accum=1, seed=7) for r in range(2)]
    for batches in steps[:3]:
        (x0, _), = ranks[0].train_batches()
        (x1, _), = ranks[1].train_batches()
        assert (x0 == batches[0][0]).all() and (x1 == batches[1][0]).all()

    # validation: spread evenly over the split, the same batches on 1 or 2 processes, split between the ranks
    N = 499 // T                                    # 49 windows of T + 1 tokens
    one = data.ShardLoader(d, 'val', B, T).val_batches(100)
    assert len(one) == N // B == 16                 # capped at the split: 16 batches of 3, all windows but one
    four = data.ShardLoader(d, 'val', B, T).val_batches(4)
    starts = [int(x[r, 0]) // T for x, _ in four for r in range(B)]
    assert starts == [(2 * j + 1) * N // 24 for j in range(12)]     # centred in 12 equal stretches of the split
    assert starts[0] == 2 and starts[-1] == 46 and len(set(starts)) == 12
    two = [data.ShardLoader(d, 'val', B, T, rank=r, world_size=2).val_batches(4) for r in range(2)]
    assert len(two[0]) == len(two[1]) == 2
    for k, (x, y) in enumerate(four):
        x2, y2 = two[k % 2][k // 2]
        assert (x == x2).all() and (y == y2).all()
    assert len(data.ShardLoader(d, 'val', B, T, world_size=2).val_batches(5)) == 2  # 5 -> 4 batches, 2 per rank

    # the whole split: every window exactly once, the last global batch filled up with rows without targets
    for world in (1, 2, 3):
        parts = [data.ShardLoader(d, 'val', B, T, rank=r, world_size=world).val_batches(None) for r in range(world)]
        assert len({len(p) for p in parts}) == 1            # every rank runs as many forward passes
        rows = [(x[i], y[i]) for p in parts for x, y in p for i in range(B)]
        real = sorted(int(x[0]) // T for x, y in rows if (y >= 0).all())
        assert real == list(range(N))
        assert all((y == -1).all() for x, y in rows if not (y >= 0).all())
        assert sum((y >= 0).sum() for x, y in rows) == N * T


def test_validation_windows_reach_every_document(tmp_path):
    """The demo's val split (its 11 documents' lengths): the 32,768 tokens that the CPU study evaluates, which
    in file order were two documents, now touch all 11."""
    lengths = [7084, 38388, 23392, 31163, 3261, 50386, 22384, 43117, 13724, 5908, 27390]
    bounds = np.cumsum([0] + lengths)
    d = str(tmp_path)
    data.write_shard(os.path.join(d, 'x_val_000000.bin'), np.arange(bounds[-1]), dtype=np.uint32)  # token = position
    def documents(starts):
        return {i for i in range(11) for s in starts if s < bounds[i + 1] and s + 256 >= bounds[i]}
    loader = data.ShardLoader(d, 'val', 4, 256)
    assert documents([x[r, 0] for x, _ in loader.val_batches(32) for r in range(4)]) == set(range(11))
    assert documents(np.arange(128) * 256) == {0, 1}     # the first 128 windows in file order


def test_loader_rejects_batches_that_do_not_fit(tmp_path):
    d = loader_dir(tmp_path)
    with pytest.raises(ValueError, match='sequences of 2048\\+1 tokens, but one step needs'):
        data.ShardLoader(d, 'train', 4, 2048)
    with pytest.raises(ValueError, match='val split'):
        data.ShardLoader(d, 'val', 40, 10, world_size=2)


def test_loader_checks_the_shards_against_meta(tmp_path):
    prep.prepare(make_docs(80), str(tmp_path / 'd'), 'd', 'byte', None, val_tokens=500, shard_size=1000, num_proc=1)
    d = tmp_path / 'd'
    meta = data.load_meta(str(d))
    assert meta['shards'] == {os.path.basename(p): len(data.read_shard(p)) for p in sorted(d.glob('*.bin'))}
    assert data.ShardLoader(str(d), 'train', 2, 8, meta=meta).n_windows > 0

    # a token id the dataset's tokenizer does not have (here between its 257 tokens and a padded 320)
    shard = str(d / 'd_train_000002.bin')
    tokens = np.array(data.read_shard(shard))
    tokens[7] = 300
    data.write_shard(shard, tokens)
    with pytest.raises(ValueError, match=f"data shard {shard} holds token id 300, outside the dataset's vocabulary of 257"):
        data.ShardLoader(str(d), 'train', 2, 8, meta=meta)
    tokens[7] = 5
    data.write_shard(shard, tokens)
    # a dataset with a shard missing, e.g. half deleted; also with an older meta.json that lists no shards
    os.rename(shard, str(tmp_path / 'away.bin'))
    with pytest.raises(ValueError, match=r"missing \['d_train_000002.bin'\], not listed \[\].*interrupted"):
        data.ShardLoader(str(d), 'train', 2, 8, meta=meta)
    old_meta = {k: v for k, v in meta.items() if k != 'shards'}
    with pytest.raises(ValueError, match=f"hold {meta['train_tokens'] - len(tokens):,} tokens but .*meta.json says"):
        data.ShardLoader(str(d), 'train', 2, 8, meta=old_meta)
    # ... or one too many (another dataset's shard in the folder)
    os.rename(str(tmp_path / 'away.bin'), shard)
    data.write_shard(str(d / 'd_train_000099.bin'), tokens)
    with pytest.raises(ValueError, match=r"missing \[\], not listed \['d_train_000099.bin'\]"):
        data.ShardLoader(str(d), 'train', 2, 8, meta=meta)

    # a corrupt or foreign meta.json names itself
    (d / 'meta.json').write_text('{"name": "d", ')
    with pytest.raises(ValueError, match=f"{d}/meta.json is corrupt \\(Expecting"):
        data.load_meta(str(d))
    (d / 'meta.json').write_text('[1, 2]')
    with pytest.raises(ValueError, match=f"{d}/meta.json is not a prepare_fineweb.py meta.json"):
        data.load_meta(str(d))


def test_replacing_a_dataset_is_crash_safe(tmp_path, monkeypatch):
    """Killed anywhere while a dataset is replaced, data/<name> is the old or the new one complete, or absent."""
    out = str(tmp_path / 'd')
    old = prep.prepare(make_docs(40, seed=1), out, 'd', 'byte', None, 300, 1000, 1)
    docs = make_docs(60, seed=2)

    def complete(meta):
        assert data.load_meta(out) == meta
        for split in ('train', 'val'):
            data.ShardLoader(out, split, 1, 8, meta=meta)

    real_replace, real_rmtree = os.replace, prep.shutil.rmtree

    def killed_at_swap(src, dst):
        if dst == out:
            raise KeyboardInterrupt
        real_replace(src, dst)
    monkeypatch.setattr(os, 'replace', killed_at_swap)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(docs, out, 'd', 'byte', None, 300, 1000, 1)
    with pytest.raises(FileNotFoundError, match='no dataset at'):   # absent: train.py says so
        data.load_meta(out)
    monkeypatch.setattr(os, 'replace', real_replace)
    complete_old = prep.prepare(make_docs(40, seed=1), out, 'd', 'byte', None, 300, 1000, 1)
    assert complete_old == old and not os.path.exists(out + '.old') and not os.path.exists(out + '.partial')

    def killed_deleting_the_old_one(path, **kwargs):
        if path.endswith('.old') and os.path.exists(path):
            os.remove(os.path.join(path, 'meta.json'))
            raise KeyboardInterrupt
        real_rmtree(path, **kwargs)
    monkeypatch.setattr(prep.shutil, 'rmtree', killed_deleting_the_old_one)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(docs, out, 'd', 'byte', None, 300, 1000, 1)
    complete(json.loads((tmp_path / 'd' / 'meta.json').read_text()))   # the new dataset, whole
    assert data.load_meta(out)['train_documents'] > old['train_documents']


def test_local_files_that_cannot_be_read_are_named(tmp_path):
    (tmp_path / 'dir').mkdir()
    (tmp_path / 'empty.jsonl').write_text('')
    (tmp_path / 'latin1.jsonl').write_bytes(b'{"text": "caf\xe9"}\n')
    (tmp_path / 'broken.jsonl').write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / 'latin1.txt').write_bytes(b'caf\xe9\n')
    expected = {'dir': f"--local {tmp_path}/dir is a directory; pass the files in it (e.g. {tmp_path}/dir/*.jsonl)",
                'empty.jsonl': f"--local file {tmp_path}/empty.jsonl is empty",
                'latin1.jsonl': f"--local file {tmp_path}/latin1.jsonl is not readable as json (UnicodeDecodeError: ",
                'broken.jsonl': f"--local file {tmp_path}/broken.jsonl is not readable as json (ArrowInvalid: ",
                'latin1.txt': f"--local file {tmp_path}/latin1.txt is not readable as text (UnicodeDecodeError: "}
    for name, message in expected.items():
        with pytest.raises(SystemExit) as e:
            prep.main(['--local', str(tmp_path / name), '--tokenizer=byte', f'--data_root={tmp_path}', '--num_proc=1'])
        assert str(e.value).startswith(f"prepare_fineweb.py: error: {message}"), str(e.value)
    assert not (tmp_path / 'local').exists()
