"""What a stage() hands out: the buffers of one buffer set, and the in-flight device copies
that :meth:`StagedBatch.wait` waits for."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["StagedBatch"]

_Spec = tuple  # (id, shape, dtype)


@dataclass
class _Buffer:
    tensor: torch.Tensor
    path: str | None  # None for zero-size tensors (no segment)
    registered: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class _BufferSet:
    buffers: dict[_Spec, _Buffer]
    in_flight: bool = False

    def fits(self, specs: Sequence[_Spec]) -> bool:
        return len(self.buffers) == len(specs) and all(s in self.buffers for s in specs)


@dataclass
class _Copies:
    """Device-to-host copies issued on one copy stream, bracketed by timing events."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    device: torch.device | None = None  # the copy stream's device
    queued: torch.cuda.Event | None = None  # on the copy stream before it waits for the device's
    # current stream: queued -> start is how long the copies waited for work queued there

    def order_before_current_stream(self) -> None:
        """Make the current stream of the copies' device wait for them (no host wait): work
        queued on it next, such as an optimizer step, runs after the copies."""
        torch.cuda.current_stream(self.device).wait_event(self.end)


@dataclass
class StagedBatch:
    """CPU shared-memory copies of one save's tensors; keep it until the write is committed.

    From ``stage(..., wait=False)`` the device-to-host copies may still be running: the tensors'
    storage is final (plan with it), their bytes are not until :meth:`wait` returns."""

    tensors: list[torch.Tensor]
    nbytes: int
    staging_s: float  # stage() call until the copies were complete (wall)
    copy_s: float | None = None  # the device copies alone (CUDA events), None for host sources
    queue_wait_s: float | None = None  # how long the copies waited for the device's queued work
    _started: float = field(default=0.0, repr=False)
    _pending: list[_Copies] = field(default_factory=list, repr=False)
    _sources: list[torch.Tensor] = field(default_factory=list, repr=False)  # alive until copied
    _owner: Any = field(default=None, repr=False)  # the stager that lent the buffers (shm.py)
    _set: _BufferSet | None = field(default=None, repr=False)

    def wait(self) -> None:
        """Block until every copy of this batch is in host memory (only the copy streams are
        waited on: training kernels keep running). Idempotent."""
        pending = self._pending
        for copies in pending:
            copies.end.synchronize()
        self._pending, self._sources = [], []  # the sources may be freed and reused now
        if pending:
            self.copy_s = max(c.start.elapsed_time(c.end) for c in pending) / 1e3
            self.staging_s = time.perf_counter() - self._started
            waits = [c.queued.elapsed_time(c.start) for c in pending
                     if getattr(c, "queued", None) is not None]
            self.queue_wait_s = max(waits) / 1e3 if waits else None

    def copies_in_flight(self) -> list[_Copies]:
        """The device copies not yet waited for by :meth:`wait` (their ``end`` events, on the
        copy streams): a trainer that must not change the sources before they are done can
        make its own stream wait on these instead of blocking (Checkpointer's overlapped
        snapshot)."""
        return list(self._pending)

    def release(self) -> None:
        """The writer is done: the buffers may be reused (reuse=True) or freed. Idempotent."""
        self.wait()  # never hand back a buffer a copy is still writing into
        owner, buffer_set = self._owner, self._set
        self._owner, self._set, self.tensors = None, None, []
        if owner is not None and buffer_set is not None:
            owner._release(buffer_set)
