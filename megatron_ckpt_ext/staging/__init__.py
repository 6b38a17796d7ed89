"""Per-tensor CPU shared-memory staging of the state handed to an async writer.

Why and how (measured on CPU with torch 2.13; see tests/unit/test_staging.py):

* **Our own named segments, shared from torch's point of view.** Each buffer is a file
  ``/dev/shm/mcx_<job>_<rank>_<pid>_<n>`` created by us, reserved with ``posix_fallocate`` and
  mapped through ``torch.UntypedStorage._new_shared_fd_cpu`` (torch's own file-descriptor shared
  storage, the one ``torch.multiprocessing`` rebuilds in a receiver). Consequences:

  - a forked writer inherits the mapping; a spawned (persistent) writer receives the tensor by
    file descriptor, **without a copy**: torch sees a shared storage and sends its fd. (Memory we
    mapped ourselves with ``mmap`` or ``UntypedStorage.from_file`` is not: pickling it either
    copies the whole tensor into a fresh torch segment, or fails with EBADF.)
  - ``posix_fallocate`` claims the tmpfs pages up front, so a full ``/dev/shm`` is an error at
    allocation (start-up, :meth:`ShmStager.prepare`) naming the fix, not a SIGBUS mid-save.
  - the name says whose segment it is (job, rank, pid); :meth:`ShmStager.close` unlinks it; a
    segment left by a crashed run is removed by :func:`sweep_orphans` at the next start (every
    stager sweeps when it is created). The owner holds a shared ``flock`` on the segment for as
    long as any process maps it (torch keeps a dup of the fd with the mapping), so the sweep
    removes a segment only when its owner pid is gone *and* nobody maps it any more: a live
    writer, or a process in another pid namespace sharing ``/dev/shm``, keeps it.
  - cost: one file descriptor per staged tensor and buffer set (torch keeps it open with the
    mapping). The soft ``RLIMIT_NOFILE`` is raised towards the hard limit when needed; past the
    hard limit the allocation fails with a message naming ``ulimit -n``. Under torch's
    ``file_system`` sharing strategy pickling would copy into torch's own segment, so that
    strategy is reported once as a warning.

* **Handed to a spawned writer by name.** torch pickles an fd-shared storage by passing its file
  descriptor through ``multiprocessing``'s resource sharer: one authenticated socket round trip
  per storage, in the receiver's unpickling, which the trainer waits for (the persistent worker's
  preload hand-shake). Measured on one H100 with 2.06 GB in 252 tensors: 0.86 s per save, more
  than staging itself (0.04 s). Our segments have names, so they are pickled as ``(path,
  nbytes)`` and the receiver opens and maps the segment itself
  (:func:`segments._open_segment`, ~20 us; it takes the same shared ``flock``). Only storages
  registered by a live stager are pickled this way (:data:`segments._SEGMENTS`, keyed by data
  pointer and checked against the size); every other storage goes through torch's own reducer
  unchanged. ``MCX_PICKLE_SEGMENTS_BY_NAME=0`` turns this off.

* **Kept mapped in a persistent writer.** With ``reuse=True`` the reference also carries the
  stager's *epoch*, a per-process number bumped whenever a segment is freed. A receiver keeps
  what it mapped for that epoch (:data:`segments._MAPPED`) and hands the same mapping back at
  the next save instead of mapping the segment again; on a new epoch it first drops every
  mapping it kept. So a persistent writer maps the buffers once, not once per save, and does
  not fault every page in again while it writes (on the H100 VM: ~33,000 faults per 2.15 GB per
  save).
  Freed segments are released by the writer at its next hand-over (a structure change holds the
  old buffers until then), at its exit, or when the trainer closes the stager. Without reuse
  (``reuse=False``) nothing is kept. ``MCX_WRITER_KEEPS_MAPPINGS=0`` turns this off.

* **Pinned where CUDA exists.** Each buffer is registered with the CUDA driver
  (``cudaHostRegister``, as torch DCP's DefaultStager does), so device-to-host copies run at
  pinned speed into memory the writer reads without a CUDA context. It is unregistered before it
  is unmapped. Allocation and registration happen in :meth:`ShmStager.prepare` (start-up, or in a
  background thread with ``background=True``) or at the first stage, never per save when buffers
  are reused. Without CUDA (``pin=False``) registration is skipped.

  Measured on one H100 (torch 2.11, 4 GiB bf16 in 64 tensors, one run): pinned-copy floor
  0.078 s; :meth:`ShmStager.prepare` 1.87 s (allocate + fallocate + register, at start-up);
  steady-state stage() 0.078-0.092 s (47-55 GB/s, i.e. at the floor); the same segments
  unpinned: 2.9 s first stage, 0.28 s after (15.6 GB/s); a first stage without prepare() 1.6 s.

* **A cache that cannot go stale.** With ``reuse=True`` (``--ckpt-assume-constant-structure``)
  buffers are kept and reused. Every :meth:`ShmStager.stage` copies from the tensors it is given
  (sources are never remembered: the NeMo-RL #3312 failure cannot happen), and compares a key of
  them with the previous save's: per tensor the key, shape, dtype, device, storage pointer and
  offset. On a difference it logs once on rank 0 what changed (``stats["last_rebuild_reason"]``)
  and rebuilds only what no longer fits: buffers whose key, shape and dtype still match are kept,
  new entries get new buffers, dropped ones are freed. The check is one tuple per tensor and a
  tuple compare: about 1.6 us per tensor on a 2-core CI VM (8 ms for 5,000 tensors), against
  ~150 ms for one pinned copy of 8 GiB at ~54 GB/s.

* **Handed over before the copies finish.** ``stage(..., wait=False)`` only queues the
  device-to-host copies. The checkpointer plans and hands the request to the writer meanwhile;
  the writer's write is wrapped in :func:`run_when_staged`, which first waits on a one-word
  segment of this stager (:meth:`ShmStager.ready_flag`) until the trainer, after
  :meth:`StagedBatch.wait`, publishes that save's number there (or its negative when the copies
  failed: the writer then writes nothing). A forked writer inherits the segment; a spawned one
  gets it by name like the buffers. Measured on one H100 (8.5 GB): what is left after the copies
  is then the publication, not megatron-core's planning (0.02-0.6 s) or the hand-over to the
  writer (0.02-0.3 s); see docs/benchmarks.

* **Lifetime.** A :class:`StagedBatch` holds its buffer set until :meth:`StagedBatch.release`
  (called by the checkpointer after the commit). A stage() while another batch is in flight uses
  a second set: two saves in flight never share a buffer (Megatron-LM #2288).
"""

from __future__ import annotations

from .base import Stager
from .batch import StagedBatch
from .ready import run_when_staged
from .segments import SEGMENT_PREFIX, SHM_DIR, sweep_orphans
from .shm import ShmStager, StagingKey

__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "ShmStager", "StagedBatch", "Stager", "StagingKey",
           "run_when_staged", "sweep_orphans"]
