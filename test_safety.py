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

from test_train import REPO, TINY, corpus, losses, train, val_losses  # noqa: F401 (corpus: the fixture)

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
    elif how == 'bytes':    # DCP loads every non-tensor value with torch.load(weights_only=False)
        md = pickle.loads(real)
        payload = pickle.dumps(Exploit(marker))
        (dst / 'extra.bin').write_bytes(payload)
        # a value of the model's that it does not have (the scripts load every one), and the optimizer's
        # learning rate (train.py's resume loads the values its optimizer has)
        md.state_dict_metadata['model.extra'] = BytesStorageMetadata()
        md.planner_data['model.extra'] = ('model', 'extra')
        lr = next(k for k in md.state_dict_metadata if k.startswith('optimizer.param_groups.') and k.endswith('.lr'))
        for key in ('model.extra', lr):
            md.storage_data[MetadataIndex(key)] = _StorageInfo('extra.bin', 0, len(payload))
        meta.write_bytes(pickle.dumps(md))


HOW = ['dotted', 'reduce', 'rank_local', 'bytes']


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
        if how == 'bytes' and name == 'read_state':
            assert read_state(str(ckpt))['iter_num'] == 6   # the metadata itself is sound; its values are not
            continue
        with pytest.raises(ValueError, match=f'checkpoint {tmp_path}/out/(ckpt|step_000006) is refused: ') as e:
            load()
        assert 'holds code' in str(e.value) or "not DCP's Metadata" in str(e.value) or 'could run code' in str(e.value)
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
