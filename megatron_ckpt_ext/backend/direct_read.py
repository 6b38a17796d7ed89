"""Direct reads of torch DCP tensor items: where an item is one ``torch.save``'d tensor (a zip of
stored, uncompressed records), find where its bytes lie in the checkpoint file and read them
straight into the target tensor's memory (a CPU target), or through a pinned chunk into a device
target (then copied at the pinned rate), with no unpickled intermediate tensor and no pageable
copy. Anything this module does not recognise is reported (``None`` and why) so the caller loads
that item the stock way."""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import pickle
import queue
import struct
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

__all__ = ["Files", "chunk_spans", "stripes", "ItemLayout", "item_layout", "pread_into", "tensor_bytes", "PinnedChunks",
           "DEFAULT_CHUNK", "EDGE"]

logger = logging.getLogger(__name__)

# a storage read's piece (a pread, a copy, a device CRC launch): 64 MiB sped a verifying warm
# 8 GiB load 7-13 % over 32 MiB (docs/benchmarks/README.md, twentieth session)
DEFAULT_CHUNK = 64 << 20
EDGE = 4096  # bytes read at each end of an item for its zip headers
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50


@dataclass(frozen=True)
class ItemLayout:
    """Where one saved tensor's bytes are: ``start`` (absolute file offset of element 0) and its
    dtype, size and stride as saved."""
    dtype: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    start: int
    # the storage record (absolute file offset, bytes), and the item's bytes before and after it
    # (zip headers, data.pkl, central directory): with the record they are the whole item
    record: tuple[int, int] = (0, 0)
    edges: tuple[bytes, bytes] = (b"", b"")

    def contiguous(self) -> bool:
        expected, step = [], 1
        for n in reversed(self.size):
            expected.append(step)
            step *= n
        return all(n == 1 or s == e
                   for n, s, e in zip(self.size, self.stride, reversed(expected)))

    def span(self, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int] | None:
        """(file offset, bytes) of the block ``offsets``/``lengths`` of this tensor when those
        bytes are one contiguous range (the whole tensor, or whole rows of dim 0), else None."""
        import torch

        if len(offsets) != len(self.size) or not self.contiguous():
            return None
        if any(o != 0 or n != s for o, n, s in zip(offsets[1:], lengths[1:], self.size[1:])):
            return None
        item = torch.empty((), dtype=self.dtype).element_size()
        row = item
        for n in self.size[1:]:
            row *= n
        first, rows = (offsets[0], lengths[0]) if self.size else (0, 1)
        return self.start + first * row, rows * row


class _Window(io.RawIOBase):
    """A read-only file object over ``[offset, offset + length)`` of ``fd`` (for zipfile). The
    item's head (local headers, data.pkl) and tail (central directory) are read once, ``EDGE``
    bytes each, and serve every small read inside them: two preads per item, not one per field."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self._fd, self._base, self._len, self._pos = fd, offset, length, 0
        edge = min(length, EDGE)
        self._head = os.pread(fd, edge, offset)
        tail_at = max(length - EDGE, len(self._head))
        self._tail_at = tail_at
        self._tail = os.pread(fd, length - tail_at, offset + tail_at) if tail_at < length else b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._len - self._pos if n is None or n < 0 else min(n, self._len - self._pos)
        data = self.pread(n, self._pos)
        self._pos += len(data)
        return data

    def pread(self, n: int, at: int) -> bytes:
        """``n`` bytes at item offset ``at`` (from the edges read already when inside them)."""
        if at + n <= len(self._head):
            return self._head[at:at + n]
        if at >= self._tail_at and at + n <= self._tail_at + len(self._tail):
            return self._tail[at - self._tail_at:at - self._tail_at + n]
        return os.pread(self._fd, n, self._base + at)


class _Tensor(tuple):
    """What the restricted unpickler rebuilds: (storage key, dtype, offset, size, stride)."""


class _Unpickler(pickle.Unpickler):
    """Only the classes torch.save writes for one dense tensor; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            import collections
            return collections.OrderedDict
        if module == "torch" and name in _storage_dtypes():
            return _StorageType(_storage_dtypes()[name])
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor's")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected storage record {pid!r}")
        return (str(pid[2]), pid[1].dtype)


class _StorageType:
    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype


_DTYPES: dict = {}


def _storage_dtypes() -> dict:
    """torch.save's legacy storage class names ('FloatStorage', ...) -> dtype."""
    if not _DTYPES:
        import torch
        import warnings

        with warnings.catch_warnings():  # TypedStorage's deprecation, on reading .dtype
            warnings.simplefilter("ignore")
            for name in dir(torch):
                if name.endswith("Storage") and name != "UntypedStorage":
                    dtype = getattr(getattr(torch, name), "dtype", None)
                    if isinstance(dtype, torch.dtype):
                        _DTYPES[name] = dtype
    return _DTYPES


def _rebuild(storage: tuple, storage_offset: int, size: tuple, stride: tuple,
             *_rest: Any) -> _Tensor:
    key, dtype = storage
    return _Tensor((key, dtype, int(storage_offset), tuple(size), tuple(stride)))


