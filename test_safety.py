"""Nothing lost, no code run (issue 32): crafted checkpoints that would run code when loaded, the paths by which a
run could delete or block another's checkpoints, and a process killed at every file operation of a save."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from test_train import REPO, TINY, corpus, losses, sha, train, val_losses  # noqa: F401 (corpus: the fixture)

RUN = ['--max_iters=6', '--lr_decay_iters=6', '--eval_interval=3']


@pytest.fixture(scope='module')
def reference(corpus, tmp_path_factory):
    """An uninterrupted run: its out_dir (checkpoints at steps 3 and 6) and its losses."""
    out = tmp_path_factory.mktemp('reference') / 'run'
    _, records = train(corpus, out, *RUN)
    return out, losses(records), val_losses(records)


# -----------------------------------------------------------------------------
# crafted checkpoints: each would run `touch MARKER` when loaded by plain pickle or DCP as it is

class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def dotted_global(marker):
    """A pickle whose global is ('pathlib', 'os.system'): a module the metadata may use, and a dotted name that
    pickle resolves attribute by attribute (protocol 4), reaching os.system."""
    def s(text):
        return pickle.SHORT_BINUNICODE + bytes([len(text)]) + text.encode()
    return (pickle.PROTO + b'\x04' + s('pathlib') + s('os.system') + pickle.STACK_GLOBAL + s(f'touch {marker}')
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def craft(src, dst, how, marker):
    shutil.copytree(src, dst)
    meta = dst / '.metadata'
    real = meta.read_bytes()
    if how == 'dotted':     # the command, then (never reached by pickle.load) the real metadata
        meta.write_bytes(dotted_global(marker) + real)
    elif how == 'reduce':
        meta.write_bytes(pickle.dumps(Exploit(marker)))
    elif how == 'rank_local':   # an unusable global metadata makes DCP read __0.metadata with plain pickle
        meta.write_bytes(pickle.dumps(0))
        (dst / '__0.metadata').write_bytes(pickle.dumps(Exploit(marker)))
    elif how in opcodes(marker):
        payload = opcodes(marker)[how]
        meta.write_bytes(payload + (real[2:] if how == 'build_then_metadata' else b''))
    elif how in ('bytes', 'bytes_build'):    # DCP loads every non-tensor value with torch.load(weights_only=False)
        md = pickle.loads(real)
        payload = pickle.dumps(Exploit(marker)) if how == 'bytes' else opcodes(marker)['build_class']
        (dst / 'extra.bin').write_bytes(payload)
        # a value of the model's that it does not have (the scripts load every one), and the optimizer's
        # learning rate (train.py's resume loads the values its optimizer has)
        md.state_dict_metadata['model.extra'] = BytesStorageMetadata()
        md.planner_data['model.extra'] = ('model', 'extra')
        lr = next(k for k in md.state_dict_metadata if k.startswith('optimizer.param_groups.') and k.endswith('.lr'))
        for key in ('model.extra', lr):
            md.storage_data[MetadataIndex(key)] = _StorageInfo('extra.bin', 0, len(payload))
        meta.write_bytes(pickle.dumps(md))


def s(text):
    return pickle.SHORT_BINUNICODE + bytes([len(text)]) + text.encode()


def opcodes(marker):
    """Pickles that an allow-list of names lets through but that change a class or a shared object (BUILD, SETITEM)
    or build one by an opcode DCP never writes (INST, OBJ, NEWOBJ_EX): each sets the attribute `pwned` to the
    marker's path on its victim (PosixPath or an enum member of DCP's metadata), or `parent` on PosixPath."""
    P = pickle.PROTO + b'\x04'
    posix = s('pathlib') + s('PosixPath') + pickle.STACK_GLOBAL
    enum = (s('torch.distributed.checkpoint.metadata') + s('_MEM_FORMAT_ENCODING') + pickle.STACK_GLOBAL
            + pickle.BININT1 + b'\x00' + pickle.TUPLE1 + pickle.REDUCE)
    state = pickle.EMPTY_DICT + s('pwned') + s(str(marker)) + pickle.SETITEM
    return {
        # BUILD with (None, slot state): setattr on the class itself (export.py then copies from PosixPath.parent)
        'build_class': P + posix + pickle.NONE + pickle.EMPTY_DICT + s('parent') + s(str(marker)) + pickle.SETITEM
                       + pickle.TUPLE2 + pickle.BUILD + pickle.STOP,
        'build_class_dict': P + posix + state + pickle.BUILD + pickle.STOP,
        'build_enum': P + enum + pickle.NONE + state + pickle.TUPLE2 + pickle.BUILD + pickle.STOP,
        'setitem_class': P + posix + s('pwned') + s(str(marker)) + pickle.SETITEM + pickle.STOP,
        'inst': P + pickle.MARK + pickle.INST + b'pathlib\nPosixPath\n' + pickle.STOP,
        'obj': P + pickle.MARK + posix + pickle.OBJ + pickle.STOP,
        'newobj_ex': P + posix + pickle.EMPTY_TUPLE + pickle.EMPTY_DICT + pickle.NEWOBJ_EX + pickle.STOP,
        # the real metadata, after a BUILD that changes a class: the load must stop at the BUILD
        'build_then_metadata': P + posix + pickle.NONE + pickle.EMPTY_DICT + s('pwned') + s(str(marker))
                               + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.POP,
    }


def victims_untouched():
    import pathlib
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    return (isinstance(pathlib.PurePath.__dict__['parent'], property) and 'parent' not in pathlib.PosixPath.__dict__
            and not hasattr(pathlib.PosixPath, 'pwned')
            and not any(hasattr(e, 'pwned') for e in _MEM_FORMAT_ENCODING))


HOW = ['dotted', 'reduce', 'rank_local', 'bytes', 'bytes_build', *opcodes('x')]


@pytest.mark.parametrize('how', HOW)
def test_a_crafted_checkpoint_runs_no_code_in_any_loader(reference, tmp_path, how):
    from checkpoints import load_model
    from model import GPT, GPTConfig
    from runs import read_checkpoint, read_state, resume
    marker = tmp_path / 'pwned'
    ckpt = tmp_path / 'out' / 'step_000006'
    ckpt.parent.mkdir()
    craft(reference[0] / 'ckpt', ckpt, how, marker)
    os.symlink(ckpt.name, tmp_path / 'out' / 'ckpt')
    state = json.loads((ckpt / 'state.json').read_text())
    model = GPT(GPTConfig(**state['model_config']))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    loaders = {  # sample.py, export.py and eval_lm.py (load_model), report.py (read_state), train.py (resume)
        'load_model': lambda: load_model('resume', str(tmp_path / 'out')),
        'read_checkpoint': lambda: read_checkpoint(str(ckpt), optimizer=True),
        'read_state': lambda: read_state(str(ckpt)),
        'resume': lambda: resume(str(ckpt), model, optimizer),  # train.py's, even without read_state before it
    }
    for name, load in loaders.items():
        if how.startswith('bytes') and name == 'read_state':
            assert read_state(str(ckpt))['iter_num'] == 6   # the metadata itself is sound; its values are not
            continue
        with pytest.raises(ValueError, match=f'checkpoint {tmp_path}/out/(ckpt|step_000006) is refused: ') as e:
            load()
        assert 'holds code' in str(e.value) or "not DCP's Metadata" in str(e.value) or 'could run code' in str(e.value)
        assert victims_untouched(), (name, how)
    assert not marker.exists()
    # the scripts, as a user runs them: one line each, no traceback, no command run
    if how in ('dotted', 'bytes'):
        for script in (['sample.py', f'--out_dir={tmp_path}/out'], ['report.py', f'{tmp_path}/out'],
                       ['export.py', f'{ckpt}', f'{tmp_path}/x']):
            if script[0] == 'report.py':
                shutil.copy(reference[0] / 'log.jsonl', tmp_path / 'out')
                if how == 'bytes':
                    continue    # report.py reads state.json only, which is sound
            p = subprocess.run([sys.executable, *script], cwd=REPO, capture_output=True, text=True)
            assert p.returncode == 1 and 'is refused' in p.stderr and 'Traceback' not in p.stderr, p.stderr
        assert not marker.exists()


def test_checkpoints_that_train_py_wrote_load_with_their_optimizer(reference):
    from runs import read_checkpoint
    ckpt = read_checkpoint(str(reference[0] / 'ckpt'), optimizer=True)   # non-tensor values through weights_only
    assert ckpt['iter_num'] == 6 and ckpt['optimizer']['param_groups'][0]['betas'] == (0.9, 0.95)


def test_hostile_state_json_is_refused(reference, tmp_path):
    from runs import read_state
    ckpt = tmp_path / 'step_000006'
    shutil.copytree(reference[0] / 'ckpt', ckpt)
    state = json.loads((ckpt / 'state.json').read_text())
    for field, value in (('iter_num', 1e30), ('iter_num', '6'), ('data_pos', -1), ('best_ckpt', 'x'),
                         ('config', [1])):
        (ckpt / 'state.json').write_text(json.dumps({**state, field: value}))
        with pytest.raises(ValueError, match=f"state.json that train.py did not write: missing or wrong {field}"):
            read_state(str(ckpt))


# -----------------------------------------------------------------------------
# no deletion the user did not ask for

def copy_run(reference, dst):
    shutil.copytree(reference[0], dst, symlinks=True)
    return {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else p.read_bytes()
            for p in dst.iterdir() if not p.is_symlink()}


def test_a_missing_ckpt_link_deletes_nothing_and_resumes_from_the_newest_step(corpus, reference, tmp_path):
    out = tmp_path / 'run'
    files = copy_run(reference, out)
    (out / 'ckpt').unlink()                       # a deleted link, or a copy that lost it
    p, _ = train(corpus, out, *RUN, check=False)     # a new run: refused, nothing deleted
    assert p.returncode == 1 and f"holds the checkpoint {out}/step_000006" in p.stderr
    assert copy_run(reference, tmp_path / 'again') == files and sorted(os.listdir(out)) == [
        '.lock', 'best', 'log.jsonl', 'step_000006']
    os.symlink('step_000099', out / 'ckpt')       # dangling: the same
    p, _ = train(corpus, out, *RUN, check=False)
    assert p.returncode == 1 and (out / 'step_000006' / 'state.json').is_file()
    # a resume continues from the newest step folder, to the losses of the uninterrupted run
    p, records = train(corpus, out, *RUN[1:], '--max_iters=9', '--init_from=resume')
    assert f'resumed from {out}/step_000006 (step 6)' in p.stdout
    _, full = train(corpus, tmp_path / 'full', *RUN[1:], '--max_iters=9')
    assert losses(records) == losses(full) and os.readlink(out / 'ckpt') == 'step_000009'


@pytest.mark.parametrize('bad', ['--n_kv_head=3', '--dataset=missing'])
def test_overwrite_deletes_only_after_every_check(corpus, reference, tmp_path, bad):
    out = tmp_path / 'run'
    copy_run(reference, out)
    before = sorted(os.listdir(out))
    p, _ = train(corpus, out, *RUN, '--overwrite=True', bad, check=False)
    assert p.returncode == 1 and 'Traceback' not in p.stderr
    assert sorted(os.listdir(out)) == before and (out / 'ckpt' / 'state.json').is_file()


def test_a_new_run_with_a_missing_dataset_leaves_no_out_dir(corpus, tmp_path):
    p, _ = train(corpus, tmp_path / 'new', *RUN, '--dataset=missing', check=False)
    assert p.returncode == 1 and 'no dataset at' in p.stderr and not (tmp_path / 'new').exists()


def test_a_finished_run_started_again_says_so(corpus, reference, tmp_path):
    out = tmp_path / 'run'
    copy_run(reference, out)
    p, _ = train(corpus, out, *RUN, '--init_from=resume')
    assert f"{out}/ckpt is at step 6, max_iters=6: nothing left to train" in p.stdout


def test_prepare_fineweb_replaces_only_its_own_datasets(tmp_path):
    runs = tmp_path / 'out'
    (runs / 'x').mkdir(parents=True)
    (runs / 'x' / 'log.jsonl').write_text('mine')
    (tmp_path / 'docs.txt').write_text('some text\n\nmore text\n' * 200)
    base = [sys.executable, 'prepare_fineweb.py', '--local', str(tmp_path / 'docs.txt'), '--tokenizer=byte',
            '--val_tokens=100', '--num_proc=1']
    for args, says in (([f'--data_root={tmp_path}', '--name=out'], 'is not a dataset that prepare_fineweb.py wrote'),
                       ([f'--data_root={runs}', '--name=../out'], 'must be a folder name inside --data_root'),
                       ([f'--data_root={runs}', '--name=..'], 'must be a folder name inside --data_root')):
        p = subprocess.run(base + args, cwd=REPO, capture_output=True, text=True)
        assert p.returncode == 1 and says in p.stderr and 'Traceback' not in p.stderr, p.stderr
        assert (runs / 'x' / 'log.jsonl').read_text() == 'mine'
    # its own dataset it replaces
    for _ in range(2):
        p = subprocess.run(base + [f'--data_root={tmp_path}', '--name=data'], cwd=REPO, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path)) == ['data', 'docs.txt', 'out']


# -----------------------------------------------------------------------------
# a process killed at every file operation of a save, then restarted with --init_from=auto

# One process imports torch and train.py's modules once, then forks a child per run (its imports paid once): the
# reference run, and for each K a run whose process kills itself (SIGKILL: no cleanup) just before the K-th file
# operation of its second save, followed by a restart with --init_from=auto. Prints one JSON line per K.
SWEEP = """
import json, os, runpy, shutil, signal, sys
sys.path.insert(0, os.getcwd())
import torch, checkpoints, data, model, runs  # (imports only: train.py runs in the children)
OPS = [(os, 'mkdir'), (os, 'fsync'), (os, 'rename'), (os, 'replace'), (os, 'symlink'), (os, 'remove'),
       (os, 'unlink'), (shutil, 'rmtree')]
