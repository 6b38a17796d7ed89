"""Leaf helpers about the running process: its rank, warnings once, process liveness, and the
watchdog that ties writer-side processes to their trainer.

Stdlib and torch.distributed only, so every module (backend included) can import it without a
circle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

__all__ = ["ForkStarts", "die_with_parent", "forks_die_with_this_process", "pid_alive", "rank",
           "warn_once"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()
_warn_lock = threading.Lock()


def rank() -> int:
    """This process's torch.distributed rank, or 0 when no process group is up."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a broken torch.distributed must not break a warning
        pass
    return 0


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a WARNING once per ``key`` per process, on rank 0 only."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    if rank() == 0:
        logger.warning(message)


def _reset_warnings_for_tests() -> None:
    """Forget which warn_once keys were already emitted (tests only)."""
    with _warn_lock:
        _warned.clear()


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_FORK_WATCH: dict[str, object] = {"parent": None, "starts": None}


class ForkStarts:
    """Which processes forked inside ``forks_die_with_this_process(starts)`` got through the
    Python runtime's after-fork work and ran a line of Python.

    CPython 3.11 can leave a forked child blocked forever in ``PyOS_AfterFork_Child`` (waiting
    for the interpreter's thread-state lock) when, at the instant of the fork, a thread without
    the GIL held that lock (most likely a C++ thread, such as gloo's, entering Python; not
    proven). The child never runs our write; alive and
    silent, it looked like a slow write until ``--ckpt-timeout``. Each watched child writes its
    pid into a pipe as its last after-fork step, so the trainer can tell a writer that never
    started from one that is writing (:class:`~megatron_ckpt_ext.save.writers.WriterPool`
    forks it again, or stops it)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._owner = os.getpid()
        self._pids: set[int] = set()
        self._buf = b""
        self._lock = threading.Lock()

    def started(self, pid: int) -> bool:
        """Whether the watched child ``pid`` finished its after-fork start."""
        with self._lock:
            if pid not in self._pids and self._r >= 0:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    while chunk := os.read(self._r, 4096):
                        self._buf += chunk
                n = len(self._buf) // 8 * 8
                self._pids.update(int.from_bytes(self._buf[i:i + 8], "little")
                                  for i in range(0, n, 8))
                self._buf = self._buf[n:]
            return pid in self._pids

    def _in_child(self) -> None:
        """In a forked child: report this pid, then let go of both ends."""
        with contextlib.suppress(OSError):
            os.write(self._w, os.getpid().to_bytes(8, "little"))
        self._close()

    def _close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._r = self._w = -1

    def close(self) -> None:
        if os.getpid() == self._owner:
            with self._lock:
                self._close()


@contextlib.contextmanager
def forks_die_with_this_process(starts: ForkStarts | None = None) -> Iterator[None]:
    """Processes forked inside this block (the backends' write-results Manager server, a
    temporal writer) get :func:`die_with_parent`, and report their start to ``starts``. Without
    the first, a Manager server outlives a SIGKILLed trainer forever. Forks elsewhere in the
    training process are not touched."""
    if not _FORK_WATCH.get("registered"):
        os.register_at_fork(after_in_child=_watch_forked_child)
        _FORK_WATCH["registered"] = 1
    _FORK_WATCH["parent"], _FORK_WATCH["starts"] = os.getpid(), starts
    try:
        yield
    finally:
        _FORK_WATCH["parent"] = _FORK_WATCH["starts"] = None


def _watch_forked_child() -> None:
    parent, starts = _FORK_WATCH["parent"], _FORK_WATCH["starts"]
    _FORK_WATCH["parent"] = _FORK_WATCH["starts"] = None  # this child's own forks are its business
    if parent is not None:
        die_with_parent(parent)  # type: ignore[arg-type]
    if isinstance(starts, ForkStarts):
        starts._in_child()


def die_with_parent(trainer_pid: int) -> None:
    """Watchdog for writer-side processes (Linux): SIGKILL this process when its trainer dies.
    Without it a persistent worker whose trainer was SIGKILLed waits on its request queue
    forever, holding the staging segments it maps (so the next start cannot sweep them).
    Nothing such a process could still write would be committed: only the trainer commits."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # not Linux: the worker outlives a crashed trainer
        return
    if os.getppid() != trainer_pid:  # the trainer died before the watchdog was armed
        os._exit(1)