def prefetch_edges(fd: int, offset: int, length: int) -> None:
    """Ask the kernel for the pages :func:`item_layout` reads of the item at ``[offset, offset +
    length)`` (its two ``EDGE`` ends), without waiting: a cold disk reads many items' at once."""
    for start in {offset, max(offset, offset + length - EDGE)}:
        os.posix_fadvise(fd, start, EDGE, os.POSIX_FADV_WILLNEED)


def item_layout(fd: int, offset: int, length: int) -> tuple[ItemLayout | None, str]:
    """The layout of the tensor saved at ``[offset, offset + length)`` of ``fd``, or (None, why
    the item is not one this module reads directly)."""
    import torch

    try:
        window = _Window(fd, offset, length)
        records = _central_directory(window, length)
        with contextlib.nullcontext() if records is not None else zipfile.ZipFile(window) as zf:
            if records is None:  # anything the short parser does not take: zipfile's own
                records = zf.infolist()
            infos = {i.filename.split("/", 1)[-1]: i for i in records}
            if "data.pkl" not in infos:
                return None, "no data.pkl record"
            infos = {k: v for k, v in infos.items() if v.compress_type == zipfile.ZIP_STORED}
            if "data.pkl" not in infos:
                return None, "data.pkl is compressed"
            # the records are read by their local headers: zipfile would check CRC-32s, which a
            # writer with torch's CRC off leaves as 0 (the manifest's checksums cover the bytes)
            byteorder = (_record(window, infos["byteorder"]).decode()
                         if "byteorder" in infos else "little")
            rebuilt = _Unpickler(io.BytesIO(_record(window, infos["data.pkl"]))).load()
            if not isinstance(rebuilt, _Tensor):
                return None, "the item is not one tensor"
            key, dtype, storage_offset, size, stride = rebuilt
            record = infos.get(f"data/{key}")
            if record is None:
                return None, "the storage record is missing or compressed"
            if byteorder != sys.byteorder:
                return None, f"saved {byteorder}-endian"
            data = _data_start(window, record)
            item = torch.empty((), dtype=dtype).element_size()
            numel = 1
            for n in size:
                numel *= n
            if data + (storage_offset + numel) * item > length or \
                    data + record.file_size > length:
                return None, "the tensor's bytes run past the item"
            end = data + record.file_size
            layout = ItemLayout(dtype, size, stride, offset + data + storage_offset * item,
                                record=(offset + data, record.file_size),
                                edges=(window.pread(data, 0), window.pread(length - end, end)))
            return layout, ""
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, KeyError,
            struct.error, AttributeError, TypeError) as e:
        return None, f"unreadable as a plain tensor ({type(e).__name__}: {e})"


class _Entry(NamedTuple):
    """What a load needs of one central-directory entry (the fields of ``zipfile.ZipInfo``)."""
    filename: str
    compress_type: int
    header_offset: int
    file_size: int


