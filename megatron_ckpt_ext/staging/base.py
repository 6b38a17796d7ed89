"""The stager's contract: what Checkpointer asks of a device-to-host stager."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from .batch import StagedBatch

__all__ = ["Stager"]


@runtime_checkable
class Stager(Protocol):
    """Copies a save's tensors into host memory a writer process can read; Checkpointer's view.

    Call order (all on the trainer, per rank; none is a collective):

    1. :meth:`prepare` once the state exists (optional; ``background=True`` returns at once),
       and :meth:`wait_prepared` where start-up is timed.
    2. Per save: :meth:`host_bytes` (0 before the first staging: check free memory then), then
       :meth:`stage` with ``wait=False``; the batch's tensors replace the state's.
    3. :meth:`ready_flag` is handed to the writer, which waits on it; once
       :meth:`StagedBatch.wait` returns, the save's number is written there (its negative if
       the copies failed).
    4. :meth:`StagedBatch.release` after the commit: the buffers may be reused or freed.
    5. :meth:`close` at the end: frees everything; no call may follow.
    """

    def prepare(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
                background: bool = False) -> None:
        """Allocate buffers for ``tensors`` ahead of the first save."""

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        """Until a background :meth:`prepare` is done (at most ``timeout_s``); whether it is."""

    def stage(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
              wait: bool = True) -> StagedBatch:
        """Copy ``tensors`` to host memory; with ``wait=False`` the copies may still run."""

    def host_bytes(self) -> int:
        """Host memory currently held for staging."""

    def ready_flag(self) -> torch.Tensor:
        """A one-element int64 tensor shared with the writer: the published save number."""

    def close(self) -> None:
        """Free every buffer. Idempotent."""
