"""A restore from memory copied to the device ahead of its load: while Megatron builds the model,
the sealed snapshot's buffers are copied into one device block through the restore's pinned
bounce pool, each summed against its seal on the way (load/prepared.py). The load then copies
device to device into its targets (tens of GB/s become a TB/s); a buffer whose sum did not match
is not taken from the block (the load sums it again from the host, and refuses it).

Only where the device has room: the block holds the snapshot's bytes once more while the model
and optimizer it fills are built beside it (they take about those bytes again, plus gradients),
so it is made only when the device's free memory is at least ``ROOM_FACTOR`` times the bytes,
and given back once the load's copies have landed. On a CUDA device the block is managed
memory (load/managed_block.py): a model that needs the room anyway evicts the block's pages to
host memory instead of failing to build; where managed memory is not given, no block is made.
``--ckpt-restore-prefetch`` turns it on (off by default: docs/MEMORY.md says why)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

from .._runtime import rank
from ..debug import env_switch
from . import managed_block as managed

__all__ = ["ROOM_FACTOR", "DeviceAhead"]

logger = logging.getLogger(__name__)

ROOM_FACTOR = 4  # free device memory at least this many times the bytes copied ahead
_ALIGN = 512  # each buffer's place in the block starts on this boundary


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DeviceAhead:
    """The device block and the snapshot's bytes copied into it, each buffer summed on the way
    (:meth:`fill`, on the preparing thread); :meth:`taken` by the load."""

    def __init__(self, buffers: Sequence[torch.Tensor], device: Any, block: torch.Tensor,
                 offsets: dict[int, int]) -> None:
        self._buffers, self._device, self.block, self._offsets = buffers, device, block, offsets
        self.views: dict[int, torch.Tensor] = {}  # the buffers copied and matching their seal
        self.seconds = 0.0  # how long fill() took (the load report's device_ahead_fill_s)
        self.left = 0  # buffers fill() left because the load came first
        self.cached = False  # the block is torch's (MCX_PREFETCH_BLOCK=cached), not managed

    @classmethod
    def start(cls, buffers: Sequence[torch.Tensor], wanted: set[int], device: Any, *,
              free_bytes: Callable[[Any], int] | None = None) -> DeviceAhead | None:
        """The block for the ``wanted`` buffers on ``device`` (a CUDA device, or a CPU device
        in tests), or None where the device lacks room (said at debug level)."""
        device = torch.device(device)
        offsets, total = {}, 0
        for i in sorted(wanted):
            offsets[i] = total
            total += -(-_nbytes(buffers[i]) // _ALIGN) * _ALIGN
        if not total:
            return None
        try:
            free = (free_bytes or _free_bytes)(device)
            if total * ROOM_FACTOR > free:
                _not_ahead(f"its {total / 2**30:.2f} GiB need {ROOM_FACTOR}x that free on the "
                           f"device, {free / 2**30:.2f} GiB are")
                return None
            cached = device.type != "cuda" or env_switch("MCX_PREFETCH_BLOCK") == "cached"
            block = (torch.empty(total, dtype=torch.uint8, device=device) if cached
                     else managed.managed_block(total, device))
            if block is None:
                _not_ahead("the device gives no CUDA managed memory")
                return None
        except (RuntimeError, AttributeError, AssertionError) as e:  # no usable device: the
            logger.debug("no copy to the device ahead of the load: %s", e)  # load copies it all
            return None
        ahead = cls(buffers, device, block, offsets)
        ahead.cached = cached
        return ahead

    def fill(self, crcs: Sequence[int], *, threads: int,
             stop: threading.Event | None = None) -> set[int]:
        """Copy every wanted buffer into its place through the restore's pinned bounce pool,
        summing each chunk on the way (``crcs``: the seal's, per buffer), and wait until the
        copies landed: the indices whose bytes match their seal (only those the load takes
        from here). Faster than pinning the fresh mapping first (docs/MEMORY.md). Once
        ``stop`` is set (the load came) the pieces not started are left, and so are their
        buffers: the load copies those from host memory, summed on the way."""
        from ..staging.restore_copy import start_copy_verified

        t0 = time.perf_counter()
        order = sorted(self._offsets)
        jobs = [(self._buffers[i], crcs[i], self._view(i)) for i in order]
        copying = start_copy_verified(jobs, threads=threads, stop=stop)
        copying.finish()
        left = {order[k] for k in copying.bad + copying.skipped}
        self.left = len(copying.skipped)  # (the load report's device_ahead_left)
        self.views = {i: jobs[k][2] for k, i in enumerate(order) if i not in left}
        self.seconds = round(time.perf_counter() - t0, 6)
        return set(self.views)

    def _view(self, i: int) -> torch.Tensor:
        at = self._offsets[i]
        return self.block[at:at + _nbytes(self._buffers[i])]  # the buffer's bytes

    def taken(self, stream: Any | None) -> dict[int, torch.Tensor]:
        """For the load: the buffers on the device (landed: :meth:`fill` waited). The block is
        given back only after the load's copies from it were waited for (:meth:`release`)."""
        return dict(self.views)

    def release(self) -> None:
        """Give the block back (after the load's copies were waited for, or never taken): the
        managed memory is freed with its last view."""
        self.views.clear()
        block, self.block = self.block, torch.empty(0, dtype=torch.uint8)
        if block.is_cuda and not self.cached:
            managed.free_later(block)  # (a cached block goes back to torch's cache: no free)


def _not_ahead(why: str) -> None:
    if rank() == 0:
        logger.info("--ckpt-restore-prefetch: the snapshot is not copied to the device ahead of "
                    "the load (%s); the load copies it from host memory", why)


def _free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # (a CPU device only with an explicit free_bytes, in tests)
    return int(torch.cuda.mem_get_info(device)[0])
