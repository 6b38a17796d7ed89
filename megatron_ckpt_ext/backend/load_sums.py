"""The CRC-32 sums a parallel load (:mod:`.load_reader`) takes of the files a rank reads whole,
from the bytes as they pass: the small items and each direct item's zip headers as read, each
chunk of a record on summing threads beside the reading ones, and the few bytes between the
items read here; folded per file into the CRC-32 the manifest holds. ``plan`` and ``files``
below are load_reader's item plan and open files."""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .. import manifest
from .._crc import crc32

__all__: list[str] = []


class _Sums:
    """CRC-32 pieces of the files a rank reads whole: the small items and each direct item's zip
    headers summed as read, each chunk of a record summed on a summing thread once read."""

    def __init__(self, enabled: bool, threads: int, *,
                 executor: Callable[..., ThreadPoolExecutor] = ThreadPoolExecutor,
                 on_device: bool = False) -> None:
        self.enabled, self._threads, self._executor = enabled, threads, executor
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list = []
        self._device = _DeviceSums() if enabled and on_device else None
        self.device_bytes = 0  # summed on the device
        self.device_busy_s = 0.0  # the device-sum thread's seconds at work (its launches)
        self._items: dict[str, list[tuple[int, int]]] = {}  # planned whole items per file
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def _add(self, name: str, offset: int, length: int, crc: int) -> None:
        with self._lock:
            self._pieces.setdefault(name, []).append((offset, length, crc))

    def whole_item(self, item_md: Any, raw: bytes) -> None:
        if self.enabled and not getattr(item_md, "transform_descriptors", None):
            name = str(item_md.relative_path)
            self._items.setdefault(name, []).append((item_md.offset, item_md.length))
            self._add(name, item_md.offset, len(raw), crc32(raw))

    def direct_item(self, plan: Any, item_md: Any) -> None:
        """A direct item reading its whole record: its headers now, its record's chunks later."""
        layout = plan.layout
        if not self.enabled or plan.span is None or layout is None or \
                tuple(plan.span) != tuple(layout.record):
            return
        plan.summed = True
        name = str(item_md.relative_path)
        self._items.setdefault(name, []).append((item_md.offset, item_md.length))
        head, tail = layout.edges
        self._add(name, item_md.offset, len(head), crc32(head))
        self._add(name, layout.record[0] + layout.record[1], len(tail), crc32(tail))

    def chunk(self, plan: Any, offset: int, view: memoryview,
              then: Callable[[], None] | None = None) -> None:
        """Sum ``view`` (bytes at ``offset`` of the plan's file) on a summing thread, then run
        ``then``; :meth:`wait` waits for every one."""
        if not plan.summed:
            if then is not None:
                then()
            return
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = self._executor(max_workers=self._threads,
                                                thread_name_prefix="mcx-sum")
        # if this raises, ``then`` has not run: the caller still holds (and lends back) the chunk
        self._jobs.append(self._pool.submit(self._sum, plan.what, offset, view, then))

    def on_device(self, plan: Any, device: Any) -> bool:
        """Whether ``plan``'s chunks copied to ``device`` are summed there (:meth:`device_chunk`)
        rather than on the host: the device CRC is ready on it (``_crc_device.ready``)."""
        return plan.summed and self._device is not None and self._device.ready(device)

    def device_chunk(self, plan: Any, offset: int, landed: Any, copied: Any,
                     view: memoryview) -> None:
        """Sum ``landed`` (a device tensor's bytes, at ``offset`` of the plan's file; ``view``
        the same bytes on the host, summed here now) on the device once the event ``copied``
        has passed: its aligned middle (``_crc_device.device_span``) there, the few bytes
        before and after it here; :meth:`wait` collects the sums."""
        from .._crc_device import device_span

        skip, length = device_span(landed.data_ptr(), landed.numel())
        for a, b in ((0, skip), (skip + length, len(view))):
            if b > a:
                self._add(plan.what, offset + a, b - a, crc32(view[a:b]))
        if length:
            self._device.put(plan.what, offset + skip, landed[skip:skip + length], copied)
            with self._lock:
                self.device_bytes += length

    def _sum(self, name: str, offset: int, view: memoryview,
             then: Callable[[], None] | None) -> None:
        try:
            self._add(name, offset, len(view), crc32(view))
        finally:
            if then is not None:
                then()

    def wait(self) -> None:
        """Every chunk summed (and its ``then`` run); the first error raised."""
        try:
            for job in self._jobs:
                job.result()
            if self._device is not None:
                for name, offset, length, crc in self._device.collect():
                    self._add(name, offset, length, crc)
                self.device_busy_s = self._device.busy_s
        finally:
            if self._device is not None:
                self._device.close()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def planned(self, files: Any) -> set[str]:
        """The files whose every byte the planned reads cover, once the few bytes between them
        (items this read does not load, e.g. the common state megatron-core 0.19 loads
        separately, up to ``_GAP_LIMIT`` per file) are read and summed here."""
        covered = set()
        for name, items in self._items.items():
            fd = files.fd(name)
            gaps = _gaps(items, os.fstat(fd).st_size)
            if gaps is None or sum(n for _, n in gaps) > _GAP_LIMIT:
                continue
            read = [(offset, os.pread(fd, n, offset)) for offset, n in gaps]
            if all(len(data) == n for (_, n), (_, data) in zip(gaps, read)):
                for offset, data in read:
                    self._add(name, offset, len(data), crc32(data))
                covered.add(name)
        return covered

    def file_crcs(self, files: Any, names: set[str]) -> dict[str, tuple[int, int | None]]:
        out = {}
        for name in names:
            size = os.fstat(files.fd(name)).st_size
            out[name] = (size, manifest.tiled_crc32(self._pieces.get(name, []), size))
        return out


