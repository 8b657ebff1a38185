"""
A training run's files, and what keeps a run safe, beside train.py's main path.

    out_dir/log.jsonl        one JSON record per line: provenance first (which code and machine made the run),
                             then every evaluation and logged step
    out_dir/step_000400/     a checkpoint: torch.distributed.checkpoint (DCP) shards, each written by the rank that
                             holds them (no process ever holds the whole state), DCP's .metadata, and state.json
                             (settings, data position, provenance: plain JSON)
    out_dir/ckpt -> step_000400   the latest checkpoint: what a resume continues
    out_dir/best -> step_000200   the checkpoint of the best validation loss so far
    out_dir/.lock            held (flock) by the run that writes here: one run per out_dir (lock)

A checkpoint is written under step_N.tmp/ and renamed when complete; `ckpt` and `best` are symbolic links swapped
atomically (os.replace). A crash or a full disk mid-save therefore leaves the previous checkpoint as it was, and a
left-over .tmp folder is removed by the next save; a kill at any other instant is continued too (save_checkpoint).
SIGTERM and SIGINT stop a run with a checkpoint of the step they interrupted (Stop). DCP reshards on load: a run saved by 2 processes resumes on 1 or 4.
The same format serves every run (one process, DDP, FSDP2), so sample.py, export.py, report.py and eval_lm.py read
any of them with read_checkpoint (DCP's own loading, into one process, through SafeReader: nothing in a checkpoint
runs code).
"""
import atexit
import dataclasses
import errno
import fcntl
import io
import json
import math
import os
import pathlib
import pickle
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata,
                                                   _MEM_FORMAT_ENCODING)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checks import InvalidValue, Missing, is_count, is_number
from model import GPTConfig

REPO = os.path.dirname(os.path.abspath(__file__))
# DCP warns on every save and load in one process, even when asked for one (no_dist=True): that is what we mean
warnings.filterwarnings('ignore', message='torch.distributed is (disabled, )?unavailable or uninitialized')


