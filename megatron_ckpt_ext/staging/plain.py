"""Stagers without shared memory: plain CPU copies for async saves without
``--async-ckpt-use-cpu-shm``, and none at all for synchronous saves."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from .batch import StagedBatch

__all__ = ["HostCopyStager", "InPlaceStager"]


class InPlaceStager:
    """A synchronous save writes the caller's tensors as they are: nothing is copied."""

    owns_copies = False

    def prepare(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
                background: bool = False,
                then: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Nothing to allocate (``then`` is not called: there are no buffers)."""

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        return True

    def prepare_failure(self, *, take: bool = False) -> BaseException | None:
        return None

    def stage(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
              wait: bool = True) -> StagedBatch:
        return StagedBatch(list(tensors), _nbytes(tensors), 0.0)

    def gate(self, write: Callable[..., Any], *, timeout_s: float) -> tuple[Callable[..., Any], int]:
        return write, 0  # the bytes are final before the writer gets the request

    def publish(self, ticket: int, *, ok: bool) -> None:
        """Nothing waits."""

    def host_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to free."""


class HostCopyStager(InPlaceStager):
    """Each save gets fresh CPU copies (``Tensor.to("cpu", copy=True)``), finished before
    :meth:`stage` returns and freed with the save's record after its commit."""

    owns_copies = True

    def __init__(self) -> None:
        self._held = 0

    def stage(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
              wait: bool = True) -> StagedBatch:
        t0 = time.perf_counter()
        copies = [t.detach().to("cpu", copy=True) for t in tensors]
        self._held = _nbytes(copies)
        return StagedBatch(copies, self._held, time.perf_counter() - t0)

    def host_bytes(self) -> int:
        return self._held  # this save's copies (one save in flight at a time)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
