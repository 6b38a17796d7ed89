"""One job per save directory: rank 0 holds ``<save>/.mcx_job.lock`` for the Checkpointer's life.

Two jobs saving into one directory replace each other's checkpoints and remove each other's
unfinished ones, with no error. So the first save into a root (or ``Checkpointer(save_dir=...)``)
takes the root's lock file: a POSIX (``fcntl``) lock on an open file that records its holder
(host, pid, start time, world size, command). A second job fails on every rank before it writes
anything, naming the holder. The kernel drops the lock when its holder dies, however it dies, so
the lock of a killed job is taken over, with one warning, and the unfinished saves it left are
removed (``layout.remove_torn_saves``); a clean ``close()`` removes the file.
A POSIX lock (unlike ``flock``) is not inherited by the processes the trainer forks (writers,
data-loader workers), so none of them can keep a dead job's lock.

Limits: the lock is seen from every node on local file systems, NFS (its lock manager) and
Lustre mounted with ``flock``; on Lustre mounted with ``localflock`` (or another file system that
keeps locks per node) a holder on another node is not seen. There the recorded host is what is
left: taking over a lock recorded by another host says so in its warning. Where the file system
refuses locks altogether, only a holder on this host (a live recorded pid) is detected.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .._runtime import pid_alive, rank, world_size
from ..errors import SaveDirectoryInUse
from .layout import INCOMPLETE, remove_torn_saves

__all__ = ["LOCK", "JobLock"]

logger = logging.getLogger(__name__)

LOCK = ".mcx_job.lock"

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class _Held:
    """One lock file this process holds, shared by its Checkpointers (``count``)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path, self.count = fd, path, 1


_HELD: dict[str, _Held] = {}  # real path of the root -> the lock this process holds on it
_MUTEX = threading.Lock()


class JobLock:
    """The save roots one Checkpointer holds (``group``: its collectives)."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._roots: list[str] = []

    def hold(self, root: str | os.PathLike[str]) -> None:
        """Collective, the first time a root is seen: rank 0 takes ``root``'s lock; every rank
        raises :class:`SaveDirectoryInUse` when another job holds it."""
        key = os.path.realpath(root)
        if key in self._roots:
            return
        error = None
        if rank() == 0:
            # before the process group is up (the launcher's early Checkpointer) the job's size
            # is the launcher's WORLD_SIZE, not the uninitialized group's 1
            world = self._group.size() if self._group.initialized() else world_size()
            error = _acquire(Path(root), key, world=world)
        elif not self._group.initialized():  # rank 0's verdict cannot reach this rank yet
            error = _held_by_another_job(Path(root))
        verdict = next((e for e in self._group.all_gather(error) if e), None)
        if verdict is not None:  # rank 0 decided: every rank raises the same
            raise SaveDirectoryInUse(verdict)
        self._roots.append(key)

    def release(self) -> None:
        """At close: let go of every root this Checkpointer holds (rank 0)."""
        roots, self._roots = self._roots, []
        if rank() == 0:
            for key in roots:
                _release(key)


def _acquire(root: Path, key: str, *, world: int) -> str | None:
    """Rank 0: take ``root``'s lock; the error message when another job holds it, else None."""
    with _MUTEX:
        if key in _HELD:  # another Checkpointer of this process: the same job
            _HELD[key].count += 1
            return None
        path = root / LOCK
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, previous, locked = _lock(path)
        except _InUse as e:
            return _in_use_message(root, path, e.holder)
        except OSError as e:  # an unwritable root: the save's own checks name it
            logger.debug("no job lock in %s: %s", root, e)
            return None
        if previous:  # a job killed or crashed: no process of ours writes here now (the lock;
            # where its host was another, locks may be node-local: only saves it cannot finish)
            here = previous.get("host") == socket.gethostname()
            _warn_stale(path, previous,
                        remove_torn_saves(root, all_of_them=here) if locked else None)
        _write(fd, world)
        _HELD[key] = _Held(fd, path)
        return None


class _InUse(Exception):
    def __init__(self, holder: dict) -> None:
        super().__init__(holder)
        self.holder = holder