def provenance(world_size, device):
    """Which code, libraries and machine made a run: the first record of its log and part of every checkpoint."""
    def git(*args):
        try:
            return subprocess.run(['git', *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None     # not a git checkout (e.g. an exported copy) or no git
    commit = git('rev-parse', 'HEAD')
    # dirty: the tracked files that differ from the commit, results/ aside (the study scripts append their records
    # there while they run; no run reads code from it). An empty list: the code of the commit.
    changed = git('diff', '--name-only', 'HEAD', '--', '.', ':(exclude)results') if commit else None
    return dict(commit=commit, dirty=None if changed is None else changed.split(),
                torch=torch.__version__, cuda=torch.version.cuda,
                device=torch.cuda.get_device_name(device) if device.startswith('cuda') else platform.processor() or 'cpu',
                cpu=cpu_name(), world_size=world_size, host=platform.node(), argv=sys.argv,
                python=platform.python_version())


def cpu_name():
    """The CPU model and the vector instructions torch's kernels use on it (AVX2, AVX512, ...). A run is bitwise
    repeatable on one machine, but another CPU can sum in another order, and thousands of steps turn those last bits
    into differences as large as the spread over seeds (results/README.md): where this differs, runs differ."""
    try:
        with open('/proc/cpuinfo') as f:
            model = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


class Heartbeat:
    """A sign of life during work that prints nothing for minutes (the first evaluation and the first training step
    compile the model: 10-14 minutes at 36 layers on a CPU). While the with-block runs, a line every `every` seconds
    says what it is doing and for how long; when it took longer than that, one more says how long it took. A timer
    thread that only prints: the work runs undisturbed. Nothing happens unless `on` (rank 0 of a compiled run)."""

    def __init__(self, what, on=True, every=60.0):
        self.what, self.on, self.every = what, on, every
        self.done = threading.Event()

    def __enter__(self):
        self.t0 = time.time()
        if self.on:
            self.thread = threading.Thread(target=self._beat, daemon=True)
            self.thread.start()
        return self

    def _beat(self):
        while not self.done.wait(self.every):
            print(f"... {self.what}: {time.time() - self.t0:.0f} s so far", flush=True)

    def __exit__(self, *exc):
        self.done.set()
        if self.on:
            self.thread.join()
            if time.time() - self.t0 >= self.every and exc[0] is None:
                print(f"... {self.what}: done in {time.time() - self.t0:.0f} s", flush=True)
        return False


def busy_cores(threads):
    """On a CPU: one line saying what to do when this process's threads fight other jobs for the cores (the load
    average, which counts this run's own busy threads once it trains, is above the number of cores), else None.
    Threads that wait for a busy core make every step wait for the slowest one: two 2-thread runs on 2 cores
    measured 334-439 tok/s in the quick start, 1,767-3,925 tok/s each with OMP_NUM_THREADS=1."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    if threads <= 1 or load < cores + 0.5:
        return None
    return (f"note: this machine is busy (load average {load:.1f} on {cores} cores) and torch runs {threads} threads: "
            f"they wait for each other's cores. Stop with Ctrl-C (it saves) and continue with OMP_NUM_THREADS=1 "
            f"python train.py ... --init_from=auto, which may be several times faster here")


def init_distributed(backend, timeout):
    """dist.init_process_group under torchrun, so that its restarts (--max-restarts) work. A restarted worker meets
    the others through the same TCP store as the workers it replaces, and gloo would read those dead workers'
    addresses, still stored under the same keys, and fail to connect ('Gloo connectFullMesh failed ... Connection
    refused'; cf. pytorch/pytorch#167288). Each attempt therefore gets keys of its own (a PrefixStore per restart)."""
    rank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    agent_store = os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True'   # torchrun's agent hosts the store
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size,
                          is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=not agent_store)
    attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
    dist.init_process_group(backend, store=dist.PrefixStore(f'attempt_{attempt}', store), rank=rank,
                            world_size=world_size, timeout=timeout)


# -----------------------------------------------------------------------------
# files: a run writes only files it creates itself, never through a link someone planted in its out_dir

def refusal(path, error):
    """The one line for a file this repository could not create or open safely (e.g. O_NOFOLLOW on a link)."""
    if os.path.islink(path):
        return (f"{path} is a symbolic link (to {os.readlink(path)}), which no run of this repository makes there; "
                f"a run writes only its own files: remove the link, or choose another --out_dir")
    return f"could not open {path}: {error}"


def create(path, mode='w'):
    """A new file at path, opened for writing: O_EXCL|O_NOFOLLOW, so never an existing file and never through a link
    (FileExistsError otherwise)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), mode)


def remove(path):
    """Delete one entry that this repository wrote: a link or a file itself (never what a link points to), or a
    folder and what it holds."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


# -----------------------------------------------------------------------------
# one run per out_dir, and a clean stop on a signal

def lock(out_dir):
    """Hold an exclusive lock on out_dir (its file .lock) for the life of this process, or refuse at once, naming
    the run that holds it: two runs in one folder would interleave their logs and break each other's saves (a
    requeued job that starts while its predecessor is still shutting down). The OS releases the lock when the
    process ends, however it ends. An out_dir created here and left empty by a run that fails its checks is removed
    at exit. (On a network file system this relies on its locks: NFSv4 and Lustre have them.)"""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, '.lock')
    try:
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), 'r+')
    except OSError as e:
        raise InvalidValue(refusal(path, e)) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or 'a run that has not said who it is yet'
        f.close()
        raise InvalidValue(f"out_dir={out_dir!r} is in use by another run ({holder}); wait for it to end or stop it, "
                         f"or choose another --out_dir") from None
    f.truncate(0)
    f.seek(0)
    f.write(f"pid {os.getpid()} on {platform.node()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    f.flush()
    def remove_if_unused():
        if os.path.isdir(out_dir) and os.listdir(out_dir) == ['.lock']:
            os.remove(path)
            os.rmdir(out_dir)
    if created:
        atexit.register(remove_if_unused)
    return f    # locked while it is open: until the process ends, or this object is dropped


class Stop:
    """SIGTERM (a scheduler preempting or ending the job; Slurm: --signal=TERM@300) and SIGINT (Ctrl-C) stop a run
    cleanly: the step in progress finishes, every rank writes its part of a checkpoint, and the process exits with
    the signal's conventional code, 128 + its number. A second signal ends the process at once; the last complete
    checkpoint stays as it is (saves are atomic). One arriving within a second of the first is the same event
    delivered twice and counts once: Ctrl-C under torchrun reaches each worker from the terminal and again from
    torchrun, and so does a scheduler's signal sent to every process of a job. Under torchrun all ranks stop at
    the same step, even when only one was signalled: their flags are all-reduced and read on the steps that log,
    where every rank waits for its device anyway. Reading a device tensor on any other step would make the host wait
    for all the work queued before it (a device-to-host copy is stream-ordered), so a signal is acted on at the next
    logged step (log_interval)."""

    def __init__(self, device, verbose):
        self.signum, self.device, self.verbose, self.at = 0, device, verbose, None
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._received)

    def _received(self, signum, frame):
        if self.signum and time.monotonic() - self.at < 1:
            return      # the first one again (see above)
        if self.signum:     # a second signal: stop now, as if there were no handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum, self.at = signum, time.monotonic()
        if self.verbose:
            print(f"received {signal.Signals(signum).name}: stopping after this step with a checkpoint "
                  f"(send it again to stop at once)", flush=True)

    def requested(self, logged):
        """The signal number (0: none) at which every rank stops now, the same on all ranks. logged: this step
        logged (the host has waited for the device); the ranks agree only then."""
        if not dist.is_initialized():
            return self.signum
        if not logged:
            return 0
        flag = torch.full((), self.signum, dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


# -----------------------------------------------------------------------------
# where a run starts


def _steps(out_dir):
    """out_dir's step_N checkpoint folders, oldest first. A save renames its folder into place only after every
    file in it is written, so each is complete."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return [os.path.join(out_dir, n) for n in sorted(names) if re.fullmatch(r'step_\d{6}', n)
            and os.path.isdir(os.path.join(out_dir, n)) and not os.path.islink(os.path.join(out_dir, n))]


def latest(out_dir):
    """The checkpoint a run in out_dir continues, or None: what out_dir/ckpt links to or, where that link is missing
    or dangling (a process killed between the first save's rename and its link, a partial copy), the newest step_N
    folder, which the next save links."""
    path = os.path.join(out_dir, 'ckpt')
    if os.path.isdir(path):
        return path
    steps = _steps(out_dir)
    return steps[-1] if steps else None


STEP = re.compile(r'step_\d{6}')


def contents(out_dir):
    """What a run of this repository wrote into out_dir: ([its checkpoint folders, their links `ckpt` and `best`,
    its log and left-over temporary files], [entries that bear those names but are not its own]). A checkpoint is a
    real step_NNNNNN folder with its state.json or DCP's .metadata; `ckpt` and `best` are links to a step_NNNNNN beside
    them; log.jsonl is a plain file. Anything else, a user's best/ or step_000100/ folder say, is never deleted or
    replaced: a run refuses to start beside it (its saves would have to replace it)."""
    ours, foreign = [], []
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        path = os.path.join(out_dir, name)
        real = not os.path.islink(path)
        if name in ('ckpt', 'best', 'ckpt.tmp', 'best.tmp'):
            mine = not real and STEP.fullmatch(os.readlink(path)) is not None
        elif STEP.fullmatch(name):
            # (one of its two files: a checkpoint, possibly damaged, which read_state names as such)
            mine = real and (os.path.isfile(os.path.join(path, 'state.json')) or os.path.isfile(
                os.path.join(path, '.metadata')))
        elif name == 'log.jsonl' or re.fullmatch(r'log\.jsonl\..+\.tmp', name):    # (the second: a rename cut short)
            mine = real and os.path.isfile(path)
        elif re.fullmatch(r'step_\d{6}\.tmp', name):     # a save cut short
            mine = real and os.path.isdir(path)
        else:
            continue
        (ours if mine else foreign).append(path)
    return ours, foreign


def start_or_resume(init_from, out_dir, overwrite):
    """-> ('resume' or what init_from says, the files that a new run replaces). One out_dir, one run: a new run
    never replaces anything silently, nor anything that this repository did not write. init_from='auto' continues
    the run in out_dir if it has a checkpoint and starts it from scratch otherwise, so that the same command survives
    `torchrun --max-restarts`, a requeue or a preempted machine (where the run that died saved no checkpoint, the
    new start replaces its log)."""
    ours, foreign = contents(out_dir)
    if foreign:
        raise InvalidValue(f"out_dir={out_dir!r} holds {', '.join(os.path.basename(p) for p in foreign)}, which no run "
                           f"of this repository wrote, under a name that its runs write; move it away or choose "
                           f"another --out_dir")
    held = latest(out_dir)
    if init_from == 'auto':
        init_from = 'resume' if held else 'scratch'
        overwrite = overwrite or not held   # no checkpoint: at most the log of the same command, which died early
    if init_from != 'resume' and ours and not overwrite:
        what = f"the checkpoint {held}" if held else ', '.join(os.path.basename(p) for p in ours)
        raise InvalidValue(f"out_dir={out_dir!r} holds {what} of an earlier run; continue it with "
                           f"--init_from=resume (or auto), replace it with --overwrite=True, or choose another --out_dir")
    if init_from == 'resume' and not held:
        raise Missing(f"init_from='resume' but {out_dir} has no checkpoint (out_dir/ckpt); "
                                f"--init_from=auto starts the run when there is none")
    return init_from, [] if init_from == 'resume' else ours


def differences(saved, now, ignore=()):
    """{key: (saved value, value now)} for every key of `saved` (outside `ignore`) whose value differs now."""
    return {k: (v, now.get(k)) for k, v in saved.items() if k not in ignore and now.get(k) != v}


def check_resume(path, state, model_config, meta, data_dir, config, auto):
    """Refuse to continue a checkpoint as something else: another model, other data (the saved data position indexes
    this dataset's windows, and the tokens mean its tokenizer's) or, for init_from='auto', other settings (a requeue
    runs the same command; a different command pointed at this out_dir is a mistake, not a restart)."""
    if diff := differences(state['model_config'], model_config):
        raise InvalidValue(f"the checkpoint's model differs from this config (checkpoint, now): {diff}")
    if diff := differences(state['meta'], meta, ignore=('shards',)):
        raise InvalidValue(f"{path} was trained on another dataset than {data_dir} (checkpoint, now): {diff}; "
                         f"resume with its --data_root/--dataset, or start a new run in another --out_dir")
    if auto and (diff := differences(state['config'], config, ignore=('init_from', 'overwrite', 'eval_only'))):
        raise InvalidValue(f"init_from='auto': {path} was made with other settings (checkpoint, now): {diff}; "
                         f"continue it with these changes with --init_from=resume, or choose another --out_dir")


def read_log(path):
    """A log.jsonl's records. A last line cut short (a full disk or a kill during an append) is dropped, with a note
    on stderr; any other line that is not a JSON record means the file is not a train.py log: refused."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
            lines = f.read().split('\n')
    except OSError as e:
        raise InvalidValue(refusal(path, e)) from None
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            record = ...
        if record is ... and i == len(lines) - 1:   # no newline after it: an append that did not finish
            print(f"note: {path}: dropped its last line, cut short ({len(line)} bytes; a full disk or a kill while "
                  f"it was written)", file=sys.stderr)
        elif record is ... or (record is not None and not (isinstance(record, dict) and is_count(record.get('step')))):
            raise InvalidValue(f"{path} is not a train.py log: line {i + 1} is not a record of one")
        elif record is not None:
            records.append(record)
    return records


def open_log(out_dir, step, first_record):
    """out_dir/log.jsonl for a run that starts (step None: a new log) or resumes at `step` (what the interrupted run
    logged after its checkpoint is dropped: the resumed run logs those steps again); first_record is appended. Written
    under a new, unique name and renamed: a link planted at log.jsonl is replaced, never written through."""
    path = os.path.join(out_dir, 'log.jsonl')
    kept = []
    if step is not None and os.path.lexists(path):
        kept = [r for r in read_log(path) if r['step'] <= step]
    fd, tmp = tempfile.mkstemp(prefix='log.jsonl.', suffix='.tmp', dir=out_dir)     # O_EXCL: a new file
    with os.fdopen(fd, 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in kept + [first_record])
    os.replace(tmp, path)
    return path


def append_log(path, record):
    """Append one record to log.jsonl (never through a link). -> None, or the one-line reason it could not be
    written (a full disk): the log is then cut back to its last whole record, so that it stays readable."""
    line = (json.dumps(record) + '\n').encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    except OSError as e:
        return refusal(path, e)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, line)
            if written < len(line):
                raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes written")
        except OSError as e:
            os.ftruncate(fd, size)
            return f"could not append step {record.get('step')}'s record to {path} ({e.strerror or e}); it is lost"
    finally:
        os.close(fd)
    return None


def clear(found):
    """A new run, after every check: remove the earlier run's files that start_or_resume found (its checkpoints,
    their links, its log), and nothing else."""
    for path in found:
        remove(path)


# -----------------------------------------------------------------------------
# writing checkpoints (every rank), reading them back (train.py's resume: every rank; the other scripts: one process)

class CheckpointWriteError(RuntimeError):
    pass


def _point(out_dir, name, target):
    """Make out_dir/name a link to target (a sibling folder), atomically."""
    tmp = os.path.join(out_dir, name + '.tmp')
    if os.path.lexists(tmp):
        remove(tmp)
    os.symlink(os.path.basename(target), tmp)
    os.replace(tmp, os.path.join(out_dir, name))


def _kept(out_dir):
    return {os.path.realpath(p) for p in (os.path.join(out_dir, 'ckpt'), os.path.join(out_dir, 'best'))
            if os.path.isdir(p)}


def _discard(path):
    """Delete a checkpoint folder by renaming it to *.tmp first (atomic): a process killed while deleting leaves a
    .tmp folder, which the next save removes, never a half-deleted step_N."""
    tmp = path + '.tmp'
    if os.path.lexists(tmp):
        remove(tmp)
    os.rename(path, tmp)
    remove(tmp)


def save_checkpoint(out_dir, step, model, optimizer, state, is_best, master):
    """Every rank calls this. Each writes its own shards of the model and optimizer state into out_dir/step_N.tmp
    (DCP); then rank 0 adds state.json, renames the folder to step_N and points `ckpt` (and `best`) at it.
    Raises CheckpointWriteError on every rank if any rank could not write (e.g. a full disk): the previous
    checkpoint is untouched. A process killed at any instant of it leaves a state that a restart continues: the
    previous checkpoint, which a restart resumes (a complete step_N that no link names yet is replaced when the run
    saves step N again; where there is no link at all, latest() resumes step_N itself)."""
    final = os.path.join(out_dir, f'step_{step:06d}')
    tmp = final + '.tmp'
    distributed = dist.is_initialized()
    def why(e):
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"

    def together(error):   # rank 0's own steps can fail alone: every rank goes on only if all could
        if distributed:
            failed = torch.tensor([error is not None], dtype=torch.float32,
                                  device='cuda' if dist.get_backend() == 'nccl' else 'cpu')
            dist.all_reduce(failed)
            if failed.item() and error is None:
                error = 'another rank could not write its part'
        return error
    error = None
    if master:
        try:
            for name in os.listdir(out_dir):      # left by a crash or a full disk (a link: removed, not followed)
                if re.fullmatch(r'step_\d{6}\.tmp', name):
                    remove(os.path.join(out_dir, name))
            if os.path.lexists(final) and os.path.realpath(final) not in _kept(out_dir):
                _discard(final)     # a step_N that no link named (killed before its link): this run replaces it
            os.mkdir(tmp)   # a new folder of this run's own for DCP to write into (never a planted link)
        except OSError as e:
            error = why(e)
    error = together(error)
    if error is None:
        try:
            msd, osd = get_state_dict(model, optimizer)    # sharded (DTensors) under FSDP2: each rank its own part
            dcp.save({'model': msd, 'optimizer': osd}, checkpoint_id=tmp, no_dist=not distributed)
            if master:
                with create(os.path.join(tmp, 'state.json')) as f:
                    json.dump(state, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, final)
        except (Exception, CheckpointException) as e:   # DCP gathers every rank's write errors, raises them on all
            error = why(e)
        error = together(error)
    if error is not None:
        if master and os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        # the cause, and the room left beside the size of a checkpoint (a full disk can surface as any error)
        free = shutil.disk_usage(out_dir).free / 2**20
        last = latest(out_dir)
        size = sum(f.stat().st_size for f in os.scandir(last)) / 2**20 if last else None
        raise CheckpointWriteError(f"step {step}: could not write the checkpoint into {out_dir} ({error}; "
                                   f"{free:,.1f} MiB free there" + (f", less than the last checkpoint's {size:,.1f} "
                                   f"MiB: the disk is full" if size and free < size else '') + ")")
    if master:
        _point(out_dir, 'ckpt', final)
        if is_best:
            _point(out_dir, 'best', final)
        for path in _steps(out_dir):    # the checkpoints that neither ckpt nor best points at any more
            if os.path.realpath(path) not in _kept(out_dir):
                _discard(path)
    if distributed:
        dist.barrier()
    return final


def resume(path, model, optimizer):
    """train.py's resume, on every rank: DCP reads into the live (possibly sharded) model and optimizer state,
    each rank only the parts it holds, whatever the number of processes that saved it (read_state first)."""
    msd, osd = get_state_dict(model, optimizer)
    sd = {'model': msd, 'optimizer': osd}
    _load(dcp.load, path, sd, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=sd['model'], optim_state_dict=sd['optimizer'])


# -----------------------------------------------------------------------------
# loading safely: nothing in a checkpoint someone hands you may run code
#
# DCP (torch 2.13) has three ways to run code from a checkpoint's files: it unpickles the global .metadata without
# restriction, falls back to a rank-local __<rank>.metadata (also plain pickle) when the global one is unusable, and
# unpickles every non-tensor value (an optimizer's learning rate, say) with torch.load(weights_only=False). SafeReader
# closes all three: the metadata is read by an unpickler that checks every opcode (below) and must yield DCP's
# Metadata, there is no fallback, and non-tensor values are loaded with torch.load(weights_only=True) alone.

# What DCP's .metadata is made of: its dataclasses (NEWOBJ, then BUILD with a dict of their fields, or a tuple for
# TensorProperties, which has a __setstate__), dtypes, and a few values made by calling a constructor (REDUCE).
_BUILT = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (
    Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
    TensorProperties, _StorageInfo)}
