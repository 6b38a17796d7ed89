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

__all__ = ["die_with_parent", "forks_die_with_this_process", "pid_alive", "rank", "warn_once"]

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


_FORK_WATCH: dict[str, int | None] = {"parent": None}


@contextlib.contextmanager
def forks_die_with_this_process() -> Iterator[None]:
    """Processes forked inside this block (the backends' write-results Manager server, a
    temporal writer) get :func:`die_with_parent`. Without it a Manager server outlives a
    SIGKILLed trainer forever. Forks elsewhere in the training process are not touched."""
    if not _FORK_WATCH.get("registered"):
        os.register_at_fork(after_in_child=_watch_forked_child)
        _FORK_WATCH["registered"] = 1
    _FORK_WATCH["parent"] = os.getpid()
    try:
        yield
    finally:
        _FORK_WATCH["parent"] = None


def _watch_forked_child() -> None:
    parent = _FORK_WATCH["parent"]
    _FORK_WATCH["parent"] = None  # this child's own forks are its business
    if parent is not None:
        die_with_parent(parent)


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

