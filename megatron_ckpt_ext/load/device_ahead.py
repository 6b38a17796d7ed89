"""A restore from memory copied to the device ahead of its load: while Megatron builds the model,
the sealed snapshot's buffers are copied into one device block through the restore's pinned
bounce pool, each summed against its seal on the way (load/prepared.py). The load then copies
device to device into its targets (tens of GB/s become a TB/s); a buffer whose sum did not match
is not taken from the block (the load sums it again from the host, and refuses it).

Only where the device has room: the block holds the snapshot's bytes once more while the model
and optimizer it fills are built beside it. Which block (docs/MEMORY.md, thirty-first session):
- torch's own (its caching allocator), where the device's free memory holds the block beside
  all the memory torch held in the process that sealed the snapshot (``Seal.device_peak``),
  plus a margin: given back to torch's cache after the load, where training reuses it. Freeing
  a device block costs ~7 ms per GB of driver time on some H200s, which the next allocation
  waits for; a cached block is never freed.
- else (``kinds="any"``: ``--ckpt-restore-prefetch on``) CUDA managed memory where the free
  memory is at least ``ROOM_FACTOR`` times the bytes (load/managed_block.py): a model that needs
  the room evicts its pages to host memory instead of failing to build; freed after the load.
- else none: the load copies from host memory."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

from .._runtime import rank
from .._threads import local_world_size
from ..debug import env_switch
from . import managed_block as managed

__all__ = ["ROOM_FACTOR", "DeviceAhead", "blocks_for"]

logger = logging.getLogger(__name__)

ROOM_FACTOR = 4  # a managed block: free device memory at least this many times its bytes
BESIDE_MARGIN = 1 << 30  # a cached block: room beyond the sealing run's peak (CUDA context,
# NCCL's and cuBLAS's memory outside torch's allocator), and a tenth of that peak again
_ALIGN = 512  # each buffer's place in the block starts on this boundary


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DeviceAhead:
    """The device block and the snapshot's bytes copied into it, each buffer summed on the way
    (:meth:`fill`, on the preparing thread); :meth:`taken` by the load."""

    def __init__(self, buffers: Sequence[torch.Tensor], device: Any, block: torch.Tensor,
                 offsets: dict[int, int], kind: str = "cached") -> None:
        self._buffers, self._device, self.block, self._offsets = buffers, device, block, offsets
        self.views: dict[int, torch.Tensor] = {}  # the buffers copied and matching their seal
        self.seconds = 0.0  # how long fill() took (the load report's device_ahead_fill_s)
        self.left = 0  # buffers fill() left because the load came first
        self.kind = kind  # "cached": torch's block (on CPU always); "managed" (CUDA)

    @classmethod
    def start(cls, buffers: Sequence[torch.Tensor], wanted: set[int], device: Any, *,
              free_bytes: Callable[[Any], int] | None = None, kinds: str = "any",
              beside: int = 0) -> DeviceAhead | None:
        """The block for the ``wanted`` buffers on ``device`` (a CUDA device, or a CPU device
        in tests), or None where the device lacks room (said on rank 0). ``kinds``: "cached"
        (torch's block only) or "any"; ``beside``: the sealing run's peak (0: unknown)."""
        device = torch.device(device)
        offsets, total = {}, 0
        for i in sorted(wanted):
            offsets[i] = total
            total += -(-_nbytes(buffers[i]) // _ALIGN) * _ALIGN
        if not total:
            return None
        try:
            free = (free_bytes or _free_bytes)(device)
            kind, why = _kind(total, free, kinds, beside, _sharers(device))
            if kind is None:
                _not_ahead(why)
                return None
            block = (torch.empty(total, dtype=torch.uint8, device=device)
                     if device.type != "cuda" or kind == "cached"
                     else managed.managed_block(total, device))
            if block is None:
                _not_ahead("the device gives no CUDA managed memory")
                return None
        except (RuntimeError, AttributeError, AssertionError) as e:  # no usable device: the
            logger.debug("no copy to the device ahead of the load: %s", e)  # load copies it all
            return None
        return cls(buffers, device, block, offsets, kind)

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
        if block.is_cuda and self.kind == "managed":
            managed.free_later(block)  # (a cached block goes back to torch's cache: no free)


def blocks_for(mode: str, *, early: bool) -> str:
    """The blocks a restore prepared ahead may copy the snapshot into, by
    ``--ckpt-restore-prefetch`` ``mode``: "any" (on), "cached" (auto, only where the restore is
    prepared ``early``: in Megatron's initialisation, not beside the model build, which the
    copy holds up: docs/MEMORY.md), "" (none)."""
    return "any" if mode == "on" else "cached" if mode == "auto" and early else ""


def _kind(total: int, free: int, kinds: str, beside: int,
          sharers: int = 1) -> tuple[str | None, str]:
    """Which block for ``total`` bytes with ``free`` bytes free on the device ("cached",
    "managed" or None), and why none. ``MCX_PREFETCH_BLOCK`` may force one kind. ``sharers``:
    the ranks of this host on each device (each counts only its own share of ``free``: they
    decide at once, each knowing only its own seal's peak)."""
    gib = 2**30
    forced = env_switch("MCX_PREFETCH_BLOCK")
    if forced in ("cached", "managed"):
        if total * ROOM_FACTOR > free:
            return None, (f"its {total / gib:.2f} GiB need {ROOM_FACTOR}x that free on the "
                          f"device, {free / gib:.2f} GiB are")
        return forced, ""
    need, share = beside + beside // 10 + BESIDE_MARGIN, free // max(1, sharers)
    if beside and share - total >= need:
        return "cached", ""
    shared = f" (this rank's share of {sharers} on the device)" if sharers > 1 else ""
    why = (f"its {total / gib:.2f} GiB and the {need / gib:.2f} GiB the sealing run held (with a "
           f"margin) do not fit the {share / gib:.2f} GiB free{shared}" if beside
           else "the seal does not say what device memory its run held")
    if kinds != "any":
        return None, why
    if total * ROOM_FACTOR > free:
        return None, (f"{why}, and a managed block's {total / gib:.2f} GiB need {ROOM_FACTOR}x "
                      "that free")
    return "managed", ""


def _sharers(device: torch.device) -> int:
    """This host's ranks on each of its devices (8 ranks on one GPU: 8)."""
    devices = torch.cuda.device_count() if device.type == "cuda" else 1
    return max(1, -(-local_world_size() // max(1, devices)))


def _not_ahead(why: str) -> None:
    if rank() == 0:
        logger.info("--ckpt-restore-prefetch: the snapshot is not copied to the device ahead of "
                    "the load (%s); the load copies it from host memory", why)


def _free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # (a CPU device only with an explicit free_bytes, in tests)
    return int(torch.cuda.mem_get_info(device)[0])