_CALLED = (torch.Size, _MEM_FORMAT_ENCODING, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath,
           pathlib.PureWindowsPath, torch.serialization._get_layout)
_GLOBALS = {**{(obj.__module__, obj.__qualname__): obj for obj in (*_BUILT, *_CALLED)}, ('torch', 'Size'): torch.Size}
# opcodes that make only plain values, tuples and references; the rest are refused (INST, OBJ, NEWOBJ_EX, EXT*,
# PERSID, sets, buffers, ...) or checked (those that call or change an object: below)
_PLAIN = {getattr(pickle, name)[0] for name in (
    'PROTO', 'FRAME', 'STOP', 'MARK', 'POP', 'POP_MARK', 'DUP', 'NONE', 'NEWTRUE', 'NEWFALSE', 'INT', 'BININT',
    'BININT1', 'BININT2', 'LONG', 'LONG1', 'LONG4', 'FLOAT', 'BINFLOAT', 'STRING', 'BINSTRING', 'SHORT_BINSTRING',
    'UNICODE', 'BINUNICODE', 'SHORT_BINUNICODE', 'BINUNICODE8', 'BINBYTES', 'SHORT_BINBYTES', 'BINBYTES8',
    'EMPTY_TUPLE', 'TUPLE', 'TUPLE1', 'TUPLE2', 'TUPLE3', 'EMPTY_LIST', 'LIST', 'EMPTY_DICT', 'DICT', 'GET', 'BINGET',
    'LONG_BINGET', 'PUT', 'BINPUT', 'LONG_BINPUT', 'MEMOIZE', 'GLOBAL', 'STACK_GLOBAL')}


