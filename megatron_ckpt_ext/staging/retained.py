"""Sealed snapshots: the staging buffers of the last committed save, kept in /dev/shm as
"checkpoint iteration N of the job saving under ROOT, rank R of W", so that a job restarted on
this node restores from memory instead of reading storage.

A seal is a small JSON file ``/dev/shm/mcxseal_<hash of ROOT>_<rank>.json`` naming the segments,
what each holds (key, global offset, shape, dtype), its CRC-32, the iteration, the world size and
the manifest CRC of the committed checkpoint it equals. It is written (atomically) only once every
buffer's CRC is computed after the commit, and removed before the next save writes into the
buffers, so a crash in the middle of staging leaves no sealed torn set. The orphan sweep leaves
the segments of a seal alone until the seal is older than :data:`MAX_AGE_S`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from .._crc import crc32 as _crc32
from .._threads import cores_per_local_rank, thread_counts

__all__ = ["MAX_AGE_S", "SEAL_PREFIX", "Seal", "SealEntry", "buffer_crc32", "clean",
           "cuda_device", "discard", "drop_warm_bounce", "list_seals", "presum_pieces",
           "read_seal", "remove_seal", "seal_path", "sealed_segments", "use_device",
           "warm_bounce", "write_seal"]

logger = logging.getLogger(__name__)

SEAL_PREFIX = "mcxseal_"
MAX_AGE_S = 24 * 3600.0  # a seal older than this no longer protects its segments from the sweep
_FORMAT = "megatron-ckpt-ext/seal/1"
_CRC_CHUNK = 64 << 20
_SEAL_SUM_THREADS = 4  # a seal's summing threads, at most the rank's share of the host's cores



@dataclass
class SealEntry:
    """One staged tensor: what it is (for matching a restart's state) and where it lives."""

    key: str
    offset: list[int]  # the ShardedTensor's global offset
    shape: list[int]
    dtype: str
    spec: str  # the stager's buffer name (key, or key#n for a repeated key)
    path: str | None  # None for a zero-size tensor
    nbytes: int
    crc32: int = 0


@dataclass
class Seal:
    root: str  # realpath of the --save root
    rank: int
    world: int
    iteration: int
    manifest_crc32: str | None  # the committed checkpoint's manifest CRC (None: no manifest)
    entries: list[SealEntry]
    generation: str = ""
    created: float = 0.0  # time.time()
    host: str = ""
    pid: int = 0
    format: str = _FORMAT
    file: str = field(default="", compare=False)  # where it was read from (not stored)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def seal_path(shm_dir: str, root: str | os.PathLike[str], rank: int) -> str:
    digest = hashlib.sha1(os.path.realpath(root).encode()).hexdigest()[:16]
    return os.path.join(shm_dir, f"{SEAL_PREFIX}{digest}_{rank}.json")


def write_seal(seal: Seal, shm_dir: str) -> str:
    """Write ``seal`` atomically (temporary file, rename): a reader sees all of it or none."""
    path = seal_path(shm_dir, seal.root, seal.rank)
    seal.created, seal.host, seal.pid = time.time(), socket.gethostname(), os.getpid()
    seal.generation = seal.generation or os.urandom(8).hex()
    data = {k: v for k, v in asdict(seal).items() if k != "file"}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)
    return path


