"""The writer pool: the provider's async calls queue (a persistent worker or a fresh process per
save), the saves handed to it, and the agreement over ranks on their state.

Bounded waits: every poll first agrees on the writers' state over the process group (one small
all-reduce, which replaces the queue's own "is everyone done" all-reduce while a write runs). If
any rank's writer died or stayed alive past ``--ckpt-timeout``, every rank abandons the save and
raises :class:`CheckpointWriteError`; the writers are restarted at the next save and the last
committed checkpoint stays the latest.

Agreed failures (``agreed.py``): each step of a save's finalization and its planning end in one
small all-reduce, so a step that fails on one rank alone fails on every rank at the same point.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any

from .. import _clock, backend, preflight
from .._runtime import (ForkStarts, die_with_parent, forks_die_with_this_process, rank,
                        warn_once)
from ..collectives import Group
from ..debug import env_switch
from ..errors import CheckpointWriteError
from ..options import CkptOptions
from .agreed import SaveStepFailed, agreed_finalize, run_agreed  # also public from here
from .fork_memory import kept_from_fork
from .layout import tracker_text
from .report import SaveRecord

__all__ = ["POLL_S", "SaveStepFailed", "WRITER_START_TIMEOUT_S", "WriterPool", "agreed_finalize",
           "run_agreed"]

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a blocking finalize re-checks the writers
# A forked writer that has not finished Python's after-fork start this long after its fork never
# will (see ForkStarts): a temporal one is forked again (MAX_REFORKS times), a persistent one is
# stopped and the save fails on every rank as for a dead writer. A start takes milliseconds, so
# this bounds what a stuck fork costs a save; forking again a writer that was only slow to start
# loses nothing: it had run none of the save.
WRITER_START_TIMEOUT_S = 5.0
MAX_REFORKS = 2


_OPEN_POOLS: weakref.WeakSet = weakref.WeakSet()  # pools not closed, for the exit hook
_EXIT_HOOK_PID: list[int] = []


def _stop_writers_at_exit() -> None:
    """At interpreter exit, before multiprocessing's own exit handler: stop the writers of every
    pool not closed (the trainer left on an error, or without close()). They ignore SIGTERM, so
    that a job's signal cannot stop a write, and multiprocessing's exit sends its daemonic
    children SIGTERM and then joins them: without this, the process would never exit. What they
    were writing was not committed, so nothing committed is lost."""
    if not _EXIT_HOOK_PID or _EXIT_HOOK_PID[0] != os.getpid():
        return
    for pool in list(_OPEN_POOLS):
        queue = pool.queue
        if queue is not None:
            with contextlib.suppress(Exception):
                backend.stop_async_writers(queue)


def _register_exit_hook() -> None:
    """Once per process; atexit runs its handlers last registered first, so this one runs
    before multiprocessing's (registered when multiprocessing was imported)."""
    if not _EXIT_HOOK_PID or _EXIT_HOOK_PID[0] != os.getpid():
        _EXIT_HOOK_PID[:] = [os.getpid()]
        atexit.register(_stop_writers_at_exit)