class _MetadataUnpickler(pickle._Unpickler):
    """Reads DCP's .metadata and nothing else. Allowing names is not enough: pickle's BUILD sets attributes on any
    object it is handed, a class included (`PosixPath.parent = ...` for the rest of the process), and SETITEM writes
    into any object. So this is the pure-Python unpickler with every opcode checked: names come only from _GLOBALS,
    REDUCE calls only _CALLED, NEWOBJ makes only the dataclasses of _BUILT, BUILD fills only an object that NEWOBJ
    made in this very file and only with its own fields, SETITEM(S) and APPEND(S) fill only dicts and lists, and
    any opcode not named here is refused."""

    def __init__(self, file):
        super().__init__(file)
        self.made = {}      # id -> object, each object NEWOBJ made here (held, so that no other object takes its id)

    def find_class(self, module, name):
        if (module, name) in _GLOBALS:
            return _GLOBALS[module, name]
        if module == 'torch' and '.' not in name and isinstance(getattr(torch, name, None),
                                                                (torch.dtype, torch.memory_format)):
            return getattr(torch, name)     # (values: nothing to call, and BUILD refuses them)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")

    def load_reduce(self):
        func, args = self.stack[-2], self.stack[-1]
        if not any(func is f for f in _CALLED) or type(args) is not tuple:
            raise pickle.UnpicklingError(f"calling {func!r} is not part of a checkpoint's metadata")
        super().load_reduce()

    def load_newobj(self):
        cls, args = self.stack[-2], self.stack[-1]
        if not any(cls is c for c in _BUILT) or args != ():
            raise pickle.UnpicklingError(f"making a {cls!r} is not part of a checkpoint's metadata")
        del self.stack[-2:]
        obj = cls.__new__(cls)
        self.made[id(obj)] = obj
        self.append(obj)

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        if self.made.get(id(inst)) is not inst:
            raise pickle.UnpicklingError(f"changing {inst!r} is not part of a checkpoint's metadata")
        if type(inst) is TensorProperties:  # its own __setstate__ takes a tuple of 5 values
            ok = type(state) is tuple and len(state) == 5
        else:
            ok = type(state) is dict and all(type(k) is str and k in _BUILT[type(inst)] for k in state)
        if not ok:
            raise pickle.UnpicklingError(f"a {type(inst).__name__} with other fields than DCP's")
        super().load_build()

    def _into(self, kind, items):
        target = self.stack[-1]
        if type(target) is not kind:
            raise pickle.UnpicklingError(f"adding items to {target!r} is not part of a checkpoint's metadata")
        if kind is dict:
            target.update(zip(items[::2], items[1::2]))
        else:
            target.extend(items)

    def load_setitem(self):
        value, key = self.stack.pop(), self.stack.pop()
        self._into(dict, [key, value])

    def load_setitems(self):
        self._into(dict, self.pop_mark())

    def load_append(self):
        self._into(list, [self.stack.pop()])

    def load_appends(self):
        self._into(list, self.pop_mark())

    def refuse(self):
        raise pickle.UnpicklingError("an opcode that is not part of a checkpoint's metadata")



