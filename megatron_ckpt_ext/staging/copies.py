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
        """Host sources are copied here; device sources are queued on a copy stream per device
        (after the work queued so far on the current stream), returned for StagedBatch.wait."""
        started: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Event]] = {}
        for dst, src in zip(staged, tensors):
            if src.is_cuda:
                if src.device not in started:
                    started[src.device] = self._copy_stream(src.device)
                stream = started[src.device][0]
                with torch.cuda.stream(stream):
                    dst.copy_(src.detach(), non_blocking=True)
            else:
                dst.copy_(src.detach())
        pending = []
        for device, (stream, start) in started.items():
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            pending.append(_Copies(start, end, device, self._queued.pop(device, None)))
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
