"""Device-to-host staging of the state handed to an async writer.

:class:`ShmStager` copies each tensor into a CPU shared-memory buffer of its own; the mechanisms,
and why (figures: docs/notes/benchmarks.md, "How we got here", and docs/notes/staging.md):

* **Named segments, shared from torch's point of view.** Each buffer is a file
  ``/dev/shm/mcx_<job>_<rank>_<pid>_<n>`` reserved with ``posix_fallocate`` and mapped as torch
  fd-shared storage, so a forked writer inherits it and a spawned one receives it without a copy
  (under torch's ``file_system`` sharing strategy it would be copied: warned once).
  A full ``/dev/shm`` fails at allocation, naming the fix, not with a SIGBUS mid-save. The owner
  holds a shared ``flock`` while any process maps a segment, so :func:`sweep_orphans` removes
  only leftovers of dead runs. Cost: one file descriptor per buffer (the soft ``RLIMIT_NOFILE``
  is raised when needed).
* **Handed to a spawned writer by name.** torch would pass each storage's descriptor through
  multiprocessing's resource sharer, one round trip per tensor while the trainer waits; a live
  segment is pickled as ``(path, nbytes)`` instead and the receiver maps it itself
  (:mod:`.segments`). Every other storage goes through torch's own reducer.
* **Kept mapped in a persistent writer.** With ``reuse=True`` the receiver keeps what it mapped
  per owner epoch (bumped when a segment is freed) and reuses it at the next save, instead of
  mapping and faulting every page in again.
* **Pinned where CUDA exists.** Buffers are ``cudaHostRegister``-ed (as torch DCP's
  DefaultStager does) in :meth:`ShmStager.prepare` or at the first stage, never per save when
  reused, so device-to-host copies run at pinned speed.
* **A cache that cannot go stale.** With ``reuse=True`` (``--ckpt-assume-constant-structure``)
  every stage copies from the tensors it is given (sources are never remembered: NeMo-RL #3312),
  compares a per-tensor key (key, shape, dtype, device, storage pointer, offset) with the
  previous save's, and rebuilds only the buffers that no longer fit, logging why once.
* **Handed over before the copies finish.** ``stage(..., wait=False)`` only queues the copies;
  the writer's function is gated (:func:`run_when_staged`) on a one-word segment where the
  trainer publishes the save's number once :meth:`StagedBatch.wait` returns, so planning and the
  hand-over to the writer run under the copies.
* **Lifetime.** A :class:`StagedBatch` holds its buffer set until :meth:`StagedBatch.release`
  (after the commit); a save while another is in flight uses a second set (Megatron-LM #2288).

:class:`HostCopyStager` and :class:`InPlaceStager` (:mod:`.plain`) stage without shared memory.
"""

from __future__ import annotations

from .base import Stager
from .batch import StagedBatch
from .plain import HostCopyStager, InPlaceStager
from .ready import run_when_staged
from .segments import SEGMENT_PREFIX, SHM_DIR, sweep_orphans
from .shm import ShmStager, StagingKey

__all__ = ["HostCopyStager", "InPlaceStager", "SEGMENT_PREFIX", "SHM_DIR", "ShmStager",
           "StagedBatch", "Stager", "StagingKey", "run_when_staged", "sweep_orphans"]
