"""The stager a Checkpointer uses, and the staging step of a save: every tensor of the state is
replaced by host memory owned by the save, so the bytes written are the state at ``save()``
whatever training does next, and the writer needs no CUDA IPC."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from .. import backend
from .._runtime import rank
from ..staging.base import Stager
from .report import SaveRecord

__all__ = ["choose_stager", "stage"]

logger = logging.getLogger(__name__)


def choose_stager(*, is_async: bool, cpu_shm: bool, reuse: bool, job_id: str | None) -> Stager:
    """Shared memory with ``--async-ckpt-use-cpu-shm``, plain CPU copies for other async saves,
    none for synchronous ones. A shared-memory stager sweeps a crashed run's segments itself;
    the others sweep here, so they do not outlive the next start in another mode."""
    from ..staging import HostCopyStager, InPlaceStager, ShmStager

    if cpu_shm:
        return ShmStager(job_id=job_id or _job_id(), rank=rank(), reuse=reuse)
    _sweep_shm_orphans()
    return HostCopyStager() if is_async else InPlaceStager()


def stage(state: Any, record: SaveRecord, stager: Stager) -> None:
    """Issue the copies of every tensor of ``state`` (they may still run when this returns:
    :meth:`Publisher.wait_staged`) and put the copies in the state in place of the tensors."""
    t0 = time.perf_counter()
    tensors: list[Any] = []
    backend.map_sharded_tensors(state, lambda t: tensors.append(t) or t)
    batch = stager.stage([t.data for t in tensors], keys=[t.key for t in tensors], wait=False)
    record.staged = batch
    record.nbytes = batch.nbytes
    record.host_bytes = stager.host_bytes()
    if stager.owns_copies:
        record.snapshots = frozenset(c.untyped_storage().data_ptr() for c in batch.tensors)
        swap = iter(batch.tensors)
        backend.map_sharded_tensors(state, lambda t: replace(t, data=next(swap)))
        record.staging_s = time.perf_counter() - t0


def _sweep_shm_orphans() -> None:
    from ..spool import sweep_stale
    from ..staging import sweep_orphans

    try:
        sweep_orphans()
        sweep_stale()
    except OSError as e:  # best effort: a start-up must not fail over another run's files
        logger.debug("shm orphan sweep: %s", e)


def _job_id() -> str:
    return (os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
            or str(os.getppid()))