_GAP_LIMIT = 1 << 20


def _gaps(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]] | None:
    """The (offset, bytes) ranges of [0, size) outside ``spans``; None when spans overlap or
    run past the end."""
    gaps, at = [], 0
    for offset, length in sorted(spans):
        if offset < at:
            return None
        if offset > at:
            gaps.append((at, offset - at))
        at = offset + length
    if at > size:
        return None
    return gaps + ([(at, size - at)] if at < size else [])


class _DeviceSums:
    """CRC-32s taken on the device (:mod:`.._crc_device`) by one thread of its own, in the order
    the chunks landed: the reading threads only record an event and hand the chunk over (kernel
    launches from many threads would take turns on the GIL)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready: dict[str, bool] = {}
        self._done: list = []  # (name, offset, length, its slot's index)
        self._slot_values: list[int] = []
        self._error: BaseException | None = None
        self._start_lock = threading.Lock()
        self.busy_s = 0.0  # seconds from taking a chunk to its launches issued, all chunks

    def ready(self, device: Any) -> bool:
        """Whether chunks copied to ``device`` are summed here: its CRC is built, and it is the
        first device this load sums on (one thread, one device; others sum on the host)."""
        key = str(device)
        with self._start_lock:
            if key not in self._ready:  # once per load: built by prepare_restore, or not used
                from .._crc_device import ready

                first = not any(self._ready.values())
                self._ready[key] = first and ready(device)
            return self._ready[key]

    def put(self, name: str, offset: int, landed: Any, copied: Any) -> None:
        """``landed``: a ``_crc_device.device_span`` piece (16-byte aligned, a multiple of
        ``ALIGN`` bytes; ``_Sums.device_chunk`` cuts them); any other is an error collect()
        raises."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(landed.device,),
                                                daemon=True, name="mcx-sum-device")
                self._thread.start()
        self._queue.put((name, offset, landed, copied))

    def _run(self, device: Any) -> None:
        import torch

        from .._crc_device import SLOT_BYTES, DeviceCrc, SlotSums

        stream = slots = None
        while (job := self._queue.get()) is not None:  # always drained up to its end
            if self._error is not None:
                continue
            t = time.perf_counter()
            try:
                if stream is None:
                    stream = torch.cuda.Stream(device=device)
                    slots = SlotSums(DeviceCrc.on(device))
                name, offset, landed, copied = job
                stream.wait_event(copied)
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    for a in range(0, landed.numel(), SLOT_BYTES):  # one slot a 64 MiB
                        piece = landed[a:a + SLOT_BYTES]
                        self._done.append((name, offset + a, piece.numel(), slots.add(piece)))
            except BaseException as e:  # noqa: BLE001 - raised by collect()
                self._error = e
            self.busy_s += time.perf_counter() - t
        try:
            if stream is not None:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    # the blocks folded; one transfer, which waits for everything queued
                    self._slot_values = slots.values()
        except BaseException as e:  # noqa: BLE001
            self._error = self._error or e

    def collect(self) -> list[tuple[str, int, int, int]]:
        """Every chunk's (file, offset, bytes, CRC-32), once all are summed (one transfer)."""
        from .._crc_device import finish

        if self._thread is None:
            return []
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        if not self._done:
            return []
        return [(name, offset, n, finish(self._slot_values[index], n))
                for name, offset, n, index in self._done]

    def close(self) -> None:
        if self._thread is not None:  # collect() was not reached (a failed read): end it
            self._queue.put(None)
            self._thread.join()
            self._thread = None
