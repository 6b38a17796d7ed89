"""Zero-copy reads of a warm checkpoint, beside the bounce reads of :mod:`.load_reader`.

Where every page of the files a load reads is in the page cache, the files are mapped read-only
and the device copies page-cache pages in place: a 64 MiB segment of a file is
``cudaHostRegister``-ed (read-only), the items' bytes in it are copied from the mapping straight
into their targets, and the segment is unregistered once those copies have landed. No core copies
those bytes: a bounce read moves each byte three times through host memory (the kernel's copy out
of the page cache, both ways, and the device's read of the pinned chunk), this path once.

Registration is serialised in the driver (one H200: 38-40 GB/s with 4, 8 or 16 registering
threads), the bounce reads by the cores and host memory (8 threads 26 GB/s, 16 threads 38 GB/s),
so the two run at once over one list of segments in file order: the zero-copy threads take
segments from its front, the reading threads from its back, each path at its own rate until they
meet (the same 8 GiB in 0.18 s = 45-49 GB/s, against 0.22 s for 16 bounce threads:
docs/benchmarks/README.md, twenty-first session).

A cold or partly cold load reads as before (a registration would fault the missing pages in, one
at a time), as does a load onto the CPU or one whose sums cannot run on the device. The mapping's
bytes are never read by a core: the few bytes of a piece that its device sum leaves to the host
are read with ``pread``."""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

__all__ = ["SEGMENT", "CudaPages", "Mapping", "Segment", "ZeroCopy", "segments", "zero_copy_threads"]

logger = logging.getLogger("megatron_ckpt_ext.backend")