def _lock(path: Path) -> tuple[int, dict, bool]:
    """Open and lock ``path``: (its fd, the record it held: a dead holder's, or {}, whether the
    file system took the lock)."""
    for _ in range(5):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):  # held by another process
                holder = _read(fd)
                os.close(fd)
                raise _InUse(holder) from None
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            return (*_without_locks(fd, path), False)
        try:  # the holder may have removed the file between our open and our lock
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, _read(fd), True
        os.close(fd)
    raise OSError(errno.EAGAIN, f"{path} kept being replaced")


def _without_locks(fd: int, path: Path) -> tuple[int, dict]:
    """A file system without locks: only a live holder on this host is detected."""
    holder = _read(fd)
    if (holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
            and holder["pid"] != os.getpid() and pid_alive(holder["pid"])):
        os.close(fd)
        raise _InUse(holder)
    logger.warning("%s: this file system refuses file locks, so a job on another node saving "
                   "into this directory cannot be detected.", path)
    return fd, holder


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return holder if isinstance(holder, dict) else {"unreadable": True}


def _job() -> str | None:
    """The launcher's name for this job, shared by its ranks: torchrun's run id, else SLURM's
    job, step and restart count (a requeued job keeps its id); None when neither is set. Two
    jobs the launcher names alike are taken for one (never a false refusal)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return f"torchrun:{run}"
    slurm = os.environ.get("SLURM_JOB_ID")
    if not slurm:
        return None
    return ".".join(("slurm:" + slurm, os.environ.get("SLURM_STEP_ID", ""),
                     os.environ.get("SLURM_RESTART_COUNT", "0")))


def _held_by_another_job(root: Path) -> str | None:
    """A rank other than 0 before the process group is up (Megatron-LM builds its persistent
    worker, our early Checkpointer, before it): rank 0 takes the lock, but its verdict cannot
    be shared yet, so a job started while another still runs would fail on rank 0 alone and
    leave this rank waiting in ``init_process_group`` for its timeout where no launcher tears
    the job down. The error message when the lock names a live process on this host of another
    job (both named by the launcher, :func:`_job`), else None."""
    ours, path = _job(), root / LOCK
    if ours is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        holder = _read(fd)
    finally:
        os.close(fd)
    if (holder.get("job") and holder["job"] != ours and holder.get("host") == socket.gethostname()
            and isinstance(holder.get("pid"), int) and pid_alive(holder["pid"])):
        return _in_use_message(root, path, holder)
    return None


def _write(fd: int, world: int) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "world_size": world,
              "job": _job(), "command": " ".join(sys.argv)[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _describe(holder: dict) -> str:
    if not holder or holder.get("unreadable"):
        return "a job that has not recorded itself yet"
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, started "
            f"{holder.get('started')}, {holder.get('world_size')} rank(s), command "
            f"'{holder.get('command', '')}'")


def _in_use_message(root: Path, path: Path, holder: dict) -> str:
    gone = ""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
            and not pid_alive(holder["pid"]):
        gone = (f" (pid {holder['pid']} is not running: another job has just taken the lock "
                f"over, see 'fuser -v {path}')")
    return (f"--save {root} is in use by another job: {_describe(holder)} holds {path}{gone}. "
            "Two jobs saving into one directory replace each other's checkpoints. Nothing was "
            "written. Fix: give this job its own --save directory, or stop that job first.")


def _warn_stale(path: Path, previous: dict, torn: list[str] | None) -> None:
    """``torn``: its unfinished saves, being removed (None: left, where locks are not taken)."""
    other_host = previous.get("host") not in (None, socket.gethostname())
    logger.warning(
        "%s: taking over the lock of a job that ended without closing its checkpointer (%s): "
        "it was killed or crashed; %s.%s", path, _describe(previous),
        f"its unfinished saves (iter_*{INCOMPLETE}) are ignored" if torn is None else
        f"its unfinished saves {torn} are removed (in the background)" if torn else
        "it left no unfinished save",
        f" It ran on {previous.get('host')}: where this file system's locks are node-local "
        "(Lustre mounted with localflock), a job still running there is not seen; make sure it "
        "has stopped." if other_host else "")


def _release(key: str) -> None:
    """Drop one hold of ``key``; the last removes the file, then unlocks."""
    with _MUTEX:
        held = _HELD.get(key)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[key]
        with contextlib.suppress(OSError):
            if os.stat(held.path).st_ino == os.fstat(held.fd).st_ino:
                os.unlink(held.path)
        with contextlib.suppress(OSError):
            fcntl.lockf(held.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(held.fd)
