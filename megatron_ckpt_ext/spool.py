"""A write-results queue with no server process behind it.

megatron-core's and nvrx's writers hand each save's write results back to the trainer through a
module-global queue (``filesystem_async._results_queue``) that must pickle into the writer
process, so they make it a ``multiprocessing.Manager().Queue()``: a proxy to a server process.
That server is one more fork of the trainer, and on the H100 benchmark it held ~190 MB of the
trainer's pages alive by copy-on-write (``scripts/profile_save.py --mem-breakdown``), a third of
all the host memory our persistent mode used beyond the staging buffers.

:class:`SpoolQueue` does the same job with files: ``put`` writes one pickle into a private
directory (``/dev/shm`` where there is one) and renames it into place, ``get_nowait`` takes the
oldest. It pickles as its directory name, so it reaches forked, spawned and persistent writers
alike, and a ``put`` is complete when it returns (the writer signals "done" only after it): the
trainer's ``get_nowait`` after that always finds it. Only the methods the writers use exist
(``put``, ``get``, ``get_nowait``, ``empty``, ``qsize``). The process that created it removes the
directory on :meth:`close`, when the queue is collected, or at exit (also as a multiprocessing
child). A killed trainer leaves its directory (``/dev/shm/mcx-results-<pid>-*``, a few KB)
behind; :func:`sweep_stale` (run at every Checkpointer start-up, like the segment sweep) removes
those whose creator is no longer running.
"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from multiprocessing.util import Finalize
from typing import Any

__all__ = ["SpoolQueue", "sweep_stale"]

_PREFIX = "mcx-results-"
_counter = itertools.count()


def _remove_dir(directory: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # never from a forked child that inherited the finalizer
        shutil.rmtree(directory, ignore_errors=True)


def _base_dir() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class SpoolQueue:
    """A FIFO of pickled objects in a directory (see the module docstring)."""

    def __init__(self, directory: str | None = None, *, owner: bool = True) -> None:
        self.directory = directory or tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-",
                                                       dir=_base_dir())
        # the creator removes the directory: on close(), on collection, or at exit (also as a
        # multiprocessing child, which skips atexit handlers); runs once
        self._remove = (Finalize(self, _remove_dir, args=(self.directory, os.getpid()),
                                 exitpriority=0) if owner else None)

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
        """Remove the directory (and any result still in it); only its creator does."""
        if self._remove is not None:
            self._remove()

    def _names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.directory) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def __repr__(self) -> str:
        return f"SpoolQueue({self.directory!r})"


def sweep_stale(base: str | None = None) -> list[str]:
    """Remove spool directories under ``base`` (default: where new ones go) whose creating
    process is gone (killed trainers); returns what was removed."""
    from .staging import pid_alive

    base = base or _base_dir()
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid_text = name[len(_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or pid_alive(int(pid_text)):
            continue
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        removed.append(name)
    return removed
