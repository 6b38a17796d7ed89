"""A write-results queue with no server process behind it.

megatron-core's and nvrx's writers hand each save's write results back to the trainer through a
module-global queue (``filesystem_async._results_queue``) that must pickle into the writer
process, so they make it a ``multiprocessing.Manager().Queue()``: a proxy to a server process,
one more fork of the trainer holding its pages alive copy-on-write (figures:
docs/notes/benchmarks.md, "How we got here").

:class:`SpoolQueue` does the same job with files: ``put`` writes one pickle into a private
directory (``/dev/shm`` where there is one) and renames it into place, ``get_nowait`` takes the
oldest. It pickles as its directory name, so it reaches forked, spawned and persistent writers
alike, and a ``put`` is complete when it returns (the writer signals "done" only after it): the
trainer's ``get_nowait`` after that always finds it. Only the methods the writers use exist
(``put``, ``get``, ``get_nowait``, ``empty``, ``qsize``). The process that created it removes the
directory on :meth:`close`, when the queue is collected, or at exit (also as a multiprocessing
child). A killed trainer leaves its directory (``/dev/shm/mcx-results-<pid>-*``, a few KB)
behind; :func:`sweep_stale` (run at every Checkpointer start-up, like the segment sweep) removes
those that no live process holds.

Liveness is a lock, not the pid in the name (the pid is there for humans): containers on one node
share ``/dev/shm`` but not their pid namespaces, so another job's live trainer can carry a pid
that is dead, or someone else's, in ours. Like the staging segments (``staging.sweep_orphans``),
the creator holds a shared ``flock`` on ``<dir>/.lock`` for the queue's life; a forked writer
inherits it and a writer that unpickles the queue (spawned, persistent) takes its own, so the
directory stays held while any of them lives, in any pid namespace on the node. The sweep removes a
directory only when it can take the lock exclusively (non-blocking) and removes it while holding
it. The creator takes the lock on a temporary name and renames it to ``.lock``, so a lock file is
never seen unlocked while its creator lives. Directories without a ``.lock`` (left by a release
without the lock, or caught between ``mkdtemp`` and the rename) are removed only when the pid in
the name is dead here *and* nothing in the directory changed for :data:`LEGACY_MIN_AGE_S` (a day:
a live job's saves touch it far more often, and a leftover holds only a few KB).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import queue
import shutil
import stat
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from multiprocessing.util import Finalize
from typing import Any

from ._runtime import pid_alive, unheld

__all__ = ["SpoolQueue", "sweep_stale"]

_PREFIX = "mcx-results-"
_LOCK = ".lock"  # hidden: _names() skips dot files
LEGACY_MIN_AGE_S = 24 * 3600  # a directory without a lock file: swept only when this old
_counter = itertools.count()


def _remove_dir(directory: str, owner_pid: int, lock_fd: int | None) -> None:
    if os.getpid() == owner_pid:  # never from a forked child that inherited the finalizer
        shutil.rmtree(directory, ignore_errors=True)
    if lock_fd is not None:  # after the removal: a sweep never sees our directory unlocked
        os.close(lock_fd)


def _hold_new_lock(directory: str) -> int:
    """Create ``<directory>/.lock`` already locked (shared): lock a temporary name, then rename."""
    tmp = os.path.join(directory, f"{_LOCK}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # inherited by forked writers with the descriptor
        os.rename(tmp, os.path.join(directory, _LOCK))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _hold_existing_lock(directory: str) -> int | None:
    """A shared lock on an existing queue's ``.lock`` for a process that attached to it; None
    when there is none (the creator closed the queue, or a sweep is removing it)."""
    try:
        fd = os.open(os.path.join(directory, _LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _base_dir() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class SpoolQueue:
    """A FIFO of pickled objects in a directory (see the module docstring)."""

    def __init__(self, directory: str | None = None, *, owner: bool = True) -> None:
        self.directory = directory or tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-",
                                                       dir=_base_dir())
        self._remove = self._release = None
        if owner:
            # held for the queue's life: what sweep_stale checks (see the module docstring)
            lock_fd = _hold_new_lock(self.directory)
            # the creator removes the directory: on close(), on collection, or at exit (also as a
            # multiprocessing child, which skips atexit handlers); runs once
            self._remove = Finalize(self, _remove_dir,
                                    args=(self.directory, os.getpid(), lock_fd), exitpriority=0)
        else:
            # a writer that attached (unpickled) keeps the directory held while it has the queue
            lock_fd = _hold_existing_lock(self.directory)
            if lock_fd is not None:
                self._release = Finalize(self, os.close, args=(lock_fd,))

    def __reduce__(self) -> tuple:
        return SpoolQueue._attach, (self.directory,)

    @staticmethod
    def _attach(directory: str) -> "SpoolQueue":
        return SpoolQueue(directory, owner=False)

    # -- the queue methods the writers use ----------------------------------------------------
    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        data = bytes(ForkingPickler.dumps(obj))
        name = f"{time.time_ns():020d}_{os.getpid()}_{next(_counter):06d}"
        tmp = os.path.join(self.directory, f".{name}")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.rename(tmp, os.path.join(self.directory, name))  # whole or absent for a reader

    def get_nowait(self) -> Any:
        for name in self._names():
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
                os.unlink(path)
            except FileNotFoundError:  # taken by another reader meanwhile
                continue
            return ForkingPickler.loads(data)
        raise queue.Empty

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.get_nowait()
            except queue.Empty:
                if not block or (deadline is not None and time.monotonic() >= deadline):
                    raise
            time.sleep(0.005)

    def empty(self) -> bool:
        return not self._names()

    def qsize(self) -> int:
        return len(self._names())

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the directory (and any result still in it); only its creator does. A writer's
        close releases its hold on the directory."""
        if self._remove is not None:
            self._remove()
        if self._release is not None:
            self._release()

    def _names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.directory) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def __repr__(self) -> str:
        return f"SpoolQueue({self.directory!r})"


def sweep_stale(base: str | None = None) -> list[str]:
    """Remove spool directories under ``base`` (default: where new ones go) that no live process
    holds, in any pid namespace sharing ``base`` (killed trainers); returns what was removed.

    A directory with a ``.lock`` is removed only when its lock can be taken exclusively; the pid
    in its name is not consulted. One without (see the module docstring) only when that pid is
    dead here and it is older than :data:`LEGACY_MIN_AGE_S`."""
    base = base or _base_dir()
    removed = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return removed
    for name in names:
        if name.startswith(_PREFIX) and _remove_if_unheld(os.path.join(base, name)):
            removed.append(name)
    return removed


def _remove_if_unheld(directory: str) -> bool:
    try:
        with unheld(os.path.join(directory, _LOCK)) as free:
            if not free:  # held by a live creator or writer
                return False
            shutil.rmtree(directory, ignore_errors=True)  # under the lock: nobody attaches
            return not os.path.lexists(directory)
    except FileNotFoundError:
        return _remove_legacy(directory)
    except OSError:  # not a directory, or not ours to open: leave it
        return False


def _remove_legacy(directory: str) -> bool:
    """A directory without a lock file: left by a release without the lock, or a creator between
    ``mkdtemp`` and taking its lock; removed only when clearly abandoned."""
    pid_text = os.path.basename(directory)[len(_PREFIX):].split("-", 1)[0]
    if not pid_text.isdigit() or pid_alive(int(pid_text)):
        return False
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or time.time() - st.st_mtime < LEGACY_MIN_AGE_S:
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return not os.path.lexists(directory)