args, out_root = json.loads(sys.argv[1]), sys.argv[2]

def run(out_dir, extra, kill_at=None):
    pid = os.fork()
    if pid == 0:
        ops, saves = [], [0]
        if kill_at is not None:
            for mod, name in OPS:
                real = getattr(mod, name)
                def op(*a, _real=real, _name=name, **k):
                    if saves[0] == 2:
                        ops.append(_name)
                        if len(ops) == kill_at:
                            os.kill(os.getpid(), signal.SIGKILL)
                    return _real(*a, **k)
                setattr(mod, name, op)
            save = runs.save_checkpoint
            def counted(*a, **k):
                saves[0] += 1
                return save(*a, **k)
            runs.save_checkpoint = counted
        sys.argv = ['train.py', *args, f'--out_dir={out_dir}', *extra]
        with open(os.path.join(out_root, os.path.basename(out_dir) + '.out'), 'w') as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                runpy.run_path('train.py', run_name='__main__')
            except SystemExit as e:
                os._exit(e.code if isinstance(e.code, int) else 1)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def losses(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return {r['step']: r.get('loss', r.get('val_loss')) for r in map(json.loads, f) if 'provenance' not in r}

ref = os.path.join(out_root, 'ref')
assert run(ref, []) == 0
for k in range(1, 100):
    out = os.path.join(out_root, f'kill{k}')
    code = run(out, [], kill_at=k)
    if code == 0:   # the save had fewer than k operations: every one has been tried
        break
    listing, linked = sorted(os.listdir(out)), os.readlink(os.path.join(out, 'ckpt'))
    again = run(out, ['--init_from=auto'])
    print(json.dumps(dict(k=k, killed=code, listing=listing, linked=linked, restart=again,
                          equal=again == 0 and losses(out) == losses(ref),
                          ckpt=os.readlink(os.path.join(out, 'ckpt')))), flush=True)
"""


def test_a_kill_at_every_file_operation_of_a_save_continues_exactly(corpus, tmp_path):
    args = [*TINY, '--dataset=tiny', f'--data_root={corpus}', *RUN]
    p = subprocess.run([sys.executable, '-c', SWEEP, json.dumps(args), str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(results) >= 10, results      # DCP's files and fsyncs, state.json, the rename, two links, a deletion
    for r in results:
        assert r['killed'] == -9 and r['restart'] == 0 and r['equal'] and r['ckpt'] == 'step_000006', r
    # among them the kill between the folder's rename and the link swap: a complete step_6 that no link names
    assert any('step_000006' in r['listing'] and r['linked'] == 'step_000003' for r in results)


# -----------------------------------------------------------------------------
# round two (issue 46): links planted in an out_dir, a user's files beside a run, a signal before the first step,
# a full disk during a log append, and checkpoint fields that name files or Hub repositories

def test_a_link_planted_in_an_out_dir_is_never_written_through(corpus, reference, tmp_path):
    victim = tmp_path / 'victim'
    victim.write_text('{"step": 0, "precious": 1}\n')   # (JSON: the test reads logs)
    other = tmp_path / 'other_run_step'     # another run's checkpoint folder
    shutil.copytree(reference[0] / 'ckpt', other)
    other_hash = sha(other)
    # the log is rewritten under a new, unique name: a link at the old fixed name is never touched
    out = tmp_path / 'run'
    copy_run(reference, out)
    os.symlink(victim, out / 'log.jsonl.tmp')
    p, records = train(corpus, out, *RUN[1:], '--max_iters=9', '--init_from=resume')
    _, full = train(corpus, tmp_path / 'full', *RUN[1:], '--max_iters=9')
    assert losses(records) == losses(full) and victim.read_text() == '{"step": 0, "precious": 1}\n'
    # a link where a run writes (its lock, its log, a save's folder, the links it swaps): refused in one line
    for name, target in (('.lock', victim), ('log.jsonl', victim), ('step_000009.tmp', other), ('ckpt.tmp', victim),
                         ('best.tmp', victim), ('best', victim), ('step_000009', other)):
        run = tmp_path / f'run{name}'
        copy_run(reference, run)
        if os.path.lexists(run / name):
            (run / name).unlink()
        os.symlink(target, run / name)
        p, _ = train(corpus, run, *RUN[1:], '--max_iters=9', '--init_from=resume', check=False)
        assert p.returncode == 1 and 'Traceback' not in p.stderr, p.stderr
        assert 'is a symbolic link' in p.stderr or f'holds {name}, which no run of this repository wrote' in p.stderr
        assert victim.read_text() == '{"step": 0, "precious": 1}\n' and sha(other) == other_hash


def test_a_save_never_writes_through_a_link_that_appears_while_the_run_runs(reference, tmp_path):
    """The checks at start cannot see a link planted later: the save itself removes links, never follows them."""
    from model import GPT, GPTConfig
    from runs import save_checkpoint
    other = tmp_path / 'other_run_step'
    shutil.copytree(reference[0] / 'ckpt', other)
    other_hash = sha(other)
    victim = tmp_path / 'victim'
    victim.write_text('precious')
    out = tmp_path / 'run'
    out.mkdir()
    os.symlink(other, out / 'step_000001.tmp')
    os.symlink(victim, out / 'ckpt.tmp')
    state = json.loads((other / 'state.json').read_text())
    model = GPT(GPTConfig(**state['model_config']))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    save_checkpoint(str(out), 1, model, optimizer, state, True, True)
    assert sha(other) == other_hash and victim.read_text() == 'precious'
    assert sorted(os.listdir(out)) == ['best', 'ckpt', 'step_000001'] and (out / 'step_000001' / 'state.json').is_file()


def test_a_new_run_deletes_nothing_it_did_not_write(corpus, reference, tmp_path):
    out = tmp_path / 'mine'
    (out / 'best').mkdir(parents=True)
    (out / 'best' / 'README').write_text('my best results')
    (out / 'step_by_step').mkdir()
    (out / 'step_by_step' / 'notes').write_text('notes')
    (out / 'step_000100').mkdir()       # named like a checkpoint, but not one (neither state.json nor .metadata)
    for extra in ([], ['--overwrite=True'], ['--init_from=auto']):
        p, _ = train(corpus, out, *RUN, *extra, check=False)
        assert p.returncode == 1 and 'Traceback' not in p.stderr
        assert 'holds best, step_000100, which no run of this repository wrote' in p.stderr, p.stderr
    assert (out / 'best' / 'README').read_text() == 'my best results'
    assert (out / 'step_by_step' / 'notes').read_text() == 'notes' and (out / 'step_000100').is_dir()
    # beside files of other names a run starts, and leaves them
    shutil.rmtree(out / 'best')
    (out / 'step_000100').rmdir()
    train(corpus, out, *RUN)
    assert (out / 'step_by_step' / 'notes').read_text() == 'notes'
    # a log without a checkpoint (a run killed before its first save): kept unless asked to replace it
    run = tmp_path / 'killed'
    run.mkdir()
    shutil.copy(reference[0] / 'log.jsonl', run / 'log.jsonl')
    p, _ = train(corpus, run, *RUN, check=False)
    assert p.returncode == 1 and 'holds log.jsonl of an earlier run' in p.stderr
    train(corpus, run, *RUN, '--init_from=auto')   # the same command, restarted: it replaces its own log


SIGNAL_AT_EVAL = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
import data
val = data.ShardLoader.val_batches
def val_batches(self, n):
    os.kill(os.getpid(), signal.SIGTERM)    # during the step-0 evaluation, before any optimizer step
    return val(self, n)
data.ShardLoader.val_batches = val_batches
sys.argv = ['train.py'] + sys.argv[2:]
runpy.run_path('train.py', run_name='__main__')
"""


def test_a_signal_before_the_first_step_saves_nothing_and_restarts_exactly(corpus, reference, tmp_path):
    wrapper = tmp_path / 'signaller.py'
    wrapper.write_text(SIGNAL_AT_EVAL)
    out = tmp_path / 'run'
    p, _ = train(corpus, out, *RUN, wrapper=wrapper, check=False)
    assert p.returncode == 128 + 15 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    assert 'step 0: stopped by SIGTERM before any checkpoint: nothing saved' in p.stdout
    assert not [n for n in os.listdir(out) if n.startswith('step_')] and not os.path.lexists(out / 'ckpt')
    p, records = train(corpus, out, *RUN, '--init_from=auto')
    assert losses(records) == reference[1] and val_losses(records) == reference[2]


def test_a_full_disk_during_a_log_append_leaves_a_readable_log(tmp_path, capsys):
    import errno
    import report
    from runs import append_log, open_log, read_log
    path = open_log(str(tmp_path), None, {'step': 0, 'provenance': {}})
    assert append_log(path, {'step': 1, 'loss': 2.5}) is None
    real = os.write

    def full(fd, data):     # the disk fills half-way through the line
        real(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, 'No space left on device')
    os.write = full
    try:
        problem = append_log(path, {'step': 2, 'loss': 2.4})
    finally:
        os.write = real
    assert 'could not append step 2' in problem and 'No space left on device' in problem
    assert [r['step'] for r in read_log(path)] == [0, 1]    # cut back to its last whole record
    # a log torn by a kill mid-append: the torn line is dropped, with a note, by a resume and by report.py
    with open(path, 'a') as f:
        f.write('{"step": 2, "lo')
    assert [r['step'] for r in read_log(path)] == [0, 1]
    assert 'dropped its last line, cut short' in capsys.readouterr().err
    open_log(str(tmp_path), 1, {'step': 1, 'provenance': {}})
    assert [r['step'] for r in read_log(path)] == [0, 1, 1]
    assert report.read_log is read_log
    # a line in the middle that is not a record: not a train.py log
    (tmp_path / 'log.jsonl').write_text('{"step": 0}\nrm -rf\n{"step": 1}\n')
    with pytest.raises(ValueError, match='is not a train.py log: line 2'):
        read_log(path)


def test_checkpoint_fields_are_what_train_py_writes(reference, tmp_path):
    from runs import read_state
    ckpt = tmp_path / 'step_000006'
    shutil.copytree(reference[0] / 'ckpt', ckpt)
    state = json.loads((ckpt / 'state.json').read_text())
    for field, value in (('model_config', {**state['model_config'], 'extra': 1}),
                         ('model_config', {**state['model_config'], 'residual': 'nope'}),
                         ('model_config', {**state['model_config'], 'rope_theta': 1e999}),
                         ('meta', {**state['meta'], 'tokenizer': 'some-user/some-repo'}),
                         ('meta', {**state['meta'], 'tokenizer': '/etc/passwd'})):
        (ckpt / 'state.json').write_text(json.dumps({**state, field: value}))
        with pytest.raises(ValueError, match=f"state.json that train.py did not write: missing or wrong {field}"):
            read_state(str(ckpt))


def test_eval_lm_refuses_an_out_dir_without_a_checkpoint(tmp_path):
    from eval_lm import transformers_dir
    out = tmp_path / 'run'
    out.mkdir()
    os.symlink('step_000099', out / 'ckpt')     # dangling
    (out / 'config.json').write_text('{"model_type": "delta_attnres_gpt", "auto_map": {}}')
    (out / 'modeling.py').write_text(f"open({str(tmp_path / 'pwned')!r}, 'w')")
    with pytest.raises(FileNotFoundError, match='is a train.py out_dir without a checkpoint'):
        transformers_dir(out, str(tmp_path / 'tmp'))
    assert not (tmp_path / 'pwned').exists()


def test_prepare_fineweb_keeps_a_folder_of_the_users_bin_files(tmp_path):
    data = tmp_path / 'data'
    (data / 'mine').mkdir(parents=True)
    for name in ('day1.bin', 'day2.bin'):
        (data / 'mine' / name).write_bytes(b'my own recording' * 100)
    (tmp_path / 'docs.txt').write_text('some text\n\nmore text\n' * 200)
    p = subprocess.run([sys.executable, 'prepare_fineweb.py', '--local', str(tmp_path / 'docs.txt'), '--tokenizer=byte',
                        '--val_tokens=100', '--num_proc=1', f'--data_root={data}', '--name=mine'],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 1 and 'is not a dataset that prepare_fineweb.py wrote' in p.stderr, p.stderr
    assert sorted(os.listdir(data / 'mine')) == ['day1.bin', 'day2.bin']


@pytest.mark.parametrize('setting,says', [('--seed=-1', 'seed=-1: expected an integer >= 0'),
                                          ('--out_dir=', "out_dir='': expected a folder"),
                                          ('--rms_norm_eps=-1', 'rms_norm_eps must be a positive, finite number'),
                                          ('--rope_theta=1e999', 'rope_theta must be a positive, finite number'),
                                          ('--compile=1', 'compile=1: expected True or False'),
                                          ('--device=gpu', "device='gpu': expected 'cpu', or 'cuda'")])
def test_settings_refused_before_any_work(corpus, tmp_path, setting, says):
    p, _ = train(corpus, tmp_path / 'run', *RUN, setting, check=False)
    assert p.returncode == 1 and says in p.stderr and 'Traceback' not in p.stderr, p.stderr[-2000:]
    assert 'val loss' not in p.stdout and not (tmp_path / 'run').exists()


def test_sample_refuses_a_temperature_that_overflows(reference):
    p = subprocess.run([sys.executable, 'sample.py', f'--out_dir={reference[0]}', '--temperature=1e-320'],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 1 and 'temperature=1e-320: expected 0' in p.stderr and 'Traceback' not in p.stderr
