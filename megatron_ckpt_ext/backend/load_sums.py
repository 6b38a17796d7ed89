"""The CRC-32 sums a parallel load (:mod:`.load_reader`) takes of the files a rank reads whole,
from the bytes as they pass: the small items and each direct item's zip headers as read, each
chunk of a record on summing threads beside the reading ones, and the few bytes between the
items read here; folded per file into the CRC-32 the manifest holds. ``plan`` and ``files``
below are load_reader's item plan and open files."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .. import manifest
from .._crc import crc32

__all__: list[str] = []


class _Sums:
    """CRC-32 pieces of the files a rank reads whole: the small items and each direct item's zip
    headers summed as read, each chunk of a record summed on a summing thread once read."""

    def __init__(self, enabled: bool, threads: int, *,
                 executor: Callable[..., ThreadPoolExecutor] = ThreadPoolExecutor) -> None:
        self.enabled, self._threads, self._executor = enabled, threads, executor
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list = []
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
        finally:
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
