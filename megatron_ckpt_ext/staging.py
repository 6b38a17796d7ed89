"""Per-tensor CPU shared-memory staging of the state handed to an async writer.

Why and how:

* **Shared memory from torch itself.** Buffers are ``torch.empty(...).share_memory_()``. Under
  torch's default sharing strategy on Linux (``file_descriptor``) the segment is unlinked from
  ``/dev/shm`` right after it is created and lives only as long as some process maps it: a crash
  (even ``kill -9``) cannot leave a segment behind, so there is nothing to sweep at the next start,
  and a spawned writer receives the buffer as a file descriptor, with no copy. (A name-based
  segment that outlives its owner would need a sweeper; this design has none to sweep.)
* **Pinned where CUDA exists.** Each buffer is registered with the CUDA driver
  (``cudaHostRegister``, as torch DCP's DefaultStager does) so device-to-host copies run at pinned
  speed; it is unregistered before it is freed. Allocation and registration happen in
  :meth:`ShmStager.prepare` (start-up) or at the first stage, never per save when buffers are
  reused.
* **A cache that cannot go stale.** With ``reuse=True`` (``--ckpt-assume-constant-structure``)
  buffer sets are kept and reused. Every :meth:`stage` copies from the tensors it is given (never
  from remembered sources), and compares a key of them with the previous one: per tensor the key,
  shape, dtype, device, storage pointer and offset. Any difference is logged once on rank 0,
  naming what changed; buffers whose shape/dtype still fit are kept, the others reallocated. The
  check is one tuple per tensor: microseconds for thousands of tensors, against a copy of the
  whole state.
* **Lifetime.** A :class:`StagedBatch` holds its buffer set until :meth:`StagedBatch.release`
  (called by the checkpointer after the commit). A stage() while another batch is in flight uses
  a second set: two saves in flight never share a buffer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["ShmStager", "StagedBatch", "StagingKey"]

logger = logging.getLogger(__name__)

StagingKey = tuple  # per tensor: (key, shape, dtype, device, data_ptr, storage_offset)


@dataclass
class _BufferSet:
    buffers: list[torch.Tensor]
    registered: list[int]  # data_ptrs registered with CUDA
    in_flight: bool = False

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        return len(self.buffers) == len(tensors) and all(
            b.shape == t.shape and b.dtype == t.dtype for b, t in zip(self.buffers, tensors))


@dataclass
class StagedBatch:
    """CPU shared-memory copies of one save's tensors; keep it until the write is committed."""

    tensors: list[torch.Tensor]
    nbytes: int
    staging_s: float
    _owner: "ShmStager | None" = field(default=None, repr=False)
    _set: _BufferSet | None = field(default=None, repr=False)

    def release(self) -> None:
        """The writer is done: the buffers may be reused (reuse=True) or freed. Idempotent."""
        if self._owner is not None and self._set is not None:
            self._owner._release(self._set)
        self._owner, self._set = None, None
        self.tensors = []


