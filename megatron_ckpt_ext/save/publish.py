"""Telling the writer that a save's staged copies have landed, at once or, with
``--ckpt-overlap-snapshot``, from a thread while training goes on.

With the overlap, ``save()`` returns with the device-to-host copies in flight; a global
``torch.optim`` step pre-hook makes the trainer's stream wait for them before the next optimizer
step changes the state (:meth:`Publisher.wait_for_snapshot`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from .. import backend
from .._runtime import warn_once
from ..hooks import SaveHooks
from ..staging.base import Stager
from .report import SaveRecord

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)


class Publisher:
    """Publishes each save's staged copies to its gated writer; ``overlap``: in the background."""

    def __init__(self, stager: Stager, hooks: SaveHooks, *, overlap: bool,
                 on_step: Callable[[], None] | None = None) -> None:
        """``on_step``: what the optimizer step pre-hook calls while an overlapped save's copies
        are pending (default :meth:`wait_for_snapshot`)."""
        self.stager, self.hooks, self.overlap = stager, hooks, overlap
        self._on_step = on_step or self.wait_for_snapshot
        self._snapshot: SaveRecord | None = None  # overlapped save nothing has waited for yet
        self._thread: threading.Thread | None = None
        self._step_hook = None
        if overlap:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._step_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def wait_staged(self, record: SaveRecord) -> None:
        """Until ``record``'s staged copies are in host memory; staging_s then covers the
        copies, not the planning that overlapped them. Idempotent."""
        batch = record.held.batch
        if batch is None:
            return
        batch.wait()
        # a load's kept read chunks go now, a whole save interval before the next save's copies
        # (their release holds every CUDA call; at the commit it could meet the next save's)
        backend.release_read_chunks()
        record.staging_s = batch.copy_s if batch.copy_s is not None else batch.staging_s
        if batch.queue_wait_s is not None:  # the copies' wait for work queued on the device
            record.detail["copy_queue_wait_s"] = round(batch.queue_wait_s, 6)
        self.hooks.at("copies_landed", record)

    def publish(self, record: SaveRecord) -> None:
        """Release ``record``'s gated writer once its copies landed (from a thread when
        overlapping and the write is gated); on failure tell it to write nothing, and raise."""
        if self.overlap and record.held.seq:
            self._publish_in_background(record)
        else:
            self._publish(record)

    def _publish(self, record: SaveRecord) -> None:
        try:
            self.wait_staged(record)
        except BaseException:
            self.stager.publish(record.held.seq, ok=False)
            raise
        self.stager.publish(record.held.seq, ok=True)

    def _publish_in_background(self, record: SaveRecord) -> None:
        """A failure of the copies is published too (the writer writes nothing, the save is
        reported failed at its finalize) and logged here."""
        record.held.copies = record.held.batch.copies_in_flight()
        self.join()
        self._snapshot = record

        def publish() -> None:
            try:
                self._publish(record)
            except BaseException as e:  # noqa: BLE001 - the writer was told; reported there
                logger.error("checkpoint iteration %d: staging copies failed, nothing will be "
                             "written: %s: %s", record.iteration, type(e).__name__, e)

        self._thread = threading.Thread(target=publish, name="mcx-snapshot-publish", daemon=True)
        self._thread.start()

    def before_save(self, iteration: int) -> None:
        """A save must not start while an overlapped one's copies may still read the state."""
        if self._snapshot is None:
            return
        warn_once(
            "overlap-not-waited",
            f"--ckpt-overlap-snapshot: save {iteration} started before anything waited for the "
            f"previous save's copies (iteration {self._snapshot.iteration}); if the state "
            "changed in between, that checkpoint may hold some new values. Step a torch.optim "
            "optimizer (its pre-hook waits) or call Checkpointer.wait_for_snapshot() before "
            "changing the state.")
        self.wait_for_snapshot(blocking=True)

    def wait_for_snapshot(self, *, blocking: bool = False) -> None:
        """Make the current CUDA stream wait for the overlapped save's copies (no host wait);
        ``blocking``: also wait on the host until they are published. Idempotent."""
        record, self._snapshot = self._snapshot, None
        if record is not None:
            for copies in record.held.copies:
                copies.order_before_current_stream()
        if blocking:
            self.join()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._snapshot is not None:
            self._on_step()

    def join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def close(self) -> None:
        """Remove the step hook and let the copies in flight land (before buffers are freed)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._snapshot = None
        self.join()
