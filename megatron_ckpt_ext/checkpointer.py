"""The checkpoint lifecycle a training loop sees: save, maybe_finalize, load, close.

Layout (Megatron's): ``<root>/iter_{iteration:07d}/`` per checkpoint and the tracker
``<root>/latest_checkpointed_iteration.txt`` naming the newest committed one.

A save, step by step:
1. every rank writes into ``<root>/iter_XXXXXXX.incomplete/`` (a name nothing loads);
2. async saves first stage every tensor into CPU memory owned by this save (per-tensor shared
   memory with ``--async-ckpt-use-cpu-shm``, else plain CPU copies), so the bytes written are the
   state at the ``save()`` call whatever training does next, and the writer needs no CUDA IPC;
3. megatron-core plans the save and returns a request; with one writer the buckets are written in
   the process that owns the save (``strategy.sequential_request``); the request runs at once
   (sync) or on the async queue;
4. finalize (megatron-core's metadata write, collective), then our commit, also collective: a
   barrier, rank 0 renames the directory to ``iter_XXXXXXX`` and rewrites the tracker atomically
   (temp file, fsync, rename, fsync of the directory), a barrier. Staging buffers are released only
   now. A crash anywhere before the rename leaves the previous checkpoint as the latest.

Bounded waits (issue 9): an async writer that dies (SIGKILL, OOM, a raising write in a persistent
worker) or stays alive past ``--ckpt-timeout`` seconds never leaves a rank waiting forever. Every
poll of :meth:`Checkpointer.maybe_finalize` first agrees on the writers' state over the process
group (one small all-reduce, which replaces the queue's own "is everyone done" all-reduce while a
write runs); if any rank's writer died or timed out, every rank abandons the save and raises
:class:`CheckpointWriteError` (the writers are stopped and restarted at the next save; the last
committed checkpoint stays the latest). A rank that stops calling the collectives altogether is
the process group's timeout's business (``--distributed-timeout-minutes``).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from . import _cpu_shim, backend, preflight, strategy
from ._runtime import die_with_parent, forks_die_with_this_process, rank, warn_once
from .debug import env_switch, trace_event, traced_request
from .errors import CheckpointWriteError
from .load import locate
from .options import CkptOptions
from .save.layout import (TRACKER, checkpoint_name, commit_on_disk, incomplete_name, read_tracker,
                          tracker_text)
from .save.planner import SavePlanner, copy_structure, state_bytes
from .save.report import SaveRecord, log_report, report_entry
from .validation import check

# TRACKER, checkpoint_name and read_tracker (save.layout) are public from here as well.
__all__ = ["Checkpointer", "TRACKER", "checkpoint_name", "read_tracker"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a blocking finalize re-checks the writers
_LOGGERS = ("megatron_ckpt_ext", "megatron")  # what --logging-level sets


class Checkpointer:
    """Save / load megatron-core sharded state dicts with the options' strategies.

    ``process_group`` is used for the commit barriers (default: the world), ``dp_group`` for the
    fully-parallel save/load wrappers; ``save_dir``, when given, is checked for writability here.
    Construction validates the options against the installed backend (raising on errors, warning
    once on rank 0) and does the start-up work the first save would otherwise pay for: it starts
    the persistent worker and the writers' write-results queue
    (:func:`backend.prime_write_results_queue`); :meth:`prepare` then allocates and pins the
    staging buffers in the background once the trainer has built its state.
    """

    def __init__(self, options: CkptOptions, *, process_group: Any = None, dp_group: Any = None,
                 caps: backend.Capabilities | None = None, job_id: str | None = None,
                 save_dir: str | os.PathLike[str] | None = None) -> None:
        self.options = options
        if options.logging_level is not None:
            for name in _LOGGERS:
                logging.getLogger(name).setLevel(options.logging_level)
        self.caps = caps or backend.detect()
        check(options, self.caps)
        if save_dir is not None:  # fail now, not at the first save hours later
            preflight.check_writable(save_dir)
        self.process_group = process_group
        self.dp_group = dp_group
        self.reports: list[dict] = []
        self._closed = False
        self._pending: dict[int, SaveRecord | None] = {}
        self._planner = SavePlanner(options, dp_group=dp_group)
        self._seq = 0  # saves handed to a writer that waits on the ready flag
        self._froze_gc = False  # _freeze_gc froze (alone): close() unfreezes
        self.startup: dict[str, float] = {}
        self._before_commit: Callable[[SaveRecord], None] | None = None  # fault injection (tests)
        self._cpu_shim = _cpu_shim.install()
        self._async = options.async_save and self.caps.async_provider != "sync"
        self._cpu_shm = self._async and options.async_ckpt_use_cpu_shm
        self._stager = self._make_stager(job_id) if self._cpu_shm else None
        if self._stager is None:  # a stager sweeps itself; a crashed cpu-shm run's segments
            _sweep_shm_orphans()  # must not outlive the next start in another mode (issue 9)
        self._queue_started = time.perf_counter()
        self._queue = self._make_queue() if self._async else None
        t0 = time.perf_counter()
        self._prime_results_queue()
        self.startup["write_results_queue_s"] = round(time.perf_counter() - t0, 6)
        # --ckpt-overlap-snapshot: save() returns with the copies in flight; the next optimizer
        # step (a global torch.optim step pre-hook) makes the trainer's stream wait for them.
        self._overlap = bool(options.ckpt_overlap_snapshot and self._cpu_shm and self._persistent)
        self._snapshot: SaveRecord | None = None  # overlapped save the trainer has not waited for
        self._publisher: threading.Thread | None = None
        self._step_hook = None
        if self._overlap:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._step_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    # -- construction ------------------------------------------------------------------------
    def _make_queue(self) -> Any:
        o = self.options
        persistent = o.use_persistent_ckpt_worker and self.caps.queue_persistent
        if persistent:
            ok, reason = backend.persistent_worker_runs_here(self.caps, cpu_shm_mode=self._cpu_shm)
            if not ok:
                warn_once("persistent-cannot-run",
                          f"--use-persistent-ckpt-worker: {reason}; a fresh writer "
                          "process is used per save instead.")
                persistent = False
        self._persistent = persistent
        queue = backend.new_async_calls_queue(
            persistent=persistent, is_daemon=True, cpu_shm_mode=self._cpu_shm and persistent,
            cpu_priority=o.async_ckpt_cpu_priority, io_priority=o.async_ckpt_io_priority)
        # The worker needs no CUDA where nvrx honours cpu_shm_mode: then it is forked (ready in
        # ms, see backend.persistent_worker_forks); else spawned without re-importing __main__.
        no_cuda = self._cpu_shm and self.caps.worker_cpu_shm_skips_cuda
        if persistent:
            # The worker imports megatron-core's writer modules only when it unpickles the first
            # request (seconds, inside the first save: the trainer waits for its preload). A
            # warm-up request does that now; where nvrx has no warm-up call (0.4) it also starts
            # the worker. It is finalized by the first maybe_finalize (or the first save).
            warm = backend.async_request_cls()(async_fn=_warm_up, async_fn_args=(os.getpid(),),
                                               finalize_fns=[])
            with backend.persistent_worker_forks(queue, cpu_shm_mode=no_cuda) as forks, \
                    backend.spawn_skips_main():
                if forks:
                    self._freeze_gc()
                if self.caps.warmup_persistent_caller:
                    backend.call_with_supported(queue.warmup_persistent_caller, rank(),
                                                is_daemon=True, cpu_shm_mode=self._cpu_shm)
                self._pending[queue.schedule_async_request(warm)] = None
        return queue

    def _freeze_gc(self) -> None:
        """Before the persistent worker is forked: collect, then ``gc.freeze()`` what is left.

        The forked worker shares the trainer's pages copy-on-write. A full collection in the
        trainer writes to the header of every object it traverses, so each later one copied
        every page holding the trainer's objects, and the worker kept the old copies: ~100 MB
        more host memory from the first full collection on, and that collection took 0.23-0.29 s
        inside a save (measured on the H100, 8 GiB state, ``benchmarks/profile_save.py
        --mem-breakdown``). Frozen objects are skipped by collections; their refcounts still
        free them, only reference cycles among them are no longer collected until
        :meth:`close` unfreezes them. Garbage that exists now is collected first, so nothing
        unreachable is frozen. Where something else had frozen objects already (seen on the GPU
        stack), close() leaves them all frozen: Python can only unfreeze everything, which
        would undo that other freeze. ``MCX_FREEZE_GC_AT_FORK=0`` turns this off."""
        if env_switch("MCX_FREEZE_GC_AT_FORK") != "1":
            return
        t0 = time.perf_counter()
        self._froze_gc = gc.get_freeze_count() == 0  # ours alone: close() may unfreeze
        gc.collect()
        gc.freeze()
        self.startup["gc_freeze_s"] = round(time.perf_counter() - t0, 6)
        logger.debug("gc.freeze() of %d objects before forking the writer, %.3f s",
                     gc.get_freeze_count(), self.startup["gc_freeze_s"])

    def _make_stager(self, job_id: str | None) -> Any:
        from .staging import ShmStager

        return ShmStager(job_id=job_id or _job_id(), rank=rank(),
                         reuse=self.options.ckpt_assume_constant_structure)

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        """Until the staging allocation started by :meth:`prepare` is done (at most
        ``timeout_s``); whether it is. A save waits for it anyway: this is for timing start-up."""
        return self._stager is None or self._stager.wait_prepared(timeout_s)

    def prepare(self, sharded_state_dict: Any) -> None:
        """Optional, once the model and optimizer exist: allocate (and pin, on CUDA) the staging
        buffers for this state in a background thread, so the first save copies into ready
        memory instead of allocating on its critical path. Returns at once; a save meanwhile
        waits for it. Without cpu-shm staging there is nothing to prepare."""
        self._check_open()
        if self._stager is None:
            return
        tensors: list[Any] = []
        backend.map_sharded_tensors(sharded_state_dict, lambda t: tensors.append(t) or t)
        preflight.check_shm(sum(t.data.numel() * t.data.element_size() for t in tensors))
        self._stager.prepare([t.data for t in tensors], keys=[t.key for t in tensors],
                             background=True)

    # -- save --------------------------------------------------------------------------------
    def save(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike[str], *,
             iteration: int) -> None:
        """Save ``sharded_state_dict`` as ``<checkpoint_dir>/iter_{iteration:07d}``.

        Returns once the state is staged when async (call :meth:`maybe_finalize` regularly);
        returns after the commit when sync.
        """
        self._check_open()
        started = time.perf_counter()
        if self._snapshot is not None:
            warn_once(
                "overlap-not-waited",
                f"--ckpt-overlap-snapshot: save {iteration} started before anything waited for "
                f"the previous save's copies (iteration {self._snapshot.iteration}); if the "
                "state changed in between, that checkpoint may hold some new values. Step a "
                "torch.optim optimizer (its pre-hook waits) or call "
                "Checkpointer.wait_for_snapshot() before changing the state.")
            self.wait_for_snapshot(blocking=True)
        if self._pending:
            # One save in flight at a time, as Megatron-LM does: the backends' write-results
            # queue is one global queue, so a second request's results could be taken for the
            # first's (a wrong or missing entry once the structure changes).
            self.maybe_finalize(blocking=True)
        self._ready_writers(iteration, Path(checkpoint_dir))
        record = SaveRecord(iteration=iteration, root=Path(checkpoint_dir), started=started,
                            mode=self._mode())
        t = record.phase("wait_previous_s", started)
        structure = self._planner.key(sharded_state_dict)
        plain = backend.plain_tensors(sharded_state_dict)
        workdir = self._prepare_dir(record, new_structure=self._planner.is_new(structure),
                                    plain=plain)
        self._planner.use(structure, record)
        if self.reports and rank() == 0:
            preflight.check_disk(record.root, self.reports[-1]["bytes"])
        state = copy_structure(sharded_state_dict)
        t = record.phase("prepare_dir_s", t)
        if self._async:
            self._stage(state, record)
        else:
            record.nbytes = state_bytes(state)
        t = record.phase("stage_s", t)
        request = self._request(state, workdir, record)
        t = record.phase("plan_s", t)
        if self._async:
            request.add_finalize_fn(lambda: self._commit(record))
            with backend.unblock_hand_over_if_worker_dies(self._queue, poll_s=_POLL_S), \
                    forks_die_with_this_process():
                call_idx = self._queue.schedule_async_request(request)
            self._pending[call_idx] = record
            del request, state
            t = record.phase("schedule_s", t)
            # The copies ran while megatron-core planned and the writer took the request; it
            # writes once they are published complete (staging.run_when_staged).
            if self._overlap and record.seq:
                self._publish_in_background(record)  # returns with the copies in flight
            else:
                self._publish_staged(record)
            record.phase("copy_wait_s", t)
            trace_event(env_switch("MCX_WRITER_TRACE"), "scheduled", rank=rank(),
                        iteration=record.iteration)
        else:
            request.execute_sync()
            del request, state
            record.phase("write_commit_s", t)  # before _commit, which reports the phases
            self._commit(record)
        record.blocking_s = time.perf_counter() - record.started

    def _mode(self) -> str:
        if not self._async:
            return "sync"
        worker = "persistent" if self._persistent else "temporal"
        return (f"async-{worker}" + ("-cpu-shm" if self._cpu_shm else "")
                + ("-overlap" if self._overlap else ""))

    # -- overlapped snapshot (--ckpt-overlap-snapshot) ----------------------------------------
    def wait_for_snapshot(self, *, blocking: bool = False) -> None:
        """Before the state changes after an overlapped save: make the current CUDA stream wait
        until that save's device-to-host copies are done (no host synchronisation; the
        optimizer step queued next runs after them). ``blocking=True`` also waits on the host
        until they are done and published to the writer. Called by the optimizer step
        pre-hook; a no-op when no overlapped copies are pending. Idempotent."""
        record, self._snapshot = self._snapshot, None
        if record is not None:
            for copies in record.copies:
                copies.order_before_current_stream()
        if blocking:
            self._join_publisher()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._snapshot is not None:
            self.wait_for_snapshot()

    def _publish_in_background(self, record: SaveRecord) -> None:
        """Publish ``record``'s staged copies to its writer from a thread once they are done;
        save() returns meanwhile. The trainer's stream waits for them at the next optimizer
        step (:meth:`wait_for_snapshot`). A failure of the copies is published too (the writer
        writes nothing, the save is reported failed at its finalize) and logged here."""
        record.copies = record.staged.copies_in_flight()  # a StagedBatch: overlap needs cpu-shm
        self._join_publisher()
        self._snapshot = record

        def publish() -> None:
            try:
                self._publish_staged(record)
            except BaseException as e:  # noqa: BLE001 - the writer was told; reported there
                logger.error("checkpoint iteration %d: staging copies failed, nothing will be "
                             "written: %s: %s", record.iteration, type(e).__name__, e)

        self._publisher = threading.Thread(target=publish, name="mcx-snapshot-publish",
                                           daemon=True)
        self._publisher.start()

    def _join_publisher(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.join()

    def _prepare_dir(self, record: SaveRecord, *, new_structure: bool,
                     plain: list[tuple[str, Any]] = ()) -> Path:
        """Rank 0 creates the save's working directory; every rank learns whether it could (one
        small all-reduce in place of a barrier), so an unwritable root is an error on every rank
        before anything is staged, not rank 0 alone dying while the others wait. The same
        all-reduce tells every rank whether any rank's state structure is new (sets
        ``record.new_structure``): validating it and re-planning are collectives, so all ranks
        must decide alike. A plain tensor in any rank's state (``plain``) fails the save on every
        rank before anything is written."""
        workdir = incomplete_name(record.root, record.iteration)
        error: OSError | None = None
        plain_large = [(k, t) for k, t in plain if t.numel() > 1]
        if rank() == 0 and not plain_large:
            if checkpoint_name(record.root, record.iteration).exists():
                logger.warning("checkpoint iteration %d under %s is already committed: this save "
                               "replaces it (atomically, at its commit)", record.iteration,
                               record.root)
            try:
                record.root.mkdir(parents=True, exist_ok=True)
                if workdir.exists():
                    shutil.rmtree(workdir)
                workdir.mkdir()
            except OSError as e:
                error = e
        failed, changed, bad_rank = self._all_max(
            [1.0 if error is not None else 0.0, float(new_structure),
             float(rank()) if plain_large else -1.0])
        record.new_structure = bool(changed)
        if bad_rank >= 0:
            if rank() == 0 and workdir.exists() and error is None:
                shutil.rmtree(workdir, ignore_errors=True)
            raise ValueError(_plain_tensor_message(record.iteration, plain_large, int(bad_rank)))
        if failed:
            cause = f" ({type(error).__name__}: {error})" if error is not None else " (see rank 0)"
            raise CheckpointWriteError(
                f"checkpoint iteration {record.iteration}: cannot create {workdir} on rank 0"
                f"{cause}. Nothing was written. Fix: point the checkpoint directory (--save) at a "
                "writable directory.") from error
        return workdir

    def _stage(self, state: Any, record: SaveRecord) -> None:
        """Replace every tensor by a CPU copy owned by this save (see the module docstring)."""
        t0 = time.perf_counter()
        tensors: list[Any] = []
        backend.map_sharded_tensors(state, lambda t: tensors.append(t) or t)
        if self._stager is not None:
            if self._stager.host_bytes() == 0:  # first staging: fail early, not with SIGBUS
                preflight.check_shm(sum(t.data.numel() * t.data.element_size() for t in tensors))
            # Device copies are only issued here: save() plans while they run (_request) and
            # waits for them before the writer may read a byte (_wait_staged).
            batch = self._stager.stage([t.data for t in tensors], keys=[t.key for t in tensors],
                                       wait=False)
            copies = list(batch.tensors)
            record.staged = batch
        else:
            copies = [t.data.detach().to("cpu", copy=True) for t in tensors]
            record.staged = copies
        record.snapshots = frozenset(c.untyped_storage().data_ptr() for c in copies)
        swap = iter(copies)
        backend.map_sharded_tensors(state, lambda t: replace(t, data=next(swap)))
        record.nbytes = sum(c.numel() * c.element_size() for c in copies)
        record.host_bytes = (self._stager.host_bytes() if self._stager is not None
                             else record.nbytes)
        record.staging_s = time.perf_counter() - t0

    def _publish_staged(self, record: SaveRecord) -> None:
        """Wait for this save's copies, then tell its writer (the ready flag); on failure tell
        it to write nothing, and raise."""
        try:
            self._wait_staged(record)
        except BaseException:
            if record.seq:
                self._stager.ready_flag()[0] = -record.seq
            raise
        if record.seq:
            self._stager.ready_flag()[0] = record.seq

    def _wait_staged(self, record: SaveRecord) -> None:
        """Until this save's staged copies are in host memory; staging_s then covers the
        copies, not the planning that overlapped them. Idempotent."""
        batch = record.staged
        from .staging import StagedBatch

        if isinstance(batch, StagedBatch):
            batch.wait()
            record.staging_s = batch.copy_s if batch.copy_s is not None else batch.staging_s

    def _request(self, state: Any, workdir: Path, record: SaveRecord) -> Any:
        """megatron-core's save request. Planning reads only the staged tensors' metadata, so it
        runs while their device copies are in flight; this save's staged copies
        (``record.snapshots``) need not be cloned again by the writer. Where that clone is kept
        (``MCX_KEEP_WRITER_CLONES=1``), it reads the bytes: the copies are waited for first."""
        dc = backend.dist_checkpointing()
        snapshots = record.snapshots
        with backend.writer_keeps_snapshots(
                lambda t: t.untyped_storage().data_ptr() in snapshots) as keeps:
            if not keeps and backend.writer_clones_cpu_tensors():
                self._wait_staged(record)
            request = dc.save(state, str(workdir), self._planner.strategy(),
                              async_sharded_save=True,
                              validate_access_integrity=record.new_structure)
        if self._async and self._persistent and request.async_fn is None:
            # Nothing to write on this rank (no tensors, or all written by other replicas): the
            # persistent worker reports only requests it runs, so give it one that does nothing.
            request = request._replace(async_fn=_nothing_to_write, async_fn_args=(),
                                       async_fn_kwargs={})
        request = backend.without_host_preload(request)
        request = strategy.sequential_request(request, self.options)
        request = strategy.crc_free_request(request)
        request = strategy.page_cache_free_request(request)
        trace = env_switch("MCX_WRITER_TRACE")
        if trace:
            request = traced_request(request, trace, rank=rank())
        if self._cpu_shim:
            request = strategy.cpu_request(request)
        if self._async and self._stager is not None and request.async_fn is not None:
            request = self._after_staging(request, record)
        return backend.adapt_async_request(request) if self._async else request

    def _after_staging(self, request: Any, record: SaveRecord) -> Any:
        """``request`` whose write first waits for this save's staged copies to be published
        (outermost wrapper: nothing of the write runs before)."""
        from .staging import run_when_staged

        self._seq += 1
        record.seq = self._seq
        return request._replace(async_fn=partial(
            run_when_staged, self._stager.ready_flag(), record.seq,
            float(self.options.ckpt_timeout), request.async_fn))

    # -- commit ------------------------------------------------------------------------------
    def _commit(self, record: SaveRecord) -> None:
        """Collective: make ``record``'s checkpoint visible and name it in the tracker."""
        if self._before_commit is not None:
            self._before_commit(record)
        ranks = self._gather_stats(record)  # also the commit's first barrier
        if rank() == 0:
            commit_on_disk(record.root, record.iteration)
        self._barrier()
        trace_event(env_switch("MCX_WRITER_TRACE"), "committed", rank=rank(),
                    iteration=record.iteration)
        self._release(record)
        self._report(record, ranks)

    def _release(self, record: SaveRecord) -> None:
        if record.staged is not None and hasattr(record.staged, "release"):
            record.staged.release()
        record.staged = None

    def _gather_stats(self, record: SaveRecord) -> dict:
        """Max over ranks of this save's times and sizes, and the sum of its bytes: one small
        all-reduce that replaces the commit's first barrier (so no extra synchronisation)."""
        now = time.perf_counter()
        local = record.local_stats(now)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return {"max": local, "bytes_total": record.nbytes, "world": 1, "at": now}
        group, device = self.process_group, self._collective_device()
        stats = torch.tensor(local, dtype=torch.float64, device=device)
        total = torch.tensor([float(record.nbytes)], dtype=torch.float64, device=device)
        self._wait(torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX,
                                                group=group, async_op=True))
        self._wait(torch.distributed.all_reduce(total, group=group, async_op=True))
        return {"max": stats.tolist(), "bytes_total": int(total.item()),
                "world": torch.distributed.get_world_size(group), "at": now}

    def _report(self, record: SaveRecord, ranks: dict) -> None:
        entry = report_entry(record, ranks, is_async=self._async)
        self.reports.append(entry)
        log_report(record, entry, ranks)

    # -- finalize / load / close -------------------------------------------------------------
    def maybe_finalize(self, *, blocking: bool = False) -> list[int]:
        """Collective on every rank: commit the async saves all ranks have finished (all pending
        ones when ``blocking``). Returns the iterations committed by this call.

        Raises :class:`CheckpointWriteError` on every rank when any rank's writer died, its
        write failed, or the save is older than ``--ckpt-timeout`` seconds."""
        committed: list[int] = []
        while self._queue is not None and self._pending:
            if self._agree_on_writers():  # some rank's writer is still writing
                if not blocking:
                    break
                time.sleep(_POLL_S)
                continue
            committed += self._finalize_finished()
            if not blocking:
                break
        return committed

    def _finalize_finished(self) -> list[int]:
        """Every rank's head writer has finished: run the queue's finalization (megatron-core's
        metadata write and our commit, collectives) for what is done."""
        before = self._queue.get_num_unfinalized_calls()
        try:
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
        except (KeyboardInterrupt, SystemExit):
            raise
        # a write that raised: the backend raises it on every rank, as torch's CheckpointException
        # (a BaseException, not an Exception) from nvrx 0.7's finalize, else as a RuntimeError
        except BaseException as e:  # noqa: BLE001
            raise self._abandon(
                f"its write or commit failed: {backend.checkpoint_failure_text(e)}") from e
        # Count, do not trust the returned indices: nvrx 0.4-0.7 return each request's own
        # call_idx, which the queue never sets (always 0). Calls finalize in schedule order.
        finished = before - self._queue.get_num_unfinalized_calls()
        records = [self._pending.pop(idx) for idx in list(self._pending)[:finished]]
        return [r.iteration for r in records if r is not None]  # None: the worker's warm-up

    def _agree_on_writers(self, before: tuple[int, Path] | None = None) -> bool:
        """Collective: True while some rank's writer is still running. Raises on every rank
        when any rank's writer died or ran past the timeout (``before``: the save about to
        start, for the message)."""
        state, detail = backend.async_writer_state(self._queue)
        timed_out = state == "running" and time.perf_counter() > self._head_deadline()
        dead = state == "dead"
        local = [float(state == "running"), float(dead), float(timed_out),
                 float(rank() if dead or timed_out else -1)]
        running, any_dead, any_late, which = self._all_max(local)
        if any_dead or any_late:
            why = (f"the async writer of rank {int(which)} stopped before finishing its write"
                   if any_dead else f"it did not finish within --ckpt-timeout {self.options.ckpt_timeout}"
                   f" s (config key 'ckpt_timeout'; raise it if writes are legitimately this slow)")
            raise self._abandon(why + (f" ({detail})" if detail else ""), before=before)
        return bool(running)

    def _all_max(self, values: list[float]) -> list[float]:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        self._wait(torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                                group=self.process_group, async_op=True))
        return t.tolist()

    def _wait(self, work: Any) -> None:
        """Wait for one of our collectives, at most ``--distributed-timeout-minutes`` when set
        (else the process group's own timeout). Every caller reads the result on the host next,
        so the bounded wait adds no synchronisation."""
        timeout = self.options.distributed_timeout()
        if timeout is None:
            work.wait()
            return
        try:
            work.wait(timeout=timeout)
        except RuntimeError as e:
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise  # a peer that crashed: the backend's own message says so
            raise CheckpointWriteError(
                "a checkpoint collective did not complete within --distributed-timeout-minutes "
                f"{self.options.distributed_timeout_minutes} (config key "
                "'distributed_timeout_minutes'): some rank stopped calling save() or "
                f"maybe_finalize() ({e}).") from e

    def _collective_device(self) -> torch.device:
        """Where this group's small collectives run: the current CUDA device for NCCL (only an
        NCCL group gets here, so CUDA is initialised), else the CPU."""
        if torch.distributed.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _head_deadline(self) -> float:
        record = next(iter(self._pending.values()), None) if self._pending else None
        started = record.started if record is not None else self._queue_started
        return started + self.options.ckpt_timeout

    def _ready_writers(self, iteration: int, root: Path) -> None:
        """Before a save: a new queue when the last one was abandoned; with a persistent worker,
        agree that every rank's worker is alive (a dead one would block the hand-over forever)."""
        if not self._async:
            return
        if self._queue is None:
            self._queue_started = time.perf_counter()
            self._queue = self._make_queue()
        elif self._persistent:
            self._agree_on_writers(before=(iteration, root))

    def _abandon(self, why: str, *, before: tuple[int, Path] | None = None) -> CheckpointWriteError:
        """Stop this rank's writers, drop the pending saves, and say what happened."""
        record = next((r for r in self._pending.values() if r is not None), None)
        if record is not None:
            what, root = f"checkpoint iteration {record.iteration} under {record.root}", record.root
        elif before is not None:
            what, root = f"checkpoint iteration {before[0]} under {before[1]} (before it started)", before[1]
        else:
            what, root = "the persistent checkpoint writer's start-up", None
        latest = tracker_text(root) if root is not None else ""
        needed = max([record.nbytes if record is not None else 0]
                     + [r.get("bytes", 0) for r in self.reports[-1:]])
        space = preflight.disk_full_hint(root, needed) if root is not None else ""
        self._kill_writers()
        return CheckpointWriteError(
            f"{what} failed on every rank: {why}.{space} The save is abandoned{latest}; the async "
            "writers are restarted at the next save()."
        )

    def _kill_writers(self) -> None:
        queue, self._queue = self._queue, None
        if queue is not None:
            backend.stop_async_writers(queue)
        for record in self._pending.values():
            if record is not None:
                self._release(record)
        self._pending.clear()
        # Other ranks' finished writers left their results in the global write-results queue,
        # where the next save would read them as its own: start a fresh queue.
        backend.shutdown_write_results_queues()
        self._prime_results_queue()

    def _prime_results_queue(self) -> None:
        with forks_die_with_this_process():  # the Manager server dies with this trainer
            backend.prime_write_results_queue()

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike[str], *,
             iteration: int | None = None) -> dict | None:
        """Load the committed checkpoint named by the tracker (or ``iteration``) into
        ``sharded_state_dict`` and return the loaded state dict.

        Where ``checkpoint_dir`` holds no committed checkpoint (no tracker: a missing or empty
        directory), returns None after a rank-0 warning, as Megatron-LM starts from scratch;
        with ``--exit-on-missing-checkpoint`` raises FileNotFoundError instead."""
        path = locate(checkpoint_dir, iteration=iteration,
                      exit_on_missing=self.options.exit_on_missing_checkpoint)
        if path is None:
            return None
        load_strategy = strategy.load_strategy(self.options, dp_group=self.dp_group, caps=self.caps)
        return backend.dist_checkpointing().load(sharded_state_dict, str(path), load_strategy)

    def close(self) -> None:
        """Drain pending saves, stop the worker, free staging buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        drained = False
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._snapshot = None
        try:
            self._join_publisher()  # its copies land before the buffers can be freed
            self.maybe_finalize(blocking=True)
            drained = True
        finally:
            if self._queue is not None:
                if drained and backend.async_writer_state(self._queue)[0] != "dead":
                    self._queue.close()
                    self._queue = None
                else:  # the queue's own close would wait for a dead or unfinished writer
                    self._kill_writers()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            backend.shutdown_write_results_queues()
            self._pending.clear()
            self._planner.reset()
            if self._froze_gc:
                self._froze_gc = False
                gc.unfreeze()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Checkpointer is closed")

    def _barrier(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self._wait(torch.distributed.barrier(group=self.process_group, async_op=True))


# -- helpers -----------------------------------------------------------------------------------
def _sweep_shm_orphans() -> None:
    from .spool import sweep_stale
    from .staging import sweep_orphans

    try:
        sweep_orphans()
        sweep_stale()
    except OSError as e:  # best effort: a start-up must not fail over another run's files
        logger.debug("shm orphan sweep: %s", e)


def _warm_up(trainer_pid: int | None = None) -> None:
    """The persistent worker's first request: ties the worker's life to its trainer's, then
    imports what unpickling a save request needs."""
    if trainer_pid is not None:
        die_with_parent(trainer_pid)
    backend.warm_up_writer_imports()


def _job_id() -> str:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or str(os.getppid())


def _nothing_to_write(*args: Any, **kwargs: Any) -> None:
    """The write of a rank that has nothing to write (module level: it is pickled)."""


def _plain_tensor_message(iteration: int, plain: list[tuple[str, Any]], bad_rank: int) -> str:
    if not plain:
        return (f"checkpoint iteration {iteration}: rank {bad_rank}'s state dict holds plain "
                "torch tensors (see that rank's error for their keys). Nothing was written.")
    key, t = plain[0]
    more = f" (and {len(plain) - 1} more: {[k for k, _ in plain[1:4]]})" if len(plain) > 1 else ""
    return (
        f"checkpoint iteration {iteration}: '{key}' is a plain torch.Tensor of shape "
        f"{tuple(t.shape)}{more}, not a megatron-core ShardedTensor. megatron-core would save "
        "it as common state from rank 0 alone, dropping every other rank's values. Nothing was "
        "written. Fix: wrap it, e.g. ShardedTensor.from_rank_offsets(key, t, replica_id=dp_rank) "
        "for a tensor replicated over data-parallel ranks, or ShardedTensor.from_rank_offsets("
        "key, t, (axis, rank, world_size)) for one split along an axis. Plain Python numbers and "
        "one-element tensors stay common state.")