# pickle._Unpickler.load runs self.dispatch[opcode](self): the plain opcodes' own handlers, the checked ones above
_MetadataUnpickler.dispatch = {code: pickle._Unpickler.dispatch[code] if code in _PLAIN else _MetadataUnpickler.refuse
                               for code in range(256)}
for _name in ('REDUCE', 'NEWOBJ', 'BUILD', 'SETITEM', 'SETITEMS', 'APPEND', 'APPENDS'):
    _MetadataUnpickler.dispatch[getattr(pickle, _name)[0]] = getattr(_MetadataUnpickler, f'load_{_name.lower()}')

def read_metadata(path):
    """A checkpoint folder's DCP metadata, unpickled safely; a ValueError naming the folder if it is missing,
    corrupt, or anything but DCP's Metadata."""
    meta = os.path.join(path, '.metadata')
    if not os.path.isfile(meta):
        raise InvalidValue(f"{path} is not a complete checkpoint: {meta} is missing (its save did not finish)")
    try:
        with open(meta, 'rb') as f:
            metadata = _MetadataUnpickler(f).load()
    except (Exception, RecursionError) as e:     # whatever a hostile or damaged file makes the unpickler raise
        raise InvalidValue(f"checkpoint {path} is refused: its .metadata is corrupt or holds code "
                           f"({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise InvalidValue(f"checkpoint {path} is refused: its .metadata holds a {type(metadata).__name__}, "
                         f"not DCP's Metadata")
    return metadata


