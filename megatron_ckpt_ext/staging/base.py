"""The stager's contract: what Checkpointer asks of a device-to-host stager. Implementations:
:class:`~.shm.ShmStager` (shared memory, a gated writer), :class:`~.plain.HostCopyStager`
(plain CPU copies) and :class:`~.plain.InPlaceStager` (no copy: synchronous saves)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from .batch import StagedBatch

__all__ = ["Stager"]


@runtime_checkable
class Stager(Protocol):
    """Copies a save's tensors into host memory a writer process can read; Checkpointer's view.

    Call order (all on the trainer, per rank; none is a collective):

    1. :meth:`prepare` once the state exists (optional; ``background=True`` returns at once),
       and :meth:`wait_prepared` where start-up is timed.
    2. Per save: :meth:`admit` with the state's bytes when :meth:`host_bytes` is 0 (the first
       staging: fail early on too little memory), then :meth:`stage` with ``wait=False``; the
       batch's tensors replace the state's (``owns_copies``: they are this save's own copies).
    3. :meth:`gate` wraps the writer's function so that it waits for the copies; once
       :meth:`StagedBatch.wait` returns, :meth:`publish` releases (or, on failure, cancels) it.
    4. :meth:`StagedBatch.release` after the commit: the buffers may be reused or freed.
    5. :meth:`close` at the end: frees everything; no call may follow.
    """

    owns_copies: bool  # stage() returns copies owned by the save (not the caller's tensors)

    def gate(self, write: Callable[..., Any], *, timeout_s: float) -> tuple[Callable[..., Any], int]:
        """``write`` made to wait until :meth:`publish` of the returned ticket (0: no gate)."""

    def publish(self, ticket: int, *, ok: bool) -> None:
        """Release the write gated with ``ticket`` (``ok=False``: it writes nothing)."""

    def prepare(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
                background: bool = False,
                then: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Allocate buffers for ``tensors`` ahead of the first save; then call ``then`` with
        them, in the order of ``tensors`` (in the background thread with ``background``), where
        the stager has buffers, or with None where the allocation failed (``then`` may run
        collectives: every rank reaches it). An error of ``then`` is logged, never raised."""

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        """Until a background :meth:`prepare` is done (at most ``timeout_s``); whether it is."""

    def prepare_failure(self, *, take: bool = False) -> BaseException | None:
        """The error of a background :meth:`prepare` that the next :meth:`stage` would raise
        (``take``: cleared, so that stage allocates again), or None."""

    def stage(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
              wait: bool = True) -> StagedBatch:
        """Copy ``tensors`` to host memory; with ``wait=False`` the copies may still run."""

    def host_bytes(self) -> int:
        """Host memory currently held for staging."""

    def close(self) -> None:
        """Free every buffer. Idempotent."""