def read_seal(path: str) -> Seal | None:
    """The seal at ``path``, or None when there is none or it cannot be read as one."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("format") != _FORMAT:
            return None
        entries = [SealEntry(**e) for e in data.pop("entries")]
        return Seal(entries=entries, file=path, **data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def remove_seal(shm_dir: str, root: str | os.PathLike[str], rank: int) -> None:
    try:
        os.unlink(seal_path(shm_dir, root, rank))
    except FileNotFoundError:
        pass


def list_seals(shm_dir: str) -> list[Seal]:
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    found = (read_seal(os.path.join(shm_dir, n)) for n in names
             if n.startswith(SEAL_PREFIX) and n.endswith(".json"))
    return [s for s in found if s is not None]


def sealed_segments(shm_dir: str, *, now: float | None = None,
                    expire: bool = True) -> set[str]:
    """The segment paths of the seals younger than :data:`MAX_AGE_S`; with ``expire`` older
    seals (and unreadable ones) are removed first, so their segments become ordinary orphans."""
    now = time.time() if now is None else now
    kept: set[str] = set()
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return kept
    for name in names:
        if not name.startswith(SEAL_PREFIX) or not name.endswith(".json"):
            continue
        path = os.path.join(shm_dir, name)
        seal = read_seal(path)
        if seal is None or now - seal.created > MAX_AGE_S:
            if expire:
                _unlink(path)
            continue
        kept.update(e.path for e in seal.entries if e.path)
    return kept


def clean(shm_dir: str, *, is_mapped: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """``shm clean``: remove every seal and the segments it names that no live process maps
    (``is_mapped``). Returns (seals removed, segments removed)."""
    seals, segments = [], []
    for seal in list_seals(shm_dir):
        segments += discard(seal, is_mapped=is_mapped)
        seals.append(seal.file)
    return seals, segments


def discard(seal: Seal, *, is_mapped: Callable[[str], bool]) -> list[str]:
    """Remove ``seal`` and the segments it names that no live process maps; those removed."""
    _unlink(seal.file)
    removed = []
    for entry in seal.entries:
        if entry.path and os.path.exists(entry.path) and not is_mapped(entry.path):
            _unlink(entry.path)
            removed.append(entry.path)
    return removed


def buffer_crc32(tensor: torch.Tensor, cancelled: threading.Event | None = None) -> int | None:
    """CRC-32 of a contiguous CPU tensor's bytes (zlib releases the GIL on large buffers);
    None when ``cancelled`` is set meanwhile."""
    if tensor.numel() == 0:
        return 0
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    crc = 0
    for start in range(0, raw.nbytes, _CRC_CHUNK):
        if cancelled is not None and cancelled.is_set():
            return None
        crc = _crc32(memoryview(raw[start:start + _CRC_CHUNK]), crc)
    return crc


def presum_pieces(buffers: Sequence[torch.Tensor], *, threads: int,
                  chunk: int = 16 << 20) -> list[int]:
    """Each buffer's CRC-32, its chunks faulted in (one ``madvise`` each) and summed on
    ``threads`` threads: a fresh mapping summed ahead of its restore (load/prepared.py)."""
    from ..manifest import crc32_combine

    pieces = _pieces([_nbytes(b) for b in buffers], chunk)

    def run(piece: tuple[int, int, int]) -> int:
        i, a, z = piece
        raw = _bytes(buffers[i])[a:z]
        _populate(raw.data_ptr(), z - a)
        return _crc32(memoryview(raw.numpy()))

    sums = [0] * len(buffers)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for (i, a, z), crc in zip(pieces, pool.map(run, pieces)):
            sums[i] = crc if a == 0 else crc32_combine(sums[i], crc, z - a)
    return sums


def _pieces(sizes: Sequence[int], chunk: int,
            skip: set[int] = frozenset()) -> list[tuple[int, int, int]]:
    """(buffer index, start, end) of each ``chunk``-sized piece of the buffers not in ``skip``."""
    return [(i, a, min(a + chunk, n)) for i, n in enumerate(sizes) if i not in skip
            for a in range(0, n, chunk)]


def copy_verified(jobs: Sequence[tuple[torch.Tensor, int, torch.Tensor]], *,
                  threads: int | None = None, chunk: int = 16 << 20,
                  detail: dict | None = None, summed: frozenset[int] = frozenset()) -> list[int]:
    """For each (host buffer, expected CRC-32, target): copy the buffer into the target chunk by
    chunk on ``threads`` threads, summing each chunk on the way; the indices of the buffers whose
    CRC-32 differs (the chunks' sums are folded in order per buffer).

    A pageable buffer bound for a device (an adopted snapshot, mapped afresh) goes through
    pinned bounce chunks (:class:`_Bounce`): each thread faults a chunk's pages in with one
    ``madvise``, copies it into one of its two pinned chunks, sums it there (cache-hot) and
    copies it to the device on its own stream. Of the ways measured to bring a fresh mapping to
    the device that was the fastest: 2.5-3.5x pinning the mapping first (docs/memory/).
    The buffers in ``summed`` were summed and faulted in ahead (load/prepared.py): only copied,
    whole from this thread where pinned. ``detail`` receives the threads, pieces, step times."""
    from ..manifest import crc32_combine

    start = time.perf_counter()
    threads = threads or thread_counts().copy  # the rank's share of the host's cores
    pinned = {i for i, (src, _, dst) in enumerate(jobs)
              if dst.is_cuda and _nbytes(src) and src.is_pinned()}
    direct = pinned & summed  # pinned and summed ahead: whole-buffer copies from this thread
    pieces = _pieces([_nbytes(b) for b, _, _ in jobs], chunk, direct)
    bounced = {i for i, (src, _, dst) in enumerate(jobs)
               if dst.is_cuda and _nbytes(src) and i not in pinned}
    t0 = time.perf_counter()
    streams: dict = {}
    for i in sorted(direct, key=lambda i: -_nbytes(jobs[i][0])):  # issued before the pool's
        src, _, dst = jobs[i]
        if dst.device not in streams:
            streams[dst.device] = torch.cuda.Stream(device=dst.device)
        with torch.cuda.stream(streams[dst.device]):
            _bytes(dst).copy_(_bytes(src), non_blocking=True)
    t_direct = time.perf_counter()
    warm = take_warm_bounce(threads, chunk)
    bounce = (warm or _Bounce(threads, chunk)) if bounced else None
    if warm is not None and bounce is None:
        warm.close(synced=True)
    t1 = time.perf_counter()

    def run(piece: tuple[int, int, int]) -> tuple[int, int, int]:
        i, a, z = piece
        src, _, dst = jobs[i]
        raw = _bytes(src)[a:z]
        if bounce is not None and i in bounced:
            return i, bounce.copy(raw, _bytes(dst)[a:z], summed=i in summed), z - a
        crc = 0 if i in summed else _crc32(memoryview(raw.numpy()))
        _bytes(dst)[a:z].copy_(raw, non_blocking=dst.is_cuda)
        return i, crc, z - a

    sums: dict[int, int] = {}
    synced = False
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for i, crc, n in pool.map(run, pieces):  # in submission order: chunks in order
                sums[i] = crc if i not in sums else crc32_combine(sums[i], crc, n)
        t2 = time.perf_counter()
        if any(dst.is_cuda for _, _, dst in jobs):
            torch.cuda.synchronize()
            synced = True
        t3 = time.perf_counter()
    finally:
        if bounce is not None:
            bounce.close(synced=synced)
    if detail is not None:
        detail.update(threads=threads, cores=cores_per_local_rank(), pieces=len(pieces),
                      bounced=len(bounced), direct=len(direct),
                      setup_s=round(t0 - start, 6), direct_issue_s=round(t_direct - t0, 6),
                      bounce_pinned=bool(bounce and bounce.was_pinned),
                      bounce_warm=bool(bounce is not None and bounce is warm),
                      summed_ahead=len(summed),
                      bounce_setup_s=round(t1 - t_direct, 6), copy_s=round(t2 - t1, 6),
                      sync_s=round(t3 - t2, 6), release_s=round(time.perf_counter() - t3, 6))
    return [i for i, (_, want, _) in enumerate(jobs)
            if i not in summed and sums.get(i, 0) != want]


_warm: dict[str, Any] = {}  # the pool warm_bounce() builds ahead: {"key", "thread", "bounce"}
_warm_lock = threading.Lock()


def warm_bounce(chunk: int = 16 << 20, threads: int | None = None) -> bool:
    """Build the pinned bounce pool a restore from memory copies through (:func:`copy_verified`)
    in a background thread now, while the model is built, instead of inside the restore
    (faulting in and registering 2 x threads x ``chunk`` bytes, docs/MEMORY.md). The next
    :func:`copy_verified` of the same sizes takes it; :func:`drop_warm_bounce` releases it
    unused. Whether a build started (not twice, not without CUDA)."""
    device = cuda_device()
    if device is None:
        return False
    threads = threads or thread_counts().copy
    with _warm_lock:
        if _warm:
            return False
        _warm["key"] = (threads, chunk)

        def build() -> None:
            use_device(device)  # no context on another device from this thread
            _warm["bounce"] = _Bounce(threads, chunk)

        thread = threading.Thread(target=build, name="mcx-warm-bounce", daemon=True)
        _warm["thread"] = thread
        thread.start()
    return True


def cuda_device() -> int | None:
    """This thread's CUDA device; None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def use_device(device: int) -> None:
    torch.cuda.set_device(device)


def take_warm_bounce(threads: int, chunk: int) -> _Bounce | None:
    """The pool :func:`warm_bounce` built (waiting for it), if it has these sizes; another one
    is released. None when none was started."""
    key, bounce = _pop_warm()
    if bounce is not None and key != (threads, chunk):  # another rank count, say
        bounce.close(synced=True)
        return None
    return bounce


def drop_warm_bounce() -> bool:
    """Release a pool :func:`warm_bounce` built that no restore took; whether there was one."""
    key, bounce = _pop_warm()
    if bounce is not None:
        bounce.close(synced=True)
    return key is not None


def _pop_warm() -> tuple[Any, _Bounce | None]:
    """The warm pool's (sizes, pool), once its build is done, and forgotten here; (None, None)
    without one. The pool is None where its build raised (its thread printed why)."""
    with _warm_lock:
        entry = dict(_warm)
        _warm.clear()
    if not entry:
        return None, None
    entry["thread"].join()
    return entry["key"], entry.get("bounce")


class _Bounce:
    """Two pinned chunks per copy thread (one registered allocation, unregistered by close()),
    a stream per thread and device, and an event per chunk: a chunk is refilled only once its
    last device copy is done."""

    def __init__(self, threads: int, chunk: int) -> None:
        self.chunk = chunk
        self.host = torch.empty(2 * threads * chunk, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), self.host.numel(), 0)
        self.pinned = self.was_pinned = int(err) == 0  # else pageable copies: correct, slower
        self._slots = iter(range(threads))
        self._lock = threading.Lock()
        self._local = threading.local()

    def copy(self, src: torch.Tensor, dst: torch.Tensor, *, summed: bool = False) -> int:
        """``src`` (bytes of a host buffer) into ``dst`` (bytes on a device); its CRC-32 (0 where
        ``summed``: faulted in and summed ahead)."""
        local = self._local
        if not hasattr(local, "chunks"):
            with self._lock:
                slot = next(self._slots)
            base = 2 * slot * self.chunk
            local.chunks = [self.host[base:base + self.chunk],
                            self.host[base + self.chunk:base + 2 * self.chunk]]
            local.events, local.turn, local.streams = [None, None], 0, {}
        turn = local.turn = 1 - local.turn
        if local.events[turn] is not None:
            local.events[turn].synchronize()
        n = src.numel()
        chunk = local.chunks[turn][:n]
        if not summed:
            _populate(src.data_ptr(), n)
        chunk.numpy()[:] = src.numpy()  # numpy's copy releases the GIL
        crc = 0 if summed else _crc32(memoryview(chunk.numpy()))
        stream = local.streams.get(dst.device)
        if stream is None:
            stream = local.streams[dst.device] = torch.cuda.Stream(device=dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(chunk, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        local.events[turn] = event
        return crc

    def close(self, *, synced: bool) -> None:
        """Unpin the chunks, once no device copy reads them (``synced``: the caller waited for
        every copy already; else, after an error, wait here)."""
        if self.pinned:
            if not synced:
                torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self.pinned = False


_MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels refuse it and the copy faults pages in
_libc: list = []


def _populate(address: int, nbytes: int) -> None:
    """Fault ``nbytes`` at ``address`` in with one call (a fresh mapping of a segment would
    otherwise take a fault per few pages during the copy)."""
    if not _libc:
        import ctypes

        _libc.append(ctypes.CDLL(None, use_errno=True))
        _libc[0].madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = address & ~4095
    _libc[0].madvise(start, address + nbytes - start, _MADV_POPULATE_READ)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def crc32_all(tensors: Sequence[torch.Tensor], *, threads: int | None = None,
              cancelled: threading.Event | None = None) -> list[int] | None:
    """Every tensor's CRC-32, on ``threads`` threads (default 4, at most the rank's share of
    the host's cores: it runs beside training); None when cancelled."""
    threads = threads or min(_SEAL_SUM_THREADS, cores_per_local_rank())
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        crcs = list(pool.map(lambda t: buffer_crc32(t, cancelled), tensors))
    return None if any(c is None for c in crcs) else crcs  # type: ignore[return-value]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
