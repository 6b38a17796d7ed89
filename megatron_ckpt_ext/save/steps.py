"""The steps of :meth:`Checkpointer.save <megatron_ckpt_ext.checkpointer.Checkpointer.save>`
after staging, as methods of the facade: finish the previous save, open the directory, plan,
hand over to the writers, commit (with the snapshot seal and retention), and the failure policy
(``--ckpt-failure-policy``) a failed save goes through. ``save()`` calls them in order."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import backend, preflight
from .._runtime import rank
from ..debug import env_switch
from ..errors import CheckpointWriteError
from ..manifest import read_manifest
from .layout import checkpoint_name, commit_on_disk, open_workdir, staging_failed
from .planner import copy_structure
from .ahead import Ahead, Sources, say_off
from . import handover
from .stage import stage
from .report import SaveRecord, gather, log_report, report_entry
from .write_path import WriteContext, build
from .writers import SaveStepFailed, agreed_finalize, run_agreed

if TYPE_CHECKING:
    from ..collectives import Group
    from ..hooks import SaveHooks
    from ..options import CkptOptions
    from .planner import SavePlanner
    from .publish import Publisher
    from .writers import WriterPool

__all__: list[str] = []

logger = logging.getLogger(__name__)

# close() after an error: the bound of each collective of its drain (Group.capped)
AFTER_ERROR_WAIT_S = 20.0


class _SaveSteps:
    """Mixed into :class:`~megatron_ckpt_ext.checkpointer.Checkpointer`, whose roles (writers,
    publisher, planner, stager, hooks, group) and ``maybe_finalize`` these steps use."""

    if TYPE_CHECKING:
        options: CkptOptions
        reports: list[dict]
        failed_saves: list[dict]
        _async: bool
        _cpu_shm: bool
        _cpu_shim: Any
        _stager: Any
        _group: Group
        _hooks: SaveHooks
        _planner: SavePlanner
        _publisher: Publisher
        _writers: WriterPool
        _retention: Any
        _preemption: Any
        _failures_in_a_row: int
        admission: dict | None

    _ahead: Ahead | None = None  # copies stage_ahead() issued for the next save
    _ahead_sources: Sources | None = None  # what the last save staged (weakly referenced)
    _ahead_off = ""  # why staging ahead stopped for this run ('' while it goes on)
    _ahead_prepared = False  # _ahead_sources came from prepare(), not from a save

    def _finish_previous(self, record: SaveRecord) -> None:
        self._publisher.before_save(record.iteration)
        if not self._writers.idle:
            # One save in flight at a time, as Megatron-LM does: the backends' write-results
            # queue is global, so a second request's results could be taken for the first's.
            self.maybe_finalize(blocking=True)
        try:
            self._writers.ready(record.iteration, record.root)
        except CheckpointWriteError as e:  # a dead worker: under 'warn', a new one for this save
            self._failed(e)
            self._writers.ready(record.iteration, record.root)

    def stage_ahead(self) -> bool:
        """Issue the copies of the tensors the last save staged, into the buffers the next save
        stages into, while the caller builds that save's state (the launcher: on entry to
        Megatron-LM's ``save_checkpoint``). The save takes them only where its tensors are those
        very ones, unchanged (:mod:`.ahead`); :meth:`drop_ahead` gives back what no save took.
        Only for an async shared-memory save with no save pending (the writer's warm-up may be),
        the node admitted, :meth:`prepare`'s allocation and planning done (never waited for
        here, before the save's clock starts: the save waits first, its report's phase
        ``wait_prepare_s``), and every tensor of the last save (or of :meth:`prepare`'s state,
        before the first) alive; ``MCX_STAGE_AHEAD=0`` never. Whether copies were issued."""
        if (self._ahead is not None or self._ahead_off or self._ahead_sources is None
                or not (self._async and self.admission is not None
                        and not self._writers.saves_pending)
                or not hasattr(self._stager, "idle_set_fits")
                or env_switch("MCX_STAGE_AHEAD") == "0"):
            return False
        tensors = self._ahead_sources.alive()
        if tensors is None:  # a state built anew at each save: nothing to copy ahead
            self._ahead_sources = None
            return False
        keys = self._ahead_sources.keys
        if not self._stager.wait_prepared(0):  # prepare() still at work
            return False
        if not self._stager.idle_set_fits(tensors, keys=keys):  # it would allocate: not ahead
            return False
        self._ahead = Ahead.issue(self._stager, tensors, keys, self.staging_stats())
        return True

    def _ahead_of_prepared(self, tensors: list) -> None:
        """prepare()'s state (ShardedTensors) as what the first save copies ahead, where no save
        has recorded its own yet: the first save, and the first after a load, then stage ahead
        like a steady one. A later prepare() replaces an earlier one's (the load prepares from
        the state it loaded into, whose optimizer tensors Megatron-LM frees after copying them;
        the launcher prepares again after the first step). A mismatch there only drops the
        copies (staging ahead stays on)."""
        if ((self._ahead_sources is None or self._ahead_prepared) and not self._ahead_off
                and self._stager.owns_copies):
            self._ahead_sources = Sources.of([t.data for t in tensors], [t.key for t in tensors])
            self._ahead_prepared = self._ahead_sources is not None

    def drop_ahead(self) -> None:
        """Copies :meth:`stage_ahead` issued that no save took: they land and their buffers go
        back. Idempotent."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.drop()

    def _stage_first(self, sharded_state_dict: Any, record: SaveRecord,
                     before: dict) -> tuple[Any, tuple | None] | None:
        """A steady save (async, the node admitted, this rank's structure known) stages before
        the directory opens, so its copies run while rank 0 creates it and the ranks agree
        (or takes the copies :meth:`stage_ahead` issued). Returns the staged state and its
        structure key, or None where staging waits for the open: a new structure here, the
        first staging (its admission is collective), a synchronous save."""
        if not (self._async and self._stager.owns_copies and self.admission is not None):
            self.drop_ahead()
            return None
        if self._planner.constant:  # what prepare() planned ahead is in place before the check
            self._stager.wait_prepared()
        structure = self._planner.key(sharded_state_dict)
        if self._planner.is_new(structure) or self._stager.prepare_failure() is not None:
            self.drop_ahead()  # (a failed prepare(): the open agrees on it, every rank raises)
            return None
        state = copy_structure(sharded_state_dict)
        ahead, self._ahead = self._ahead, None
        self._stage(state, record, ahead.before if ahead is not None else before, ahead=ahead)
        return state, structure

    def _stage(self, state: Any, record: SaveRecord, before: dict, *,
               ahead: Ahead | None = None) -> None:
        self.drop_ahead()  # (any not taken by _stage_first)
        sources, keys, why = stage(state, record, self._stager, ahead=ahead)
        if why and self._ahead_prepared:  # prepare()'s state was not the save's: this once
            logger.debug("the copies ahead of prepare()'s state were not taken: %s", why)
        elif why:  # the copies ahead were not of this save's tensors: not tried again
            self._ahead_off = why
            say_off(why)
        self._ahead_prepared = False
        self._ahead_sources = Sources.of(sources, keys) if self._stager.owns_copies else None
        record.detail.update(_stager_delta(before, self.staging_stats()))
        stats = getattr(self._stager, "stats", {})
        # a restored snapshot's pinning after the load, once it is over (its wall time
        # pin_adopted_s; pin_paused_s, the pauses of it), said once, by one save
        record.detail.update(stats.pop("pinned_adopted", None) or {})
        self._hooks.at("staged", record)

    def _stage_agreed(self, state: Any, record: SaveRecord, before: dict) -> None:
        """:meth:`_stage` once the directory is open. Where every rank re-plans (an agreed new
        structure, the first save included: other ranks may have staged before the open), a
        failure is kept for :meth:`_agree_staged`, so that no rank goes on into planning,
        whose collectives this rank would never join; otherwise it is raised here."""
        try:
            self._stage(state, record, before)
        except Exception as e:  # noqa: BLE001 - raised by _agree_staged, on every rank alike
            if not record.new_structure:
                raise
            record.extra["staging_error"] = e

    def _agree_staged(self, record: SaveRecord) -> None:
        """(C, where the structure is new on some rank: every rank re-plans) one all-max:
        whether any rank could not stage; if so every rank raises, naming it."""
        error = record.extra.pop("staging_error", None)
        bad = self._group.all_max([float(rank()) if error is not None else -1.0])[0]
        if bad < 0:
            return
        if error is None:  # this rank's copies land and its buffers go back first
            self._publisher.wait_staged(record)
            record.release()
        raise staging_failed(record.iteration, int(bad), error)

    def _open(self, sharded_state_dict: Any, record: SaveRecord, *,
              staged: tuple[Any, tuple | None] | None = None) -> tuple[Any, Path]:
        """(C) Open the save's directory (:func:`open_workdir`); returns the state to save (the
        ``staged`` one when :meth:`_stage_first` staged it) and the directory. Where the open
        fails after staging, the copies land and their buffers go back before it raises."""
        unstaged = None
        if staged is not None:
            structure = staged[1]
        else:
            self._stager.wait_prepared()  # what prepare() planned ahead is in place first
            structure = self._planner.key(sharded_state_dict)
            unstaged = self._stager.prepare_failure(take=True)  # agreed below: all raise
        new = self._planner.is_new(structure)
        try:
            workdir = open_workdir(record, self._group, new_structure=new,
                                   validate=new and not self._planner.validated(structure),
                                   plain=backend.plain_tensors(sharded_state_dict),
                                   staging_error=unstaged)
        except BaseException:
            if staged is not None:
                self._publisher.wait_staged(record)
                record.release()
            raise
        self._planner.use(structure, record)
        record.extra["structure"] = self._planner.digest()  # what its seal will name
        if record.new_structure:  # whether megatron-core validates this structure's sharding now
            record.detail["validated_sharding"] = record.validate
        ahead, self._planner.planned_ahead_s = self._planner.planned_ahead_s, None
        if ahead is not None and not record.new_structure:  # its plan made by prepare()
            record.detail["planned_ahead_s"] = ahead
        if self.reports and rank() == 0:
            preflight.check_disk(record.root, self.reports[-1]["bytes_total"],
                                 remeasure=record.new_structure)
        return (copy_structure(sharded_state_dict) if staged is None else staged[0]), workdir

    def _plan(self, state: Any, workdir: Path, record: SaveRecord) -> Any:
        """megatron-core's save request. Planning reads only the staged tensors' metadata, so it
        runs while their copies are in flight, and the writer need not clone this save's copies
        again; where it does clone (``MCX_KEEP_WRITER_CLONES=1``) the copies land first. Its
        collectives run on the host (:func:`run_agreed`), so none waits behind those copies."""
        if record.new_structure:
            self._agree_staged(record)
        snapshots = record.held.snapshots
        strategy = self._planner.strategy()
        replay = None if record.new_structure else self._planner.replay
        with backend.plan_replayed(strategy, replay), backend.writer_keeps_snapshots(
                lambda t: t.untyped_storage().data_ptr() in snapshots) as keeps, \
                backend.into_fresh_directory(), backend.version_checks_cached(), \
                backend.conversions_cached(self._planner.conversions):
            if not keeps and backend.writer_clones_cpu_tensors():
                self._publisher.wait_staged(record)
            try:  # the common state is rank 0's write alone: fail every rank alike
                save = backend.dist_checkpointing().save
                # the ranks' common states are compared only where the save validates: no
                # signature lookup on a steady save
                common = (backend.common_check_kwargs(save, self._planner.preprocess_common)
                          if record.validate else {})
                request = run_agreed(lambda: save(
                    state, str(workdir), strategy, async_sharded_save=True,
                    validate_access_integrity=record.validate, **common), self._group)
            except SaveStepFailed as e:
                if e.raised is not None:  # megatron-core's own error (a sharding it rejects)
                    raise e.raised from e.raised.__cause__
                self._not_planned(record, e)
                return None
        if self._planner.replay is not None:  # (a new structure plans in full)
            record.detail["plan"] = replay.last if replay is not None else "planned"
        self._hooks.at("planned", record)
        return build(request, WriteContext(
            options=self.options, is_async=self._async, persistent=self._writers.persistent,
            cpu_shim=self._cpu_shim, stager=self._stager, hooks=self._hooks, record=record,
            rank=rank()))

    def _hand_over_ahead(self, request: Any) -> None:
        """(``prepare()``'s thread) The first save's hand-over made ahead from its request as
        planned ahead (:func:`.handover.made_ahead`): that save pickles no list in full."""
        if request is None or not self._async:
            return
        ctx = WriteContext(options=self.options, is_async=True,
                           persistent=self._writers.persistent, cpu_shim=self._cpu_shim,
                           stager=self._stager, hooks=self._hooks, record=None, rank=rank())
        try:
            handover.made_ahead(build(request, ctx, through=handover.kept_in_writer))
        except Exception as e:  # noqa: BLE001 - the first save pickles them itself, as before
            logger.debug("the first save's hand-over not made ahead: %s: %s", type(e).__name__, e)

    def _not_planned(self, record: SaveRecord, error: SaveStepFailed) -> None:
        """The save failed on every rank while megatron-core planned it: its staging goes back;
        raise, or with --ckpt-failure-policy warn (async saves) log it and go on."""
        self._publisher.wait_staged(record)  # the copies land before their buffers go back
        record.release()
        failure = self._writers.failed(record, f"its planning failed: {error}",
                                       after="; nothing of it was handed to the writers.")
        if not self._async:
            raise failure from error
        self._failed(failure)

    def _hand_over(self, request: Any, record: SaveRecord, t: float) -> None:
        if not self._async:
            try:
                agreed_finalize(request, self._group).execute_sync()
            except SaveStepFailed as e:  # on every rank alike
                raise self._writers.failed(record, f"its write failed: {e}") from e
            del request
            self._hooks.at("scheduled", record)
            record.phase("write_commit_s", t)  # before the commit, which reports the phases
            self._commit_or_fail(record)
            return
        # the commit is not a callback of the backend's finalization: maybe_finalize commits
        # each save the writers report written (_commit_or_fail), as the synchronous path does
        self._writers.schedule(request, record)
        del request
        self._hooks.at("scheduled", record)
        t = record.phase("schedule_s", t)
        self._publisher.publish(record)  # returns with the copies in flight when overlapping
        record.phase("copy_wait_s", t)

    def _commit_or_fail(self, record: SaveRecord) -> bool:
        """Collective: :meth:`_commit` a written save; a commit that failed on every rank (a
        full disk under rank 0 at the rename) is said as such, raised (synchronous saves, or
        ``--ckpt-failure-policy raise``) or logged under ``warn``. Whether it committed."""
        try:
            self._commit(record)
        except SaveStepFailed as e:
            record.release()
            error = self._writers.failed(record, f"its commit failed: {e}")
            if not self._async:
                raise error from e
            self._failed(error)
            return False
        return True

    def _commit(self, record: SaveRecord) -> None:
        """Collective: make ``record``'s checkpoint visible and name it in the tracker."""
        self._hooks.at("before_commit", record)
        ranks = gather(record, self._group)  # also the commit's first barrier
        # rank 0 commits; agreeing on whether it could (in place of a barrier) fails every
        # rank alike when it could not (a full disk), instead of leaving them in a barrier
        run_agreed(lambda: rank() == 0 and commit_on_disk(
            record.root, record.iteration, on_step=lambda step: self._hooks.at(step, record)),
            self._group)
        self._hooks.at("committed", record)
        if self._memory_tier:
            self._seal(record)
        self._failures_in_a_row = 0
        if rank() == 0:  # the tracker is durable: old checkpoints may go (in the background)
            self._retention.after_commit(record.root)
        if self._preemption is not None:
            self._preemption.committed(record.iteration)
        backend.release_read_chunks()  # a load's pinned chunks: not needed once training saves
        record.release()
        entry = report_entry(record, ranks, is_async=self._async)
        self.reports.append(entry)
        log_report(record, entry, ranks)

    @property
    def _memory_tier(self) -> bool:
        """Sealed snapshots and restores from them (--no-ckpt-memory-restore turns them off)."""
        return self._cpu_shm and self.options.ckpt_memory_restore and hasattr(self._stager,
                                                                               "seal")

    def _seal(self, record: SaveRecord) -> None:
        """After the commit: the save's staging buffers become the node's snapshot of it."""
        try:
            manifest = read_manifest(checkpoint_name(record.root, record.iteration))
        except (OSError, ValueError) as e:
            logger.debug("no memory snapshot of iteration %d: %s", record.iteration, e)
            return
        self._stager.seal(record.held.batch, root=str(record.root), iteration=record.iteration,
                          world=self._group.size(), layout=record.extra.get("layout", []),
                          manifest_crc32=(manifest or {}).get("manifest_crc32"),
                          structure=record.extra.get("structure", ("", [])))

    def _drain(self, *, after_error: bool) -> bool:
        """close()'s commit of the saves in flight (collective); whether none is left. After an
        error only those every rank has written are committed, each collective waiting at most
        ``AFTER_ERROR_WAIT_S``: the ranks may have left their common order of collectives (a
        Ctrl-C reaches each rank at another point), and the drain that waited for every write
        held the job's exit until the distributed timeout or --ckpt-timeout. The rest is
        abandoned (never committed: the last committed checkpoint stays the latest), said on
        rank 0; the error that closed the Checkpointer stays the one raised."""
        if not after_error:
            self.maybe_finalize(blocking=True)
            return True
        try:
            with self._group.capped(AFTER_ERROR_WAIT_S):
                self.maybe_finalize()
        except Exception as e:  # noqa: BLE001 - the error being handled is the one to raise
            self._say_abandoned(f"{type(e).__name__}: {e}")
            return False
        if self._writers.pending:
            self._say_abandoned("their writes had not finished")
        return not self._writers.pending

    @staticmethod
    def _say_abandoned(why: str) -> None:
        (logger.warning if rank() == 0 else logger.debug)(
            "closing after an error: the saves in flight are abandoned (%s); the last committed "
            "checkpoint stays the latest", why)

    def _failed(self, error: CheckpointWriteError) -> None:
        """A save failed on every rank (the writers already abandoned it): raise, or under
        ``--ckpt-failure-policy warn`` log it on rank 0 and go on."""
        self._failures_in_a_row += 1
        limit = self.options.ckpt_max_consecutive_failures
        if self.options.ckpt_failure_policy == "raise":
            raise error
        if self._failures_in_a_row >= limit:
            raise CheckpointWriteError(
                f"{error} This is the {self._failures_in_a_row}th failed save in a row "
                f"(--ckpt-max-consecutive-failures {limit}, config key "
                "'ckpt_max_consecutive_failures'): stopping.") from error
        self.failed_saves.append({"error": str(error), "in_a_row": self._failures_in_a_row})
        if rank() == 0:
            logger.error("%s --ckpt-failure-policy warn: training goes on and the next save is "
                         "tried (%d of %d failures in a row allowed).", error,
                         self._failures_in_a_row, limit - 1)


def _stager_delta(before: dict, after: dict) -> dict:
    """What one save's staging cost the stager beyond the copies (rank 0's report names it):
    buffers allocated and pinned, sets built at the save (a prepare() at work was waited for
    before, in the phase ``wait_prepare_s``)."""
    out = {}
    for key in ("allocate_s", "register_s", "allocations",
                "sets_built_at_stage"):
        if key in after:
            out[key] = after[key] - before.get(key, 0)
    return out
