"""Device-to-host copies of a stage: host sources copied at once, device sources queued on a copy
stream per device after the work queued so far, returned as the pending copies
:meth:`~.batch.StagedBatch.wait` waits for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .batch import _Copies

__all__: list[str] = []


class _CopyStreams:
    """Mixed into :class:`~.shm.ShmStager`: one copy stream per device, created at first use."""

    if TYPE_CHECKING:
        _streams: dict[torch.device, torch.cuda.Stream]
        _queued: dict[torch.device, torch.cuda.Event]  # the event before the copy stream's wait

    def _copy(self, staged: list[torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[_Copies]:
        """Device sources are queued on a copy stream per device (after the work queued so far
        on the current stream), each device's in one call; host sources are copied here, while
        the device's copies run. Returns the device copies for StagedBatch.wait."""
        on_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        on_host = []
        for dst, src in zip(staged, tensors):
            if src.is_cuda:
                dsts, srcs = on_device.setdefault(src.device, ([], []))
                dsts.append(dst), srcs.append(src)
            else:
                on_host.append((dst, src))
        pending = []
        with torch.no_grad():  # the copies join no autograd graph (sources may require grad)
            for device, (dsts, srcs) in on_device.items():
                stream, start = self._copy_stream(device)
                with torch.cuda.stream(stream):  # once per device: entering it costs ~25 us
                    _copy_all(dsts, srcs, non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                pending.append(_Copies(start, end, device, self._queued.pop(device, None)))
            for dst, src in on_host:
                dst.copy_(src)
        return pending

    def _copy_stream(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Event]:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        queued = torch.cuda.Event(enable_timing=True)  # before the wait: queued -> start is
        queued.record(stream)  # how long the copies waited for the work queued on the device
        self._queued[device] = queued  # (stage_detail's copy_queue_wait_s)
        stream.wait_stream(torch.cuda.current_stream(device))  # sources are final up to now
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return stream, start


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, non_blocking: bool) -> None:
    """``dst.copy_(src)`` for each pair, issued by one call where torch has ``_foreach_copy_``."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dsts, srcs, non_blocking=non_blocking)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src, non_blocking=non_blocking)