SEGMENT = 64 << 20  # bytes of a file registered at once (a multiple of the page size)
REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
_PROT_READ, _MAP_SHARED = 0x1, 0x01
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def zero_copy_threads(read_threads: int) -> int:
    """Zero-copy threads beside ``read_threads`` reading ones: half as many, at least 1 (they
    wait in the driver more than they run: 4 beside 8 reached 45-46 GB/s on one H200)."""
    return max(1, read_threads // 2)


class Mapping:
    """One file mapped read-only and shared with the page cache; :meth:`tensor` a uint8 CPU
    tensor over all of it (never written: the pages are the page cache's)."""

    def __init__(self, fd: int) -> None:
        self.size = os.fstat(fd).st_size
        self.length = -(-self.size // _PAGE) * _PAGE  # whole pages: what is mapped
        if not self.size:
            raise ValueError("an empty file is not mapped")
        addr = _libc.mmap(None, self.length, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of a checkpoint file failed")
        self.addr: int = addr
        self._tensor: Any = None

    def resident(self) -> bool:
        """Whether every page of the file is in the page cache now (``mincore``)."""
        import numpy as np

        pages = self.length // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(self.addr, self.length, vec) != 0:
            return False
        return bool((np.frombuffer(vec, dtype=np.uint8) & 1).all())

    def tensor(self) -> Any:
        import numpy as np
        import torch

        if self._tensor is None:
            array = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(self.addr))
            self._tensor = torch.from_numpy(array)
        return self._tensor

    def close(self) -> None:
        self._tensor = None
        if self.addr:
            _libc.munmap(self.addr, self.length)
            self.addr = 0


class Segment(NamedTuple):
    """``[start, end)`` of file ``what`` (page-aligned: what is registered) and the pieces
    ``(plan, a, b)`` of direct items' records that lie in it (bytes ``[a, b)`` of the record)."""
    what: str
    start: int
    end: int
    pieces: list


def segments(chunks: list, sizes: dict[str, int], seg: int | None = None) -> list[Segment]:
    """``chunks`` (plan, a, b), in file order, cut at the ``seg`` boundaries of their files'
    offsets and grouped by segment, in file order; ``sizes``: each file's size (a segment ends
    at the last page of its file at most; ``seg`` None: ``SEGMENT`` as the load starts)."""
    seg = seg or SEGMENT
    grouped: dict[tuple[str, int], list] = {}
    for plan, a, b in chunks:
        at = plan.span[0] + a
        while a < b:
            k = at // seg
            n = min(b - a, (k + 1) * seg - at)
            grouped.setdefault((plan.what, k), []).append((plan, a, a + n))
            a, at = a + n, at + n
    out = []
    for (what, k), pieces in grouped.items():
        end = min((k + 1) * seg, -(-sizes[what] // _PAGE) * _PAGE)
        out.append(Segment(what, k * seg, end, pieces))
    return out


class _PreadView:
    """The bytes ``[offset, offset + n)`` of ``fd`` as far as a slice of them is asked for (the
    host's share of a device sum): read then, never through the mapping."""

    def __init__(self, fd: int, offset: int, n: int) -> None:
        self._fd, self._offset, self._n = fd, offset, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, s: slice) -> bytes:
        a, b, _ = s.indices(self._n)
        return os.pread(self._fd, b - a, self._offset + a) if b > a else b""


class CudaPages:
    """The device side of a zero-copy read: registration, the copy from the mapping, its event."""

    def __init__(self) -> None:
        import torch

        self._rt = torch.cuda.cudart()

    def register(self, addr: int, n: int) -> str:
        err = self._rt.cudaHostRegister(addr, n, REGISTER_READ_ONLY)
        return "" if int(err) == 0 else str(err)

    def unregister(self, addr: int) -> None:
        self._rt.cudaHostUnregister(addr)

    def copy(self, target: Any, source: Any) -> None:
        import torch

        from .read_copies import thread_stream

        with torch.cuda.stream(thread_stream(target.device)):
            target.copy_(source, non_blocking=True)

    def event(self, device: Any) -> Any:
        import torch

        from .read_copies import thread_stream

        event = torch.cuda.Event()
        event.record(thread_stream(device))
        return event


class ZeroCopy:
    """The zero-copy half of one load's reads: its files mapped (every page resident), its
    threads, and what they moved. :meth:`open` decides whether the load can take it."""

    def __init__(self, maps: dict[str, Mapping], fds: dict[str, int], threads: int,
                 pages: Any) -> None:
        self._maps, self._fds, self._pages = maps, fds, pages
        self._threads = threads
        self._lock = threading.Lock()
        self._left: collections.deque = collections.deque()
        self._pool: ThreadPoolExecutor | None = None
        self.bytes = 0  # copied from the mapping
        self.segments = 0  # registered
        self.register_s = 0.0  # the zero-copy threads' seconds registering and unregistering
        self.failed = ""  # why a registration failed (the rest was read by the bounce threads)
        self._registered: list[int] = []  # addresses, unregistered at close()

    @classmethod
    def open(cls, files: Any, direct: list, *, threads: int, summed_on_device: Callable[[Any], bool],
             pages_factory: Callable[[], Any] = CudaPages) -> "ZeroCopy | None":
        """A zero-copy half for the reads of ``direct`` (load_reader's item plans), or None where
        the load reads as before: a target not on one CUDA device, a summed item whose device
        sum is not ready (``summed_on_device(plan)``), a file not wholly in the page cache, or
        a mapping refused."""
        devices = {str(p.target.device) for p in direct}
        if not direct or len(devices) != 1 or direct[0].target.device.type != "cuda":
            return None
        if any(p.summed and not summed_on_device(p) for p in direct):
            return None
        maps: dict[str, Mapping] = {}
        fds: dict[str, int] = {}
        try:
            for p in direct:
                if p.what not in maps:
                    fds[p.what] = files.fd(p.what)
                    maps[p.what] = Mapping(fds[p.what])
                    if not maps[p.what].resident():
                        raise LookupError(p.what)
            return cls(maps, fds, threads, pages_factory())
        except (OSError, ValueError, LookupError) as e:
            for m in maps.values():
                m.close()
            if not isinstance(e, LookupError):
                logger.debug("zero-copy reads not used: %s", e)
            return None

    def sizes(self) -> dict[str, int]:
        return {name: m.size for name, m in self._maps.items()}

    def take(self, front: bool) -> Segment | None:
        with self._lock:
            if not self._left:
                return None
            return self._left.popleft() if front else self._left.pop()

    def submit(self, work: list[Segment], read_pieces: Callable[[list], Any],
               landed: Callable[[], None], reading_pool: Any, reading_threads: int, *,
               sums: Any, busy: Any) -> list[Future]:
        """Run ``work``: this half's threads take segments from its front and copy them in
        place; ``reading_threads`` jobs on ``reading_pool`` take them from its back and read
        each segment's pieces with ``read_pieces`` (the bounce reads), then wait with
        ``landed`` for their last copies. The futures of both."""
        self._left.extend(work)
        self._read_pieces, self._landed = read_pieces, landed
        self._pool = ThreadPoolExecutor(max_workers=self._threads,
                                        thread_name_prefix="mcx-read-mapped")
        jobs = [self._pool.submit(self._run, sums, busy) for _ in range(self._threads)]

        def bounce() -> None:
            try:
                while (segment := self.take(front=False)) is not None:
                    read_pieces(segment.pieces)
            finally:
                landed()

        return jobs + [reading_pool.submit(bounce) for _ in range(reading_threads)]

    def _run(self, sums: Any, busy: Any) -> None:
        while not self.failed and (segment := self.take(front=True)) is not None:
            mapping = self._maps[segment.what]
            addr, n = mapping.addr + segment.start, segment.end - segment.start
            t = time.perf_counter()
            why = self._pages.register(addr, n)
            self._add_time(t)
            if why:  # this segment read the bounce way here, the rest by the reading threads
                with self._lock:
                    self.failed = self.failed or why
                logger.debug("zero-copy read: registration refused (%s)", why)
                try:
                    self._read_pieces(segment.pieces)
                finally:
                    self._landed()
                break
            with self._lock:
                self._registered.append(addr)
            t = time.perf_counter()
            moved = self._copy(segment, mapping, sums)
            busy.add("h2d", t)
            with self._lock:
                self.bytes += moved
                self.segments += 1

    def _copy(self, segment: Segment, mapping: Mapping, sums: Any) -> int:
        """Every piece of ``segment`` copied from the mapping into its target; summed ones
        handed to the device sums after one event for the segment's copies."""
        import torch

        source, moved, summed = mapping.tensor(), 0, []
        for plan, a, b in segment.pieces:
            at = plan.span[0] + a
            flat = plan.target.reshape(-1).view(torch.uint8)
            self._pages.copy(flat[a:b], source[at:at + b - a])
            moved += b - a
            if plan.summed:
                summed.append((plan, a, b, at, flat))
        if summed:
            copied = self._pages.event(segment.pieces[0][0].target.device)
            for plan, a, b, at, flat in summed:
                sums.device_chunk(plan, at, flat[a:b], copied,
                                  _PreadView(self._fds[plan.what], at, b - a))
        return moved

    def _add_time(self, since: float) -> None:
        with self._lock:
            self.register_s += time.perf_counter() - since

    def close(self) -> None:
        """The threads ended, every registered segment unregistered and the files unmapped.
        Unregistration waits for the device (every queued copy and sum): done once here, after
        the reads, not segment by segment beside them (that held every thread's copies: an
        8 GiB load 0.39 -> 0.68 s on one H200)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        t = time.perf_counter()
        for addr in self._registered:
            self._pages.unregister(addr)
        self._registered = []
        self._add_time(t)
        for m in self._maps.values():
            m.close()
        self._maps = {}
