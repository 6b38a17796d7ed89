"""A restore from memory copied to the device ahead of its load: while Megatron builds the model,
each buffer of the sealed snapshot that was summed against its seal and pinned (load/prepared.py)
is also copied into one device block on a stream of its own. The load then copies device to
device into its targets (tens of GB/s become a TB/s), and only what was not copied ahead goes
from the host as before.

Only where the device has room: the block holds the snapshot's bytes once more while the model
and optimizer it fills are built beside it (they take about those bytes again, plus gradients),
so it is made only when the device's free memory is at least ``ROOM_FACTOR`` times the bytes,
and given back (``torch.cuda.empty_cache``) once the load's copies have landed.
``--no-ckpt-restore-prefetch`` turns it off."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

__all__ = ["ROOM_FACTOR", "DeviceAhead"]

logger = logging.getLogger(__name__)

ROOM_FACTOR = 4  # free device memory at least this many times the bytes copied ahead
_ALIGN = 512  # each buffer's place in the block starts on this boundary


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class DeviceAhead:
    """The device block and the copies issued into it; :meth:`issue` per buffer as it is pinned
    (from the preparing thread), :meth:`taken` by the load."""

    def __init__(self, buffers: Sequence[torch.Tensor], wanted: set[int], device: Any,
                 block: torch.Tensor, offsets: dict[int, int], stream: Any) -> None:
        self._buffers, self._device, self.block = buffers, device, block
        self._offsets, self._stream = offsets, stream
        self.views: dict[int, torch.Tensor] = {}
        self.ready: Any = None  # the stream's event after the last copy issued
        self.nbytes = 0

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
                logger.debug("the snapshot is not copied to the device ahead of the load: %d "
                             "bytes need %d x free, %d free", total, ROOM_FACTOR, free)
                return None
            stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else _Nothing():
                block = torch.empty(total, dtype=torch.uint8, device=device)  # the stream's pool
        except (RuntimeError, AttributeError, AssertionError) as e:  # no usable device: the
            logger.debug("no copy to the device ahead of the load: %s", e)  # load copies it all
            return None
        return cls(buffers, wanted, device, block, offsets, stream)

    def issue(self, i: int) -> None:
        """Copy buffer ``i`` (pinned by now) into its place, if it is one of the wanted."""
        at = self._offsets.get(i)
        if at is None or i in self.views:
            return
        n = _nbytes(self._buffers[i])
        view = self.block[at:at + n]
        if self._stream is None:
            view.copy_(_bytes(self._buffers[i]))
        else:
            with torch.cuda.stream(self._stream):
                view.copy_(_bytes(self._buffers[i]), non_blocking=True)
        self.views[i] = view
        self.nbytes += n

    def seal_issued(self) -> None:
        """After the last :meth:`issue`: the event the load's stream waits for."""
        if self._stream is not None:
            self.ready = self._stream.record_event()

    def taken(self, stream: Any | None) -> dict[int, torch.Tensor]:
        """For the load: ``stream`` (its current stream) waits for the copies ahead; the block is
        marked used there, so it is not handed out again before the load's copies read it."""
        if stream is not None and self.ready is not None:
            stream.wait_event(self.ready)
            self.block.record_stream(stream)
        return dict(self.views)

    def release(self) -> None:
        """Give the block back (after the load's copies were waited for, or never taken)."""
        if self._stream is not None and self.ready is not None:
            self.ready.synchronize()
        self.views.clear()
        self.block = torch.empty(0, dtype=torch.uint8)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # (a CPU device only with an explicit free_bytes, in tests)
    return int(torch.cuda.mem_get_info(device)[0])
