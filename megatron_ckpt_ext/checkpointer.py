"""The checkpoint lifecycle a training loop sees: prepare, save, maybe_finalize, load, close.

:class:`Checkpointer` only wires the roles together (docs/ARCHITECTURE.md):

* a stager (``staging/``: shared memory, plain CPU copies, or none for sync saves) copies the
  state into host memory owned by the save;
* the planner (``save/planner.py``) keeps megatron-core's save strategy while the structure holds;
* the write path (``save/write_path.py``) changes megatron-core's request in one ordered list;
* the writer pool (``save/writers.py``) runs it and agrees over ranks on the writers' state;
* the layout (``save/layout.py``) writes under ``iter_N.incomplete`` and commits (rank 0 renames
  it ``iter_N``, rewrites the tracker atomically: a crash before leaves the previous the latest);
* the report (``save/report.py``) and the load path (``load/``).

The steps of :meth:`Checkpointer.save` after staging (plan, hand over, commit) and the failure
policy are methods of the class, kept in ``save/steps.py``; tests and harnesses act on a save
through :class:`~megatron_ckpt_ext.hooks.SaveHooks`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from . import _cpu_shim, backend, preflight, strategy
from ._runtime import Recent, rank, show_our_logs
from .collectives import Group
from .debug import env_switch, profiled
from .errors import CheckpointWriteError, InsufficientHostMemory
from .hooks import SaveHooks, chain, writer_trace
from .load import locate, refuse_plain_targets
from .load.loader import Loader, read_ahead
from .load.memory import (discard_snapshot, release_warm_restore, restore_from_memory,
                          tensor_layout, warm_restore)
from .load.report import LoadRecord, log_load
from .options import CkptOptions
from .save.joblock import JobLock
from .save.layout import TRACKER, checkpoint_name, iteration_number, read_tracker
from .save.planner import SavePlanner, copy_leaves, copy_structure
from .save.publish import Publisher
from .save.report import SaveRecord, gc_pauses
from .save.retention import Retention, finish_interrupted
from .preempt import Preemption
from .save.stage import choose_stager
from .save.steps import _SaveSteps
from .save.sync_points import sync_points
from .save.writers import WriterPool
from .staging.base import Stager
from .staging.partner import partner_link
from .validation import check

__all__ = ["Checkpointer", "TRACKER", "checkpoint_name", "read_tracker"]

logger = logging.getLogger(__name__)

_LOGGERS = ("megatron_ckpt_ext", "megatron")  # what --logging-level sets


class Checkpointer(_SaveSteps):
    """Save / load megatron-core sharded state dicts with the options' strategies.

    ``process_group`` is used for the commit barriers (default: the world), ``dp_group`` for the
    fully-parallel save/load wrappers; ``save_dir``, when given, is checked for writability and
    its job lock taken here (else at the first save into a directory: one job per directory);
    ``hooks`` act at the points of a save (:mod:`megatron_ckpt_ext.hooks`). ``stager``, when
    given, replaces the one the options choose (``save/stage.py``): a
    :class:`~megatron_ckpt_ext.staging.Stager` of the kind they call for (with
    ``--async-ckpt-use-cpu-shm`` a ``ShmStager`` or subclass built with ``reuse`` equal to
    ``--ckpt-assume-constant-structure``; for other async saves one that owns its copies; for
    sync saves one that copies nothing), else ``ValueError`` naming the option; the Checkpointer
    closes it at :meth:`close`; ``job_id`` names the default one's segments. Construction
    validates the options against the installed backend (raising on errors, warning once on
    rank 0), starts the persistent worker and the writers' write-results queue."""

    def __init__(self, options: CkptOptions, *, process_group: Any = None, dp_group: Any = None,
                 caps: backend.Capabilities | None = None, job_id: str | None = None,
                 save_dir: str | os.PathLike[str] | None = None,
                 hooks: SaveHooks | None = None, stager: Stager | None = None) -> None:
        self.options = options
        if options.logging_level is not None:
            for name in _LOGGERS:
                logging.getLogger(name).setLevel(options.logging_level)
            show_our_logs()
        self.caps = caps or backend.detect()
        check(options, self.caps)
        self._async = options.async_save and self.caps.async_provider != "sync"
        cpu_shm = self._async and options.async_ckpt_use_cpu_shm
        # before the job lock is taken: a passed stager of the wrong kind raises here
        self._stager = choose_stager(is_async=self._async, cpu_shm=cpu_shm, job_id=job_id,
                                     reuse=options.ckpt_assume_constant_structure, given=stager,
                                     snapshot_sets=options.ckpt_memory_snapshot_sets)
        if save_dir is not None:  # fail now, not at the first save hours later
            preflight.check_writable(save_dir)
        self.process_group, self.dp_group = process_group, dp_group
        self.reports: list[dict] = Recent()  # the last Recent.KEPT saves' (and loads')
        self.load_reports: list[dict] = Recent()
        self._closed, self.prepare_at_load, self.pin_at_load = False, True, True  # (load())
        self._group = Group(process_group, options)
        self._joblock = JobLock(self._group)  # one job per save directory (save/joblock.py)
        if save_dir is not None:  # (C) a second job on this directory fails here
            self._joblock.hold(save_dir)
        self._hooks = chain(hooks or SaveHooks(), writer_trace(rank()))
        self._planner = SavePlanner(options, dp_group=dp_group)
        self._cpu_shim = _cpu_shim.install()
        self._cpu_shm = cpu_shm
        self._partner = partner_link(self._stager) if (  # --ckpt-memory-partner
            options.ckpt_memory_partner and self._memory_tier) else None
        self.admission: dict | None = None  # the first staging's node admission (preflight)
        self._writers = WriterPool(options, self.caps, self._group, cpu_shm=cpu_shm,
                                   is_async=self._async, reports=self.reports)
        self.startup = self._writers.startup
        overlap = bool(options.ckpt_overlap_snapshot and cpu_shm and self._writers.persistent)
        self._publisher = Publisher(self._stager, self._hooks, overlap=overlap,
                                    on_step=lambda: self.wait_for_snapshot())
        self._mode = _mode(self._async, self._writers.persistent, cpu_shm, overlap)
        self._retention = Retention(options.most_recent_k, options.save_retain_interval)
        if save_dir is not None and self._retention.active and rank() == 0:
            finish_interrupted(Path(save_dir))  # deletions a crash interrupted
        self._roots_saved: set[Path] = set()
        self._layout: list | None = None  # the staged tensors' layout (memory tier), per structure
        self.failed_saves: list[dict] = Recent()  # --ckpt-failure-policy warn: what was abandoned
        self._failures_in_a_row = 0
        self._preemption = Preemption(options) if options.exit_signal_handler else None

    def prepare(self, sharded_state_dict: Any, *, preprocess_common: Any = None) -> None:
        """Optional, once the model and optimizer exist: allocate (and pin, on CUDA) the staging
        buffers for this state in a background thread, so the first save copies into ready
        memory; then, in the same thread, megatron-core's conversions and planning of the first
        save (:meth:`SavePlanner.plan_ahead`). Returns at once; a save meanwhile waits for it.
        Only the shared-memory stager prepares. ``preprocess_common``: as :meth:`save`'s."""
        self._check_open()
        self._planner.keep_common_check(preprocess_common)
        tensors: list[Any] = []
        backend.map_sharded_tensors(sharded_state_dict, lambda t: tensors.append(t) or t)
        self._admit(tensors)
        self._ahead_of_prepared(tensors)
        state = copy_structure(sharded_state_dict)
        group = self._planner.ahead_group(self._group) if self._stager.owns_copies else None
        if group is None:  # (C) megatron-core's own check now; else first in the thread below
            self._planner.validate_ahead(sharded_state_dict, self._group)

        def ahead(staged: list) -> None:  # in the allocation's thread, once it is done
            backend.writer_clones_cpu_tensors()  # read from the writer's source once, now
            self._hand_over_ahead(self._planner.ahead(state, staged, group))

        self._stager.prepare([t.data for t in tensors], keys=[t.key for t in tensors],
                             background=True, then=ahead)

    def prepare_restore(self, checkpoint_dir: str | os.PathLike, *, early: bool = False) -> bool:
        """Optional, before :meth:`load` of ``checkpoint_dir`` (``early``: seconds before the model
        build), threads map, sum and pin this rank's sealed snapshot of it where this node holds
        one (the memory tier, docs/MEMORY.md; whether that started: returned), else pin the
        storage read's host chunks (CUDA). The load takes what was made, or releases it."""
        self._check_open()
        memory = self._memory_tier and warm_restore(self._stager, Path(checkpoint_dir),
                                                    self.options.ckpt_restore_prefetch, early)
        read_ahead(self.options, Path(checkpoint_dir), pin_chunks=not memory)
        return memory

    def _admit(self, tensors: list[Any]) -> None:
        """Collective, once (the first save or :meth:`prepare`): node-level admission of what
        this rank will stage (:func:`preflight.admit_node`). Synchronous saves stage nothing."""
        if self.admission is not None or not self._stager.owns_copies:
            return
        if self._partner is not None and self._partner.book is None:
            self._partner.connect(self._group.all_gather)  # (C) the addresses, once
        copies = self._partner is not None and self._partner.partner is not None
        nbytes = sum(t.data.numel() * t.data.element_size() for t in tensors)
        nbytes *= getattr(self._stager, "snapshot_sets", 1) + copies  # + a partner's copy
        kept = self._stager.host_bytes()  # a snapshot adopted at load: staged into from now on
        try:
            limit = self.options.ckpt_node_memory_limit_mib
            self.admission = preflight.admit_node(
                max(0, nbytes - kept), shm=self._cpu_shm, gather=self._group.all_gather,
                limit_bytes=None if limit is None else limit * 2**20, kept=kept)
        except InsufficientHostMemory as e:  # raised on every rank alike: all decide the same
            if self.options.ckpt_node_memory_fallback != "sync":
                raise
            self._fall_back_to_sync(str(e))

    def _fall_back_to_sync(self, why: str) -> None:
        """--ckpt-node-memory-fallback sync: stop the async writers, free the staging, and save
        synchronously from now on (nothing staged)."""
        self._publisher.close()
        self._writers.close(drained=False)
        if self._partner is not None:
            self._partner.close()
            self._partner = None
        self._stager.close()
        self._async = self._cpu_shm = False
        self._stager = choose_stager(is_async=False, cpu_shm=False, job_id=None,
                                     reuse=self.options.ckpt_assume_constant_structure)
        self._writers = WriterPool(self.options, self.caps, self._group, cpu_shm=False,
                                   is_async=False, reports=self.reports)
        self.startup = self._writers.startup
        self._publisher = Publisher(self._stager, self._hooks, overlap=False,
                                    on_step=lambda: self.wait_for_snapshot())
        self._mode = _mode(False, False, False, False)
        self.admission = {"fallback": "sync", "why": why}
        if rank() == 0:
            logger.warning("--ckpt-node-memory-fallback sync: saving synchronously from now on, "
                           "since %s Each save now blocks for its whole write (its report's "
                           "blocking_s).", why.split(" Fix: ")[0])

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        """Until the staging allocation started by :meth:`prepare` is done (at most
        ``timeout_s``); whether it is. A save waits for it anyway: this is for timing start-up."""
        return self._stager.wait_prepared(timeout_s)

    def staging_stats(self) -> dict:
        """A copy of the stager's counters (``allocations``, ...; empty where none stages)."""
        return dict(getattr(self._stager, "stats", None) or {})

    @property
    def idle(self) -> bool:
        """No save is waiting to be finalized (nor the persistent worker's start-up request)."""
        return self._writers.idle

    # -- save --------------------------------------------------------------------------------
    def save(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike[str], *,
             iteration: int, preprocess_common: Any = None) -> None:
        """Save ``sharded_state_dict`` as ``<checkpoint_dir>/iter_{iteration:07d}`` (see
        :meth:`_save` for the steps); under ``MCX_PROFILE_SAVES`` profiled (docs/DEBUGGING.md).
        ``preprocess_common``: megatron-core's ``preprocess_common_before_consistancy_check``
        (kept for later saves; Megatron-LM's drops the common keys that differ by rank)."""
        self._planner.keep_common_check(preprocess_common)
        folder = env_switch("MCX_PROFILE_SAVES")
        if folder:
            profiled(folder, f"save iteration {iteration}", rank(), self._save,
                     sharded_state_dict, checkpoint_dir, iteration=iteration)
        else:
            self._save(sharded_state_dict, checkpoint_dir, iteration=iteration)

    def _save(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike[str], *,
              iteration: int) -> None:
        """Save ``sharded_state_dict`` as ``<checkpoint_dir>/iter_{iteration:07d}``.

        Steps ((C): a collective every rank makes, in this order):

        1. (C) finish the previous save: an overlapped one's copies, then its commit; ready the
           writers (a new queue after an abandoned save; with a persistent worker, agree that
           every rank's is alive).
        2. (C) rank 0 opens ``iter_N.incomplete``; all agree whether it could, whether any
           rank's structure is new and whether any rank holds a plain tensor.
        3. stage: issue the device-to-host copies into memory owned by this save ((C) before the
           first staging: node-level admission, :func:`preflight.admit_node`). A steady async
           save (this rank's structure unchanged) stages before step 2 instead, so its copies
           run while the directory opens; a failed open gives its buffers back.
        4. plan: megatron-core's save request ((C) when the structure is new: it validates the
           sharding), changed by the write path; (C) all agree whether rank 0 could write the
           common state (a failure fails every rank alike, as each finalization step does).
        5. hand over: async, schedule it on the writer and publish the copies once they landed
           (save() returns; :meth:`maybe_finalize` commits); sync, write and (C) commit now.
        """
        self._check_open()
        iteration = iteration_number(iteration)  # an int-like one as an int; else a ValueError
        self._joblock.hold(checkpoint_dir)  # (C) the first save into a root takes its lock
        if self._preemption is not None:  # the first save started after the signal is the exit's
            self._preemption.save_started(iteration, self._group)
        record = SaveRecord(iteration=iteration, root=Path(checkpoint_dir),
                            started=time.perf_counter(), mode=self._mode)
        folder = env_switch("MCX_SYNC_POINTS")
        with gc_pauses(record, defer=env_switch("MCX_GC_IN_SAVE") != "1"):  # (report.py)
            if folder:  # where the blocking phases wait for the device (docs/DEBUGGING.md)
                with sync_points(folder, f"save iteration {iteration}", rank(), record):
                    self._save_steps(sharded_state_dict, record)
            else:
                self._save_steps(sharded_state_dict, record)

    def _save_steps(self, sharded_state_dict: Any, record: SaveRecord) -> None:
        if self._cpu_shm and record.root not in self._roots_saved:  # an earlier run's snapshot
            self._roots_saved.add(record.root)  # of this root that no load adopted: freed
            discard_snapshot(self._stager, record.root)  # before this run stages (prepare()d)
        self._finish_previous(record)
        t = record.phase("wait_previous_s", record.started)
        self._stager.wait_prepared()  # a prepare() at work: its allocations are not this save's
        t = record.phase("wait_prepare_s", t)
        before = self.staging_stats()
        staged = self._stage_first(sharded_state_dict, record, before)  # a steady save's
        if staged is not None:
            t = record.phase("stage_s", t)
        state, workdir = self._open(sharded_state_dict, record, staged=staged)
        if self._memory_tier:  # what the snapshot holds, for a restart to match: walked again
            if record.new_structure or self._layout is None:  # only when the structure changed
                self._layout = tensor_layout(state)
            record.extra["layout"] = self._layout
        t = record.phase("prepare_dir_s", t)
        if staged is None:
            t = self._stage_after_open(state, record, before, t)
        request = self._plan(state, workdir, record)
        del state
        if request is None:  # failed on every rank, under --ckpt-failure-policy warn
            return
        t = record.phase("plan_s", t)
        self._hand_over(request, record, t)
        record.blocking_s = time.perf_counter() - record.started

    def _stage_after_open(self, state: Any, record: SaveRecord, before: dict, t: float) -> float:
        """Stage once the directory is open: a new structure, or (C) the first staging, which
        runs the node admission first."""
        if self.admission is None and self._stager.owns_copies:  # (C) the first staging
            tensors: list[Any] = []
            backend.map_sharded_tensors(state, lambda x: tensors.append(x) or x)
            self._admit(tensors)
            record.mode = self._mode  # sync after a node-memory fallback
            record.detail["admit_s"] = time.perf_counter() - t
        self._stage_agreed(state, record, before)  # (C) every rank raises where one failed
        return record.phase("stage_s", t)

    def wait_for_snapshot(self, *, blocking: bool = False) -> None:
        """Before the state changes after an overlapped save (``--ckpt-overlap-snapshot``): make
        the current CUDA stream wait until that save's device-to-host copies are done (no host
        synchronisation); ``blocking=True`` also waits on the host until they are published to
        the writer. The optimizer step pre-hook calls it; a no-op when nothing is pending."""
        self._publisher.wait_for_snapshot(blocking=blocking)

    # -- finalize / load / close -------------------------------------------------------------
    def maybe_finalize(self, *, blocking: bool = False) -> list[int]:
        """Collective on every rank: commit the async saves all ranks have finished (all pending
        ones when ``blocking``). Returns the iterations committed by this call.

        Raises :class:`CheckpointWriteError` on every rank when any rank's writer died, its
        write or the commit failed (the message says which), or the save is older than
        ``--ckpt-timeout`` seconds; with
        ``--ckpt-failure-policy warn`` that save is abandoned with a rank-0 error instead, until
        ``--ckpt-max-consecutive-failures`` saves in a row have failed."""
        try:
            written = self._writers.poll(blocking=blocking)
        except CheckpointWriteError as e:
            self._failed(e)
            return []
        return [r.iteration for r in written if self._commit_or_fail(r)]

    def preempted(self) -> bool:
        """Collective at an iteration boundary, with ``--exit-signal-handler``: True once any
        rank has received ``--exit-signal``. Then save this iteration (if not saved yet) and
        leave the loop; :meth:`close` waits until the save is durable and reports the time from
        the signal. False (and no collective) without the handler."""
        if self._preemption is None:
            return False
        estimate = self.reports[-1].get("durable_s") if self.reports else None
        return self._preemption.agree(self._group, estimate_s=estimate)

    @gc_pauses(None)  # as a save's: no full collection of the heap inside; they run after it
    def load(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike[str], *,
             iteration: int | None = None) -> dict | None:
        """Collective: load the tracker's checkpoint (or ``iteration``) into ``sharded_state_dict``
        and return the loaded state dict. Where ``checkpoint_dir`` has no committed checkpoint (no
        tracker), returns None after a rank-0 warning, as Megatron-LM starts from scratch; with
        ``--exit-on-missing-checkpoint`` raises FileNotFoundError instead. A checkpoint with an
        integrity manifest is verified while it loads (``--no-ckpt-verify-load`` skips it): a
        mismatch raises :class:`CheckpointIntegrityError` naming the files (the tensors may hold
        the bad values then), or with ``--ckpt-load-fallback`` loads the newest older checkpoint
        that verifies. A plain tensor target raises ``ValueError`` (as in save()). With cpu-shm
        staging the loaded structure's buffers are then allocated in the background
        (:meth:`prepare`, unless ``prepare_at_load`` is False) and an adopted memory snapshot
        pinned (unless ``pin_at_load`` is False: the next prepare() pins it), so the first save
        stages like a steady one. The launcher clears the two where its first step prepares."""
        self._check_open()
        refuse_plain_targets(sharded_state_dict, self._group)  # (C)
        record = LoadRecord(root=Path(checkpoint_dir))
        read: dict = {}  # the .metadata locate() unpickled, for the load: read once per rank
        path = locate(checkpoint_dir, iteration=iteration,
                      exit_on_missing=self.options.exit_on_missing_checkpoint,
                      fallback=self.options.ckpt_load_fallback, metadata=read)
        if path is None:
            release_warm_restore()
            return None
        record.phase("locate_s", record.started)
        load_strategy = lambda: strategy.load_strategy(  # noqa: E731
            self.options, dp_group=self.dp_group, caps=self.caps)
        state = None
        work = copy_leaves(sharded_state_dict)  # megatron-core reassigns what it loads into
        if self._memory_tier:  # (C) this node's sealed snapshot, if it is this checkpoint
            state = restore_from_memory(self._stager, work, path, record, self._group, load_strategy=
                                        load_strategy, proven=self._planner.validated_by_seal,
                                        partner=self._partner, metadata=read.get(str(path)))
            release_warm_restore(background=True)  # taken by the restore, or unused: it goes
            if state is None:  # storage reads from objects the memory tier did not touch
                work = copy_leaves(sharded_state_dict)
        elif self._cpu_shm:  # a snapshot an earlier run left will not be adopted: free it
            discard_snapshot(self._stager, path.parent)
        if state is None:
            loader = Loader(self.options, self._group, load_strategy=load_strategy)
            state = loader.load(work, path, record, explicit=iteration is not None,
                                metadata=read.get(str(path)))
        if self.prepare_at_load:  # every rank (the first call: the collective node admission)
            with record.timed("prepare_save_s"):
                self.prepare(sharded_state_dict)
        entry = record.entry(self._group)
        self.load_reports.append(entry)
        log_load(entry)
        if self.pin_at_load and hasattr(self._stager, "pin_adopted"):  # an adopted snapshot,
            self._stager.pin_adopted()  # the next save's staging: pinned in the background
        return state

    def close(self, *, after_error: bool = False) -> None:
        """Drain pending saves (after an error only those every rank has written, each
        collective bounded: ``_drain``), stop the worker, free staging buffers. Idempotent.

        The sealed snapshot of the last committed save (the memory tier) is freed at a clean
        close, unless ``--ckpt-keep-memory-snapshot``; it is kept when the close follows an
        error (``after_error``: a ``with`` block left on an exception) or the drain failed: the
        job is going down, and its restart on this node should find it (the last committed)."""
        if self._closed:
            return
        self._closed = True
        drained = False
        try:
            self.drop_ahead()  # copies issued ahead of a save that never came
            self._publisher.close()  # its copies land before the buffers can be freed
            drained = self._drain(after_error=after_error)  # (bounded after an error)
            if drained and self._preemption is not None:
                self._preemption.report_durable()
        finally:  # prepare()'s planning ahead done first: it saves through the writers' queues
            self._stager.wait_prepared()
            release_warm_restore()  # built for a load that never came
            self._writers.close(drained=drained)
            if self._memory_tier:
                keep = self.options.ckpt_keep_memory_snapshot or after_error or not drained
                if self._partner is not None:  # the partners' copies it holds: as its own
                    self._partner.close(keep=keep)
                self._stager.close(keep_sealed=keep)
            else:
                self._stager.close()
            self._planner.reset()
            self._retention.wait()
            self._joblock.release()
            if self._preemption is not None:
                self._preemption.uninstall()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(after_error=exc_type is not None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Checkpointer is closed: close() stopped its writers and freed its "
                               "staging; build a new Checkpointer to save or load again")


def _mode(is_async: bool, persistent: bool, cpu_shm: bool, overlap: bool) -> str:
    if not is_async:
        return "sync"
    return (f"async-{'persistent' if persistent else 'temporal'}"
            + ("-cpu-shm" if cpu_shm else "") + ("-overlap" if overlap else ""))
