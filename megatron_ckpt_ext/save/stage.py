"""The stager a Checkpointer uses, and the staging step of a save: every tensor of the state is
replaced by host memory owned by the save, so the bytes written are the state at ``save()``
whatever training does next, and the writer needs no CUDA IPC."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .. import backend
from .._runtime import rank
from ..errors import CkptOptionsError
from ..staging.base import Stager
from .report import SaveRecord

if TYPE_CHECKING:
    from .ahead import Ahead

__all__ = ["choose_stager", "stage", "sweep_at_start"]

logger = logging.getLogger(__name__)


def choose_stager(*, is_async: bool, cpu_shm: bool, reuse: bool, job_id: str | None,
                  given: Stager | None = None, snapshot_sets: int = 1) -> Stager:
    """Shared memory with ``--async-ckpt-use-cpu-shm``, plain CPU copies for other async saves,
    none for synchronous ones; ``given`` (``Checkpointer(stager=...)``) instead, once it fits
    that choice. First the one start-up sweep (:func:`sweep_at_start`), in every mode."""
    from ..staging import HostCopyStager, InPlaceStager, ShmStager

    if given is not None:
        _check_fits(given, is_async=is_async, cpu_shm=cpu_shm, reuse=reuse)
    sweep_at_start()
    if given is not None:
        return given
    if cpu_shm:  # (swept above: the stager's own sweep is for those who build one directly)
        return ShmStager(job_id=job_id or _job_id(), rank=rank(), reuse=reuse, sweep=False,
                         snapshot_sets=snapshot_sets)
    return HostCopyStager() if is_async else InPlaceStager()


def _check_fits(stager: Stager, *, is_async: bool, cpu_shm: bool, reuse: bool) -> None:
    """A passed stager must be the kind the options call for: the writers read shared memory
    only with --async-ckpt-use-cpu-shm, an async save writes copies it owns, a sync one none."""
    from ..staging import ShmStager

    name, shm = type(stager).__name__, isinstance(stager, ShmStager)
    if cpu_shm and not shm:
        raise CkptOptionsError(f"Checkpointer(stager={name}) does not fit "
                               "--async-ckpt-use-cpu-shm: its writers read the staged copies from "
                               "shared memory; pass a ShmStager (or a subclass), or drop the flag")
    if shm and not cpu_shm:
        raise CkptOptionsError(f"Checkpointer(stager={name}) stages into shared memory, which "
                               "only --async-save with --async-ckpt-use-cpu-shm reads: add both "
                               "flags, or pass another stager")
    if is_async != bool(stager.owns_copies):
        fix = ("pass one whose copies the save owns (HostCopyStager), or drop --async-save"
               if is_async else "pass InPlaceStager or none, or add --async-save")
        raise CkptOptionsError(f"Checkpointer(stager={name}) does not fit --async-save "
                               f"({'on' if is_async else 'off, or no async backend'}): an async "
                               f"save writes copies it owns, a sync one the tensors; {fix}")
    if shm and stager.reuse != reuse:  # type: ignore[attr-defined]
        raise CkptOptionsError(f"Checkpointer(stager={name}(reuse={not reuse})) does not fit "
                               f"--ckpt-assume-constant-structure ({'on' if reuse else 'off'}): "
                               f"build it with reuse={reuse}")


def stage(state: Any, record: SaveRecord, stager: Stager, *,
          ahead: Ahead | None = None) -> tuple[list, list, str]:
    """Issue the copies of every tensor of ``state`` (they may still run when this returns:
    :meth:`Publisher.wait_staged`) and put the copies in the state in place of the tensors.
    Copies issued ``ahead`` (:mod:`.ahead`) are taken where they are of these very tensors, else
    dropped. Returns the sources, their keys and why ``ahead`` was not taken ('' if it was)."""
    t0 = time.perf_counter()
    tensors: list[Any] = []
    backend.map_sharded_tensors(state, lambda t: tensors.append(t) or t)
    sources, keys = [t.data for t in tensors], [t.key for t in tensors]
    why = ahead.mismatch(sources, keys) if ahead is not None else ""
    if ahead is not None and not why:
        batch = ahead.batch
        record.detail["staged_ahead_s"] = round(t0 - ahead.issued, 6)  # issued this long before
    else:
        if ahead is not None:
            ahead.drop()  # its copies land and its buffers go back before they are staged into
        batch = stager.stage(sources, keys=keys, wait=False)
    record.held.batch = batch
    record.nbytes = batch.nbytes
    record.host_bytes = stager.host_bytes()
    if stager.owns_copies:
        record.held.snapshots = frozenset(c.untyped_storage().data_ptr() for c in batch.tensors)
        swap = iter(batch.tensors)
        backend.map_sharded_tensors(state, lambda t: backend.with_data(t, next(swap)))
        record.staging_s = time.perf_counter() - t0
    return sources, keys, why


def sweep_at_start() -> None:
    """The one start-up sweep (every Checkpointer, every mode): the shared-memory segments and
    the write-results spool directories that crashed runs left, those no live process holds
    (``_runtime.unheld``); a sealed snapshot younger than its age bound is kept."""
    from ..spool import sweep_stale
    from ..staging import sweep_orphans

    for sweep in (sweep_orphans, sweep_stale):
        try:
            sweep()
        except OSError as e:  # best effort: a start-up must not fail over another run's files
            logger.debug("start-up sweep (%s): %s", sweep.__name__, e)


def _job_id() -> str:
    return (os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
            or str(os.getppid()))