class WriterPool:
    """This rank's async writers (none for sync saves: they write in the trainer, and only the
    write-results queue is kept ready). ``pending`` maps each scheduled call to its save's record
    (None: the persistent worker's warm-up request)."""

    def __init__(self, options: CkptOptions, caps: backend.Capabilities, group: Group, *,
                 is_async: bool, cpu_shm: bool, reports: list[dict]) -> None:
        self.options, self.caps, self.group = options, caps, group
        self.is_async, self.cpu_shm = is_async, cpu_shm
        self.reports = reports  # the Checkpointer's: the last save's size, for a disk-full hint
        self.pending: dict[int, SaveRecord | None] = {}
        self.persistent = False
        self.startup: dict[str, float] = {}
        self.froze_gc = False  # gc.freeze() was ours alone: close() unfreezes
        self.fork_starts = ForkStarts() if is_async else None
        self._start_watch: tuple[int, float] | None = None  # (pid, fork's _clock time) not started
        self._start_failure = ""  # why a writer was stopped for never starting
        self._reforks = 0
        self._started = _clock.running()
        self._queue: Any = self._make_queue() if is_async else None
        if is_async:
            _OPEN_POOLS.add(self)
            _register_exit_hook()
        t0 = time.perf_counter()
        self._prime_results_queue()
        self.startup["write_results_queue_s"] = round(time.perf_counter() - t0, 6)

    @property
    def idle(self) -> bool:
        """No save (nor the worker's warm-up) is waiting to be finalized."""
        return not self.pending

    @property
    def saves_pending(self) -> bool:
        """A save (not only the worker's warm-up) is waiting to be finalized."""
        return any(record is not None for record in self.pending.values())

    @property
    def queue(self) -> Any:
        """The provider's async calls queue (None after an abandoned save, until the next)."""
        return self._queue

    # -- start -----------------------------------------------------------------------------------
    def _make_queue(self) -> Any:
        self.persistent = self._persistent_runs_here()
        queue = backend.new_async_calls_queue(
            persistent=self.persistent, is_daemon=True,
            cpu_shm_mode=self.cpu_shm and self.persistent,
            cpu_priority=self.options.async_ckpt_cpu_priority,
            io_priority=self.options.async_ckpt_io_priority)
        if self.persistent:
            self._warm_up(queue)
        return queue

    def _persistent_runs_here(self) -> bool:
        if not (self.options.use_persistent_ckpt_worker and self.caps.queue_persistent):
            return False
        ok, reason = backend.persistent_worker_runs_here(self.caps, cpu_shm_mode=self.cpu_shm)
        if not ok:
            warn_once("persistent-cannot-run", f"--use-persistent-ckpt-worker: {reason}; a fresh "
                      "writer process is used per save instead.")
        return ok

    def _warm_up(self, queue: Any) -> None:
        """Start the persistent worker now and have it import what unpickling a save request
        needs (else the first save waits for that); finalized by the first poll."""
        warm = backend.async_request_cls()(async_fn=_warm_up, async_fn_args=(os.getpid(),),
                                           finalize_fns=[])
        # The worker needs no CUDA where nvrx honours cpu_shm_mode: then it is forked.
        no_cuda = self.cpu_shm and self.caps.worker_cpu_shm_skips_cuda
        with backend.persistent_worker_forks(queue, cpu_shm_mode=no_cuda) as forks, \
                backend.spawn_skips_main(), \
                forks_die_with_this_process(self.fork_starts if forks else None), \
                kept_from_fork(forks and self.cpu_shm) as kept:  # (it reads staging by name)
            if forks:
                self._freeze_gc()
            self.startup.update(fork_skipped_tensor_bytes=kept["bytes"],
                                fork_mark_s=kept["mark_s"])  # (its scan of the live objects)
            if self.caps.warmup_persistent_caller:
                backend.call_with_supported(queue.warmup_persistent_caller, rank(),
                                            is_daemon=True, cpu_shm_mode=self.cpu_shm)
            self.pending[queue.schedule_async_request(warm)] = None
        if forks:  # a spawned worker runs no after-fork hook: nothing to watch
            self._watch_start(backend.newest_writer_pid(queue))

    def _freeze_gc(self) -> None:
        """Before the worker is forked: collect, then ``gc.freeze()`` what is left, so the
        trainer's later full collections do not copy every page the worker shares
        (docs/notes/save_path.md). Frozen objects are still freed by refcount; :meth:`close`
        unfreezes unless something else had frozen objects first. ``MCX_FREEZE_GC_AT_FORK=0``
        turns this off."""
        if env_switch("MCX_FREEZE_GC_AT_FORK") == "1":
            self.froze_gc = _freeze_gc(self.startup) or self.froze_gc  # a second worker: still ours

    def _prime_results_queue(self) -> None:
        with forks_die_with_this_process():  # a results-queue server dies with this trainer
            backend.prime_write_results_queue()

    # -- per save --------------------------------------------------------------------------------
    def ready(self, iteration: int, root: Path) -> None:
        """Collective with a persistent worker: before a save, a new queue when the last one was
        abandoned; else agree that every rank's worker is alive (a dead one would block the
        hand-over forever)."""
        if not self.is_async:
            return
        if self._queue is None:
            self._started = _clock.running()
            self._queue = self._make_queue()
        elif self.persistent:
            self.agree(before=(iteration, root))

    def schedule(self, request: Any, record: SaveRecord) -> None:
        """Hand ``request`` to a writer; :meth:`poll` reports it written (the Checkpointer then
        commits it)."""
        request = agreed_finalize(request, self.group)
        with backend.unblock_hand_over_if_worker_dies(self._queue, poll_s=POLL_S,
                                                      give_up=self._gave_up_on_start), \
                forks_die_with_this_process(self.fork_starts), backend.remember_process_calls():
            call_idx = self._queue.schedule_async_request(request)
        self.pending[call_idx] = record
        if not self.persistent:  # a temporal caller forked this save's writer just now
            self._reforks = 0
            self._watch_start(backend.newest_writer_pid(self._queue))

    def poll(self, *, blocking: bool) -> list[SaveRecord]:
        """Collective: finalize (megatron-core's metadata write) the saves every rank's writer
        has finished (all of them when ``blocking``); the records written, for the Checkpointer
        to commit, in schedule order."""
        done: list[SaveRecord] = []
        while self._queue is not None and self.pending:
            if self.agree():  # some rank's writer is still writing
                if not blocking:
                    break
                time.sleep(POLL_S)
                continue
            done += self._finalize_finished()
            if not blocking:
                break
        return done

    def agree(self, before: tuple[int, Path] | None = None) -> bool:
        """Collective: True while some rank's writer is still running. Raises on every rank
        when any rank's writer died or ran past the timeout (``before``: the save about to
        start, for the message)."""
        self._restart_unstarted_writer()
        state, detail = backend.async_writer_state(self._queue)
        if state == "dead" and self._start_failure:
            detail = self._start_failure
        timed_out = state == "running" and _clock.running() > self._head_deadline()
        dead = state == "dead"
        running, any_dead, any_late, which = self.group.all_max(
            [float(state == "running"), float(dead), float(timed_out),
             float(rank() if dead or timed_out else -1)])
        if any_dead or any_late:
            why = (f"the async writer of rank {int(which)} stopped before finishing its write"
                   if any_dead else
                   f"it did not finish within --ckpt-timeout {self.options.ckpt_timeout} s "
                   "(config key 'ckpt_timeout'; raise it if writes are legitimately this slow)")
            raise self.abandon(why + (f" ({detail})" if detail else ""), before=before)
        return bool(running)

    # -- writers that never started (ForkStarts) ---------------------------------------------
    def _watch_start(self, pid: int | None) -> None:
        self._start_watch = None if pid is None else (pid, _clock.running())

    def _never_started(self) -> tuple[Any, Any, bool] | None:
        """(caller, process, persistent) of the watched writer when it is alive and has not started
        ``WRITER_START_TIMEOUT_S`` after its fork; None otherwise (the watch ends once it has
        started or is gone)."""
        watch, queue = self._start_watch, self._queue
        if watch is None or queue is None or self.fork_starts is None:
            return None
        found = backend.forked_writer(queue, watch[0])
        if found is None or not found[1].is_alive() or self.fork_starts.started(watch[0]):
            self._start_watch = None
            self._reforks = 0
            return None
        return found if _clock.running() - watch[1] > WRITER_START_TIMEOUT_S else None

    def _gave_up_on_start(self) -> bool:
        """For the hand-over's watcher: the persistent worker never started (it is then
        killed, which releases the hand-over)."""
        found = self._never_started()
        if found is None:
            return False
        self._start_failure = _start_failure_text(found[1].pid)
        self._start_watch = None
        return True

    def _restart_unstarted_writer(self) -> None:
        """A temporal writer that never started is forked again (it ran nothing, so its request
        is intact), and a persistent worker whose only request is its start-up is replaced by a
        new one, at most ``MAX_REFORKS`` times; else the writer is stopped and the next
        agreement reports it dead with the reason (a persistent worker holding a save)."""
        found = self._never_started()
        if found is None:
            return
        caller, process, persistent = found
        why = _start_failure_text(process.pid)
        if persistent and self._reforks < MAX_REFORKS and not any(self.pending.values()):
            # only its start-up request waits on it: a new worker loses nothing
            self._reforks += 1
            self.kill()
            self._started = _clock.running()
            self._queue = self._make_queue()
            logger.warning("%s; stopped it and started a new persistent worker (pid %s)", why,
                           backend.newest_writer_pid(self._queue))
            return
        if not persistent and self._reforks < MAX_REFORKS:
            self._reforks += 1
            with forks_die_with_this_process(self.fork_starts):
                new = backend.refork_temporal_writer(caller)
            if new is not None:
                logger.warning("%s; killed it and forked the writer again as pid %d", why,
                               new.pid)
                self._watch_start(new.pid)
                return
        process.kill()
        process.join(timeout=10)
        self._start_failure, self._start_watch = why, None

    def _finalize_finished(self) -> list[SaveRecord]:
        """Every rank's head writer has finished: run the queue's finalization (megatron-core's
        metadata write, collectives) for what is done; the records written (the Checkpointer
        commits them)."""
        before = self._queue.get_num_unfinalized_calls()
        try:
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
        except (KeyboardInterrupt, SystemExit):
            raise
        # a write that raised: raised on every rank by agreed_finalize (also as torch's
        # CheckpointException, a BaseException, from nvrx 0.7's finalize)
        except BaseException as e:  # noqa: BLE001
            text = str(e) if isinstance(e, SaveStepFailed) else backend.checkpoint_failure_text(e)
            raise self.abandon(f"its write failed: {text}") from e
        # Count, do not trust the returned indices: the providers return each request's own
        # call_idx, which the queue never sets. Calls finalize in schedule order.
        finished = before - self._queue.get_num_unfinalized_calls()
        records = [self.pending.pop(idx) for idx in list(self.pending)[:finished]]
        return [r for r in records if r is not None]

    def _head_deadline(self) -> float:
        record = next(iter(self.pending.values()), None) if self.pending else None
        # the running clock: a job stopped whole (suspended) is not a slow write (_clock.py)
        started = record.running_at_start if record is not None else self._started
        return started + self.options.ckpt_timeout

    # -- failure and end -------------------------------------------------------------------------
    def abandon(self, why: str, *, before: tuple[int, Path] | None = None) -> CheckpointWriteError:
        """Stop this rank's writers, drop the pending saves, and say what happened."""
        record = next((r for r in self.pending.values() if r is not None), None)
        if record is not None:
            what, root = f"checkpoint iteration {record.iteration} under {record.root}", record.root
        elif before is not None:
            what, root = (f"checkpoint iteration {before[0]} under {before[1]} (before it "
                          "started)", before[1])
        else:
            what, root = "the persistent checkpoint writer's start-up", None
        error = self._failure(what, root, why, record.nbytes if record is not None else 0,
                              "; the async writers are restarted at the next save().")
        self.kill()
        return error

    def failed(self, record: SaveRecord, why: str, *, after: str = ".") -> CheckpointWriteError:
        """A save that failed on every rank in the trainer (its planning, a synchronous save's
        write, or a commit): what happened; the writers are untouched."""
        return self._failure(f"checkpoint iteration {record.iteration} under {record.root}",
                             record.root, why, record.nbytes, after)

    def _failure(self, what: str, root: Path | None, why: str, nbytes: int,
                 after: str) -> CheckpointWriteError:
        latest = tracker_text(root) if root is not None else ""
        needed = max([nbytes] + [r.get("bytes", 0) for r in self.reports[-1:]])
        space = preflight.disk_full_hint(root, needed) if root is not None else ""
        return CheckpointWriteError(
            f"{what} failed on every rank: {why}.{space} The save is abandoned{latest}{after}")

    def kill(self) -> None:
        """Stop the writers at once and release what the pending saves staged."""
        queue, self._queue = self._queue, None
        self._start_watch, self._start_failure = None, ""
        if queue is not None:
            backend.stop_async_writers(queue)
        for record in self.pending.values():
            if record is not None:
                record.release()
        self.pending.clear()
        # Other ranks' finished writers left their results in the global write-results queue,
        # where the next save would read them as its own: start a fresh queue.
        backend.shutdown_write_results_queues()
        self._prime_results_queue()

    def close(self, *, drained: bool) -> None:
        """Stop the writers: the queue's own close when drained and alive, else kill them."""
        _OPEN_POOLS.discard(self)
        if self._queue is not None:
            if drained and backend.async_writer_state(self._queue)[0] != "dead":
                self._queue.close()
                self._queue = None
            else:  # the queue's own close would wait for a dead or unfinished writer
                self.kill()
        backend.shutdown_write_results_queues()
        self.pending.clear()
        if self.fork_starts is not None:
            self.fork_starts.close()
            self.fork_starts = None
        if self.froze_gc:
            self.froze_gc = False
            gc.unfreeze()


def _start_failure_text(pid: int) -> str:
    return (f"rank {rank()}: the checkpoint writer forked as pid {pid} did not start within "
            f"{WRITER_START_TIMEOUT_S:g} s (blocked in Python's after-fork start: CPython "
            "before 3.12, 3.11.10 and 3.10.15 can leave a forked child waiting forever for "
            "the interpreter's thread-state lock that another thread held at the fork; "
            "upgrading Python removes this)")


def _freeze_gc(startup: dict[str, float]) -> bool:
    """Collect, then ``gc.freeze()`` what is left (its time in ``startup``); whether nothing was
    frozen before (the freeze is then ours alone to undo)."""
    t0 = time.perf_counter()
    first = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    startup["gc_freeze_s"] = round(time.perf_counter() - t0, 6)
    logger.debug("gc.freeze() of %d objects before forking the writer, %.3f s",
                 gc.get_freeze_count(), startup["gc_freeze_s"])
    return first


def _warm_up(trainer_pid: int | None = None) -> None:
    """The persistent worker's first request: ties the worker's life to its trainer's, then
    imports what unpickling a save request needs."""
    if trainer_pid is not None:
        die_with_parent(trainer_pid)
    backend.warm_up_writer_imports()
