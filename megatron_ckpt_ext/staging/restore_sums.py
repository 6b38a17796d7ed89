"""A restore from memory's sums taken on the device: each pinned buffer copied whole into its
target (staging/restore_copy.py, the direct copies) is summed there once it landed, by the
device CRC the storage load uses (:mod:`.._crc_device`), instead of on the host's threads before
the copy. The host then only maps and pins the snapshot beside the model build; the few bytes
outside a target's aligned middle (``device_span``) are summed on the host from the pinned
buffer, the middle on the device from the target as it landed.

What the load checks is the same: each buffer's CRC-32 against its seal (a flipped byte in the
buffer is in its copy too). The answer comes later, once the sums are read back (one transfer,
after the copies): ``bad()``. Only where the kernel is ready (``_crc_device.ready``: built and
checked against zlib); elsewhere the copy threads sum on the host as before."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Sequence

import torch

from .._crc import crc32
from ..debug import env_switch

__all__ = ["DeviceChecks", "wanted"]


def wanted() -> bool:
    """Whether a prepared restore sums on the device (``MCX_RESTORE_SUMS=device``; not the
    default: docs/DEBUGGING.md, docs/MEMORY.md)."""
    return env_switch("MCX_RESTORE_SUMS") == "device"


def usable(device: torch.device) -> bool:
    """Whether targets on ``device`` can be summed there now (a CUDA device whose CRC kernel is
    built and checked)."""
    if device.type != "cuda":
        return False
    from .._crc_device import ready

    return ready(device)


class DeviceChecks:
    """The sums of some jobs' targets, enqueued after their copies on a stream of their own."""

    def __init__(self, jobs: Sequence[tuple[torch.Tensor, int, torch.Tensor]],
                 indices: Sequence[int]) -> None:
        from .._crc_device import SLOT_BYTES, DeviceCrc, SlotSums, device_span

        t0 = time.perf_counter()
        self._want = {i: jobs[i][1] for i in indices}
        self._parts: dict[int, list[tuple[bool, int, int]]] = {}  # (on device, crc|slot, n)
        self._bytes = 0
        self._device = jobs[indices[0]][2].device if indices else None
        self._stream = None
        self._slots = None
        if self._device is None:
            self.issue_s = 0.0
            return
        if self._device.type == "cuda":  # (a CPU target: the same sums as torch operations)
            self._stream = torch.cuda.Stream(device=self._device)
            self._stream.wait_stream(torch.cuda.current_stream(self._device))  # after the copies
        self._slots = SlotSums(DeviceCrc.on(self._device))
        with self._on_stream():
            for i in indices:
                src, _, dst = jobs[i]
                host, landed = _bytes(src), _bytes(dst)
                n = landed.numel()
                skip, length = device_span(landed.data_ptr(), n)
                parts = []
                if skip:
                    parts.append((False, crc32(memoryview(host[:skip].numpy())), skip))
                for a in range(skip, skip + length, SLOT_BYTES):
                    b = min(skip + length, a + SLOT_BYTES)
                    parts.append((True, self._slots.add(landed[a:b]), b - a))
                if skip + length < n:
                    parts.append((False, crc32(memoryview(host[skip + length:].numpy())),
                                  n - skip - length))
                self._parts[i] = parts
                self._bytes += length
        self.issue_s = round(time.perf_counter() - t0, 6)

    def _on_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self._device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    @property
    def device_bytes(self) -> int:
        return self._bytes

    def bad(self) -> list[int]:
        """The indices whose CRC-32 differs from the one expected (waits for the copies and the
        sums: one device-to-host transfer)."""
        from .._crc_device import finish
        from ..manifest import crc32_combine

        if self._device is None:
            return []
        with self._on_stream():
            values = self._slots.values()
        out = []
        for i, parts in self._parts.items():
            crc = None
            for on_device, value, n in parts:
                piece = finish(values[value], n) if on_device else value
                crc = piece if crc is None else crc32_combine(crc, piece, n)
            if (crc or 0) != self._want[i]:
                out.append(i)
        return sorted(out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)