_EOCD = struct.Struct("<IHHHHIIH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_TRAILER = 56 + 20  # zip64 end record + its locator, between the directory and the end


def _central_directory(window: _Window, length: int) -> list[_Entry] | None:
    """The entries of an item's zip as torch.save writes it (no comment, one disk, sizes and
    offsets below 4 GiB, the directory right before the end records), parsed from the bytes the
    window already holds; None for anything else (zipfile then reads it): this skips most of
    zipfile's per-archive work, the largest part of a load's metadata step."""
    if length < _EOCD.size:
        return None
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = _EOCD.unpack(
        window.pread(_EOCD.size, length - _EOCD.size))
    if sig != 0x06054B50 or comment or disk or cd_disk or 0xFFFF in (count,) or \
            0xFFFFFFFF in (cd_size, cd_offset):
        return None
    end = length - _EOCD.size
    if cd_offset + cd_size not in (end, end - _ZIP64_TRAILER):
        return None
    directory, at, out = window.pread(cd_size, cd_offset), 0, []
    for _ in range(count):
        fields = _CENTRAL.unpack_from(directory, at)
        if fields[0] != 0x02014B50 or 0xFFFFFFFF in (fields[8], fields[9], fields[16]):
            return None
        name_at = at + _CENTRAL.size
        name = directory[name_at:name_at + fields[10]].decode("utf-8" if fields[3] & 0x800
                                                              else "cp437")
        out.append(_Entry(name, fields[4], fields[16], fields[9]))
        at = name_at + fields[10] + fields[11] + fields[12]
    return out if at == cd_size else None


def _data_start(window: _Window, info: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes begin, relative to the item (after its local header)."""
    fields = _LOCAL_HEADER.unpack(window.pread(_LOCAL_HEADER.size, info.header_offset))
    if fields[0] != _LOCAL_MAGIC:
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def _record(window: _Window, info: zipfile.ZipInfo) -> bytes:
    data = window.pread(info.file_size, _data_start(window, info))
    if len(data) != info.file_size:
        raise zipfile.BadZipFile(f"{info.filename} is cut short")
    return data


def tensor_bytes(tensor: Any) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def pread_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (the GIL is released while reading)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{what}: the file ends {len(view) - done} bytes before the tensor "
                          f"does (truncated?)")
        done += n


def _host_cache_emptier() -> Callable[[], None] | None:
    """torch's call that frees its cached pinned host blocks, failures logged (None: none)."""
    import torch

    empty = (getattr(torch._C, "_host_emptyCache", None)
             or getattr(torch._C, "_accelerator_emptyHostCache", None))

    def call() -> None:
        try:
            empty()
        except Exception as e:  # noqa: BLE001 - torch keeps its cached blocks
            logger.debug("torch's cached pinned blocks not handed back: %s", e)
    return call if empty is not None else None


class PinnedChunks:
    """A bounded set of host chunks (pinned when a device is there) lent to reading threads; kept
    for the process so later loads do not pay the pinning again. A chunk is made when a thread
    asks and none is free, up to ``count``: pinning all of them up front held every reading
    thread for it (768 MiB, 0.15-0.2 s on the H100 host) before the first byte was read, where a
    cold read needs about one chunk per thread."""

    _cache: dict[tuple[int, int, bool], "PinnedChunks"] = {}
    _lock = threading.Lock()

    def __init__(self, count: int, chunk: int, pin: bool) -> None:
        self.chunk, self.count, self._pin = chunk, count, pin
        self.made = 0
        self._free: queue.Queue = queue.Queue()
        self._making = threading.Lock()

    @classmethod
    def shared(cls, count: int, chunk: int | None = None, *, pin: bool) -> "PinnedChunks":
        chunk = chunk or DEFAULT_CHUNK  # read now: a benchmark's --chunk-mib sets it
        with cls._lock:
            key = (count, chunk, pin)
            if key not in cls._cache:
                cls._cache.clear()  # one set at a time
                cls._cache[key] = cls(count, chunk, pin)
            return cls._cache[key]

    @classmethod
    def kept(cls) -> bool:
        return bool(cls._cache)

    @classmethod
    def release_shared(cls, pace_s: float = 0.0) -> bool:
        """Drop the kept set (a load's reads are over) and hand torch's cached pinned blocks
        back; whether there was one. A later load pins its chunks again. ``pace_s`` > 0: one
        chunk at a time, that many seconds apart: freeing pinned memory holds every CUDA call
        of the process (a copy beside the release of 24 x 64 MiB at once waited for all of it:
        0.20-0.29 s against 0.035 s, one H200, benchmarks/probe_release_overlap.py)."""
        with cls._lock:
            if not cls._cache:
                return False
            pools = list(cls._cache.values())
            cls._cache.clear()
        empty = _host_cache_emptier() if any(p._pin for p in pools) else None
        for pool in pools:
            while not pool._free.empty():
                pool._free.get_nowait()  # this chunk's last reference
                if empty is not None and pace_s > 0:
                    empty()
                    time.sleep(pace_s)
        if empty is not None:
            empty()
        return True

    def take(self) -> Any:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._making:
            make = self.made < self.count
            self.made += make
        if not make:
            return self._free.get()
        import torch

        try:  # on this thread, beside the others' reads
            return torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self._pin)
        except BaseException:
            with self._making:
                self.made -= 1
            raise

    def give(self, buf: Any) -> None:
        self._free.put(buf)

    def make_ahead(self, limit: int | None = None) -> None:
        """Make the chunks not made yet, up to ``limit`` made (default: the count), and lend
        them free (a thread before the load: pinning took 0.35-0.47 s a rank on an H200 host,
        half of a process's first load); the load makes the others as it asks."""
        import torch

        while True:
            with self._making:
                if self.made >= min(self.count, limit or self.count):
                    return
                self.made += 1
            try:
                buf = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self._pin)
            except Exception as e:  # noqa: BLE001 - the load makes it as before
                with self._making:
                    self.made -= 1
                logger.debug("host chunks not made ahead of the load: %s", e)
                return
            self._free.put(buf)


# -- how a load's reading threads share the files (backend/load_reader.py) ---------------------
class Files:
    """One read-only descriptor per checkpoint file, shared by the reading threads (pread)."""

    def __init__(self, reader: Any) -> None:
        self._reader, self._fds, self._lock = reader, {}, threading.Lock()

    def __enter__(self) -> "Files":
        return self

    def __exit__(self, *exc: Any) -> None:
        for fd in self._fds.values():
            os.close(fd)

    def fd(self, relative_path: str) -> int:
        with self._lock:
            if relative_path not in self._fds:
                path = os.path.join(str(self._reader.path), relative_path)
                self._fds[relative_path] = os.open(path, os.O_RDONLY)
            return self._fds[relative_path]


def chunk_spans(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(nbytes, a + chunk)) for a in range(0, max(nbytes, 1), chunk)] if nbytes \
        else []


def stripes(chunks: list, n: int) -> list[list]:
    """``chunks`` cut into at most ``n`` runs of consecutive chunks of about equal bytes."""
    total = sum(b - a for _, a, b in chunks)
    out: list[list] = [[]]
    done = 0
    for chunk in chunks:
        if out[-1] and done >= total * len(out) / n:
            out.append([])
        out[-1].append(chunk)
        done += chunk[2] - chunk[1]
    return [s for s in out if s]