class ShmStager:
    """Stages tensors (GPU or CPU) into per-tensor CPU shared-memory buffers."""

    def __init__(self, *, job_id: str, rank: int, reuse: bool, pin: bool | None = None) -> None:
        self.job_id, self.rank, self.reuse = job_id, rank, reuse
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._sets: list[_BufferSet] = []
        self._last_key: StagingKey | None = None
        self._closed = False
        self.stats = {"bytes_staged": 0, "allocations": 0, "bytes_allocated": 0, "rebuilds": 0,
                      "last_rebuild_reason": None}

    # -- public ----------------------------------------------------------------------------------
    def prepare(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None) -> None:
        """Allocate (and pin) a buffer set ahead of the first save: start-up, not critical path."""
        if not any(s.fits(tensors) and not s.in_flight for s in self._sets):
            self._sets.append(self._allocate(tensors))

    def stage(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None) -> StagedBatch:
        """Copy ``tensors`` into shared memory; returns when the copies are complete."""
        if self._closed:
            raise RuntimeError("ShmStager is closed")
        t0 = time.perf_counter()
        keys = list(keys) if keys is not None else [str(i) for i in range(len(tensors))]
        self._check_key(tensors, keys)
        buffer_set = self._acquire(tensors)
        for buf, src in zip(buffer_set.buffers, tensors):
            buf.copy_(src.detach(), non_blocking=src.is_cuda)
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()
        nbytes = sum(b.numel() * b.element_size() for b in buffer_set.buffers)
        self.stats["bytes_staged"] += nbytes
        return StagedBatch(list(buffer_set.buffers), nbytes, time.perf_counter() - t0, self, buffer_set)

    def host_bytes(self) -> int:
        """Shared memory currently held by this stager."""
        return sum(b.numel() * b.element_size() for s in self._sets for b in s.buffers)

    def close(self) -> None:
        """Unregister and free every buffer set. Idempotent."""
        for s in self._sets:
            self._free(s)
        self._sets.clear()
        self._closed = True

    # -- internals -------------------------------------------------------------------------------
    def _check_key(self, tensors: Sequence[torch.Tensor], keys: list[str]) -> None:
        key = tuple((k, tuple(t.shape), t.dtype, str(t.device), t.untyped_storage().data_ptr(),
                     t.storage_offset()) for k, t in zip(keys, tensors))
        if self._last_key is not None and key != self._last_key:
            reason = _describe(self._last_key, key)
            self.stats["rebuilds"] += 1
            self.stats["last_rebuild_reason"] = reason
            if self.rank == 0:
                logger.info("staging cache: state changed since the last save (%s); re-validated "
                            "buffers, copying from the current tensors", reason)
        self._last_key = key

    def _acquire(self, tensors: Sequence[torch.Tensor]) -> _BufferSet:
        if self.reuse:
            for s in self._sets:
                if not s.in_flight and s.fits(tensors):
                    s.in_flight = True
                    return s
            # Structure changed: sets that no longer fit and are idle are freed.
            for s in [s for s in self._sets if not s.in_flight and not s.fits(tensors)]:
                self._free(s)
                self._sets.remove(s)
        new = self._allocate(tensors)
        new.in_flight = True
        self._sets.append(new)
        return new

    def _release(self, buffer_set: _BufferSet) -> None:
        buffer_set.in_flight = False
        if not self.reuse or self._closed:
            self._free(buffer_set)
            if buffer_set in self._sets:
                self._sets.remove(buffer_set)

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> _BufferSet:
        buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu").share_memory_() for t in tensors]
        registered = [self._register(b) for b in buffers] if self.pin else []
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        self.stats["allocations"] += 1
        self.stats["bytes_allocated"] += nbytes
        return _BufferSet(buffers, [p for p in registered if p])

    @staticmethod
    def _register(buf: torch.Tensor) -> int:
        nbytes = buf.numel() * buf.element_size()
        if nbytes == 0:
            return 0
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            logger.warning("cudaHostRegister failed (%s): staging into unpinned memory", err)
            return 0
        return buf.data_ptr()

    @staticmethod
    def _free(buffer_set: _BufferSet) -> None:
        for ptr in buffer_set.registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        buffer_set.registered = []
        buffer_set.buffers = []


def _describe(old: StagingKey, new: StagingKey) -> str:
    old_by, new_by = {e[0]: e for e in old}, {e[0]: e for e in new}
    added = sorted(set(new_by) - set(old_by))
    removed = sorted(set(old_by) - set(new_by))
    reshaped = sorted(k for k in set(old_by) & set(new_by) if old_by[k][1:4] != new_by[k][1:4])
    moved = sorted(k for k in set(old_by) & set(new_by)
                   if old_by[k][1:4] == new_by[k][1:4] and old_by[k][4:] != new_by[k][4:])
    parts = [f"{name} {keys[:3]}{'...' if len(keys) > 3 else ''}" for name, keys in
             (("added", added), ("removed", removed), ("reshaped", reshaped), ("reallocated", moved))
             if keys]
    return "; ".join(parts) or "order changed"
