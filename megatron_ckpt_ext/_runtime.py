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
import time
from typing import Any, Iterator

__all__ = ["ForkStarts", "Recent", "die_with_parent", "forks_die_with_this_process",
           "ignore_job_signals", "madvise", "note_exit_signal", "pid_alive", "populate", "rank",
           "show_our_logs", "unheld", "warn_once"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()
_warn_lock = threading.Lock()


@contextlib.contextmanager
def unheld(path: str) -> Iterator[bool]:
    """The one test of "does a live process still hold this file" (a staging segment, a spool
    directory's lock file; their holders keep a shared ``flock`` on it): opens ``path`` (no
    symlink followed) and tries its exclusive flock without waiting. Yields True while this
    process holds that lock (nobody else holds the file: safe to remove it now, as nobody can
    attach meanwhile), False when another process does (or the lock cannot be taken: leave
    it). Raises OSError when ``path`` cannot be opened."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live process (perhaps in another pid namespace)
            yield False
            return
        yield True
    finally:
        os.close(fd)


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+; older kernels refuse them
_PAGE = os.sysconf("SC_PAGE_SIZE")  # 4 KiB on x86; 64 KiB on many aarch64 (GH200) kernels
_madvise: list = []  # the bound madvise, once made


def madvise(start: int, length: int, advice: int) -> bool:
    """``madvise(2)`` on ``length`` bytes at the page-aligned ``start``; whether it succeeded."""
    if not _madvise:  # threads may get here at once: each publishes a whole binding, never half
        import ctypes

        bound = ctypes.CDLL(None, use_errno=True).madvise
        bound.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.append(bound)
    return _madvise[0](start, length, advice) == 0


def populate(address: int, nbytes: int, *, write: bool = False) -> bool:
    """Fault the pages of ``nbytes`` at ``address`` into this process's page tables with one
    ``madvise`` (``write``: writable, as pinning needs them); whether the kernel did. Where it
    refuses (before Linux 5.14), the pages fault in when first touched, as without it."""
    if nbytes <= 0:
        return True
    start = address & ~(_PAGE - 1)  # madvise takes a page-aligned start
    return madvise(start, address + nbytes - start,
                   _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)


def rank() -> int:
    """This process's torch.distributed rank; before the process group is up, the launcher's
    ``RANK`` (torchrun, SLURM through it), else 0. Megatron-LM 0.19 builds its persistent
    worker, and so our early Checkpointer, before it initializes torch.distributed: taken as
    rank 0 there, every rank took the --save lock and all but one failed (seen with 2 GPUs)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a broken torch.distributed must not break a warning
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def world_size() -> int:
    """The world's size: torch.distributed's once it is up, before that the launcher's
    ``WORLD_SIZE`` (as :func:`rank`), else 1."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except Exception:  # as rank(): never break a message over it
        pass
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


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

    CPython before 3.12 (3.11.10, 3.10.15) can leave a forked child blocked forever in
    ``PyOS_AfterFork_Child`` (waiting for the interpreter's thread-state lock) when, at the
    instant of the fork, a thread without the GIL held that lock: a torch.distributed worker
    thread creating its Python thread state to free a collective's tensor (seen in a stuck
    child's memory; our forks now wait for those threads, ``_fork_when_torch_workers_idle``).
    Any other native thread entering Python can do the same. The child never runs our write;
    alive and silent, it looked like a slow write until ``--ckpt-timeout``. Each watched child
    writes its pid into a pipe as its last after-fork step, so the trainer can tell a writer that
    never started from one that is writing (:class:`~megatron_ckpt_ext.save.writers.WriterPool`
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
    temporal writer) get :func:`die_with_parent` and :func:`ignore_job_signals`, and report their
    start to ``starts``. Without the first, a Manager server outlives a SIGKILLed trainer
    forever; without the second, a job-wide SIGTERM kills the writer of the exit checkpoint.
    Forks elsewhere in the training process are not touched."""
    if not _FORK_WATCH.get("registered"):
        os.register_at_fork(before=_fork_when_torch_workers_idle,
                            after_in_child=_watch_forked_child)
        _FORK_WATCH["registered"] = 1
    _FORK_WATCH["parent"], _FORK_WATCH["starts"] = os.getpid(), starts
    # The job's termination signals stay pending on this thread meanwhile, so a child (forked,
    # or spawned: an exec keeps the mask) starts with them blocked until it ignores them.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _job_signums())
    try:
        yield
    finally:
        _FORK_WATCH["parent"] = _FORK_WATCH["starts"] = None
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# torch.distributed's own worker threads: gloo's "pt_gloo_runloop", NCCL's "pt_nccl_watchdg".
_TORCH_WORKER_PREFIX = b"pt_"
# The longest a fork of ours waits for them to be idle: a worker's busy spell after a collective
# is short, a few scheduler ticks when it was preempted; past this the fork goes ahead (the
# start watch of save/writers.py still catches a child that never starts).
FORK_QUIET_BOUND_S = 0.1


def _fork_when_torch_workers_idle() -> None:
    """Before a fork inside ``forks_die_with_this_process``: wait (GIL released, at most
    ``FORK_QUIET_BOUND_S``) until no torch.distributed worker thread of this process is running.

    Why: such a thread frees a finished collective's tensors; when the Python side had let go of
    one first, it enters Python to free it, and creating its thread state takes the
    interpreter's thread-state lock without the GIL. CPython before 3.12, 3.11.10 and 3.10.15
    takes that lock in a forked child before it re-creates it: a fork at that instant never
    starts (``ForkStarts``). An idle worker sleeps until the trainer queues a collective, which
    this thread, forking, does not do."""
    if _FORK_WATCH["parent"] is None:  # not one of ours
        return
    deadline = time.monotonic() + FORK_QUIET_BOUND_S
    waited = False
    while _torch_workers_busy():
        if not waited:
            waited = _count_fork("waited")
        if time.monotonic() > deadline:
            _count_fork("unquiet")
            return
        time.sleep(0.0005)


def _torch_workers_busy() -> bool:
    """Whether a torch.distributed worker thread of this process is running or runnable (Linux;
    False where /proc cannot tell)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    me = str(threading.get_native_id())
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it just exited
            continue
        name, _, rest = stat.partition(b" (")[2].rpartition(b") ")
        if name.startswith(_TORCH_WORKER_PREFIX) and rest[:1] in (b"R", b"D"):
            return True
    return False


def _count_fork(what: str) -> bool:
    _FORK_WATCH[what] = fork_waits()[what] + 1
    return True


def fork_waits() -> dict[str, int]:
    """Forks of ours that found a torch worker busy and waited ("waited"), and those that went
    ahead with one still busy after ``FORK_QUIET_BOUND_S`` ("unquiet"): for the soak."""
    return {k: int(_FORK_WATCH.get(k, 0)) for k in ("waited", "unquiet")}  # type: ignore[arg-type]


def _watch_forked_child() -> None:
    parent, starts = _FORK_WATCH["parent"], _FORK_WATCH["starts"]
    _FORK_WATCH["parent"] = _FORK_WATCH["starts"] = None  # this child's own forks are its business
    if parent is not None:
        ignore_job_signals()
        die_with_parent(parent)  # type: ignore[arg-type]
    if isinstance(starts, ForkStarts):
        starts._in_child()


# What a job's end sends every process of it (SLURM's job-step SIGTERM, a terminal's Ctrl-C),
# plus the --exit-signal (note_exit_signal); the choices of --exit-signal bound what a spawned
# writer may find blocked at its start.
_JOB_SIGNALS = {"SIGTERM", "SIGINT"}
_EXIT_SIGNAL_CHOICES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def note_exit_signal(name: str) -> None:
    """The --exit-signal of this job: writers forked or spawned from now on ignore it too."""
    _JOB_SIGNALS.add(name)


def _job_signums() -> set[int]:
    return {int(getattr(signal, name)) for name in _JOB_SIGNALS if hasattr(signal, name)}


def ignore_job_signals() -> None:
    """In a writer-side process, first thing: ignore the job's termination signals (and those
    still blocked since its spawn). A job-wide signal must reach only the ranks, which finish
    the exit checkpoint and then stop their writers; a writer killed by it loses that
    checkpoint. Writers still die with their rank (:func:`die_with_parent`)."""
    nums = _job_signums()
    with contextlib.suppress(OSError, ValueError):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        nums |= set(map(int, blocked)) & {int(getattr(signal, n)) for n in _EXIT_SIGNAL_CHOICES}
    for signum in nums:
        with contextlib.suppress(OSError, ValueError):  # ValueError: off the main thread
            signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, nums)  # what was pending is dropped, ignored


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


class Recent(list):
    """A list that keeps its last ``KEPT`` entries: the per-save and per-load reports a long run
    appends to (every save also goes to ``ckpt_report.jsonl``, which keeps them all)."""

    KEPT = 1000

    def append(self, entry: Any) -> None:
        super().append(entry)
        if len(self) > self.KEPT:
            del self[: len(self) - self.KEPT]

    def extend(self, entries: Any) -> None:
        super().extend(entries)
        if len(self) > self.KEPT:
            del self[: len(self) - self.KEPT]


def show_our_logs() -> None:
    """--logging-level asked for our lines: where the script configured no logging (no handler
    on the way to the root), print them to stderr, those below WARNING from rank 0 only;
    Python's last-resort handler would drop everything below WARNING."""
    ours = logging.getLogger("megatron_ckpt_ext")
    if ours.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(lambda r: r.levelno >= logging.WARNING or rank() == 0)
    ours.addHandler(handler)