class RefusedCheckpoint(ValueError):
    pass


class SafeReader(FileSystemReader):
    """DCP's file reader for checkpoints written by someone else (see above)."""

    def read_metadata(self):    # no **kwargs: DCP then never asks for a rank-local __<rank>.metadata
        metadata = read_metadata(str(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id     # what FileSystemReader.read_metadata adds
        return metadata

    def read_data(self, plan, planner):
        unsafe = planner.load_bytes      # torch.load(weights_only=False) of each non-tensor value

        def load_bytes(read_item, value):
            try:
                with warnings.catch_warnings():     # (about the pickle protocol of a value DCP wrote itself)
                    warnings.simplefilter('ignore')
                    plain = torch.load(value, weights_only=True)    # plain values only; anything else is refused
            except (pickle.UnpicklingError, RuntimeError, EOFError):
                raise RefusedCheckpoint(f"its value {read_item.dest_index.fqn} holds more than plain values, "
                                        f"which could run code when loaded") from None
            # DCP unpickles the bytes it is handed without restriction: hand it the plain value, pickled here
            again = io.BytesIO()
            torch.save(plain, again)
            again.seek(0)
            unsafe(read_item, again)
        planner.load_bytes = load_bytes
        return super().read_data(plan, planner)


def is_model_config(v):
    """Does state.json's model_config describe a model that model.py builds (its own fields, valid values)?"""
    try:
        GPTConfig(**v)
        return True
    except (TypeError, ValueError):
        return False


def is_tokenizer(name):
    """A tokenizer name as prepare_fineweb.py records it: 'byte', 'gpt2' or a local tokenizer file (*.json, read
    by the tokenizers library as JSON). A checkpoint that names anything else (a Hub repository, which the loaders
    would contact, or another file such as /etc/passwd) is refused."""
    return isinstance(name, str) and (name in ('byte', 'gpt2') or name.endswith('.json'))


def read_state(path):
    """A checkpoint folder's state.json (settings, data position, provenance), after checking its DCP metadata."""
    if not os.path.isdir(path):
        raise Missing(f"no checkpoint {path}")
    read_metadata(path)
    try:
        with open(os.path.join(path, 'state.json')) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidValue(f"checkpoint {path} has no readable state.json ({type(e).__name__}); "
                         f"its save did not finish?") from None
    expected = {'model_config': is_model_config, 'config': lambda v: isinstance(v, dict),
                'meta': lambda v: isinstance(v, dict) and is_tokenizer(v.get('tokenizer', 'byte')), 'iter_num': is_count, 'data_pos': is_count,
                'best_val_loss': lambda v: v is None or is_number(v),
                'best_ckpt': lambda v: v is None or (isinstance(v, list) and len(v) == 2 and is_count(v[0])
                                                     and is_number(v[1]))}
    wrong = [k for k, ok in expected.items() if not isinstance(state, dict) or k not in state or not ok(state[k])]
    if wrong:
        raise InvalidValue(f"checkpoint {path} has a state.json that train.py did not write: missing or wrong "
                         f"{', '.join(wrong)}")
    return state


def read_checkpoint(path, optimizer=False):
    """A train.py checkpoint in one process -> state.json's dict plus 'model' (a full state dict of CPU tensors) and,
    with optimizer=True, 'optimizer' (state keyed by parameter name). `path`: a checkpoint folder (out_dir/ckpt,
    out_dir/best, out_dir/step_N)."""
    state = read_state(path)
    # DCP's loader for one process without a model to load into (what its dcp_to_torch_save conversion uses)
    sd = _load(_load_state_dict_from_keys, path, {'model', 'optimizer'} if optimizer else {'model'})
    return {**state, **sd}


def _load(load, path, *args, **kwargs):
    """load(*args, ...) from the checkpoint folder `path`, through SafeReader."""
    try:
        return load(*args, storage_reader=SafeReader(path), **kwargs)
    except (Exception, CheckpointException) as e:   # (a BaseException) each rank's error: a missing or cut-short shard
        if refused := [f for f, _ in getattr(e, 'failures', {}).values() if isinstance(f, RefusedCheckpoint)]:
            raise InvalidValue(f"checkpoint {path} is refused: {refused[0]}") from None
        raise InvalidValue(f"checkpoint {path} is damaged and could not be read ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[-1][:300]}); resume from another checkpoint "
                         f"(e.g. the best one) or start a new run") from None


# -----------------------------------------------------------------------------
# stopping a run before it can harm its checkpoints

class Guard:
    """The run's safety state, passed explicitly: the best val loss (divergence_factor's reference), which
    checkpoints are on disk, and the first step whose update was skipped on the device for a non-finite loss or
    gradient norm. check() and stop_if_skipped() end every process with one message when the run went wrong."""

    def __init__(self, out_dir, divergence_factor, device, state=None):
        self.out_dir, self.divergence_factor = out_dir, divergence_factor
        state = state or {}
        self.best_val_loss = state.get('best_val_loss')            # the lowest val loss so far
        self.best_ckpt = state.get('best_ckpt')                    # [step, val loss] of out_dir/best
        self.last_ckpt = state.get('iter_num')                     # step of out_dir/ckpt
        # A non-finite loss or gradient norm must never reach the weights, but checking it on the host every step
        # would stall the GPU's queue once per step. The fused AdamW skips its update on the device instead where
        # the tensor `optimizer.found_inf` is 1 (torch.amp.GradScaler's mechanism). The host reads the first
        # skipped step only where it waits for the device anyway (log steps) and before every evaluation and
        # checkpoint. The decision uses the gradient norm, the same on every rank, so the ranks skip together.
        self.first_bad = torch.zeros(3, device=device)   # (step, loss, gradient norm) of the first skip; step 0: none

    def skip_if_nonfinite(self, optimizer, step, loss, grad_norm):
        bad = ~torch.isfinite(grad_norm)
        optimizer.found_inf = bad.float()
        first = bad & (self.first_bad[0] == 0)
        self.first_bad[1:] = torch.where(first, torch.stack((loss.float(), grad_norm.float())), self.first_bad[1:])
        self.first_bad[0] = torch.where(first, step + 1.0, self.first_bad[0])

    def stop_if_skipped(self, step):
        bad_step, loss, norm = self.first_bad.tolist()
        if bad_step:
            self.stop(f"step {int(bad_step)}: non-finite loss ({loss}) or gradient norm ({norm}); stopped at step "
                      f"{step} without updating the weights by any non-finite step. {self.kept(diverged=True)}")

    def check(self, step, loss, what):
        """Stop if `loss` (the same on every rank: all-reduced) is not finite or past divergence_factor x the best
        val loss so far; a val loss that passes becomes the new best."""
        f, best = self.divergence_factor, self.best_val_loss
        if not math.isfinite(loss) or (f and best is not None and loss > f * best):
            self.stop(f"step {step}: {what} {loss:.4g} " + ("is not finite" if not math.isfinite(loss) else
                      f"is over divergence_factor={f} x the best val loss {best:.4f}") + f": the run diverged; "
                      f"stopped. {self.kept(diverged=True)}")
        if what == 'val loss':
            self.best_val_loss = loss if best is None else min(best, loss)

    def is_best(self, val_loss):
        """Would a checkpoint at this val loss become out_dir/best?"""
        return self.best_ckpt is None or val_loss < self.best_ckpt[1]

    def saved(self, step, val_loss, is_best):
        self.last_ckpt = step
        if is_best:
            self.best_ckpt = [step, val_loss]

    def kept(self, diverged=False):
        """The end of every stop message: which checkpoints are on disk, untouched, and how to go on."""
        if self.last_ckpt is None:
            return "No checkpoint was written yet."
        ckpt, best = os.path.join(self.out_dir, 'ckpt'), os.path.join(self.out_dir, 'best')
        return (f"The checkpoints are untouched: {ckpt} (step {self.last_ckpt})"
                + (f" and {best} (step {self.best_ckpt[0]}, val loss {self.best_ckpt[1]:.4f})" if self.best_ckpt else "")
                + "; resume the latest with --init_from=resume" + (" and e.g. a lower learning_rate." if diverged else "."))

    def stop(self, msg):
        """End every process; rank 0 says why (one line, no traceback). The checkpoints on disk are the last good ones."""
        master = not dist.is_initialized() or dist.get_rank() == 0
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(msg if master else 1)
