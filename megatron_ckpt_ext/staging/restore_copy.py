"""A restore from memory's copies (load/memory.py): the adopted snapshot's buffers into the
load's targets, each summed against its seal on the way unless it was summed ahead; the pinned
bounce pool that pageable buffers go through, built ahead where it can be (:func:`warm_bounce`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from .._crc import crc32 as _crc32
from .._runtime import populate
from .._threads import cores_per_local_rank, thread_counts
from .copies import _copy_all
from .restore_sums import DeviceChecks, usable

__all__ = ["CopyInFlight", "copy_verified", "cuda_device", "drop_warm_bounce",
           "start_copy_verified", "take_warm_bounce", "use_device", "warm_bounce"]


def _pieces(sizes: Sequence[int], chunk: int,
            skip: set[int] = frozenset()) -> list[tuple[int, int, int]]:
    """(buffer index, start, end) of each ``chunk``-sized piece of the buffers not in ``skip``."""
    return [(i, a, min(a + chunk, n)) for i, n in enumerate(sizes) if i not in skip
            for a in range(0, n, chunk)]


def copy_verified(jobs: Sequence[tuple[torch.Tensor, int, torch.Tensor]], *,
                  threads: int | None = None, chunk: int = 16 << 20,
                  detail: dict | None = None, summed: frozenset[int] = frozenset()) -> list[int]:
    """For each (host buffer, expected CRC-32, target): copy the buffer into the target, summing
    it on the way (:func:`start_copy_verified`), and wait until every copy has landed; the
    indices of the buffers whose CRC-32 differs."""
    copying = start_copy_verified(jobs, threads=threads, chunk=chunk, detail=detail,
                                  summed=summed)
    copying.finish()
    return copying.bad


class CopyInFlight:
    """What :func:`start_copy_verified` started: ``bad`` (the buffers whose CRC-32 differs) is
    known; device copies may still run until :meth:`finish` (idempotent) waits for them."""

    def __init__(self, bad: list[int], bounce: _Bounce | None, on_device: bool,
                 detail: dict | None, ahead: Any = None) -> None:
        self.bad, self._bounce, self._on_device, self._detail = bad, bounce, on_device, detail
        self._ahead = ahead  # the device block copied ahead (load/device_ahead.py), if any
        self._done = False
        self.checks: DeviceChecks | None = None  # buffers summed on the device, after the copy
        self.skipped: list[int] = []  # buffers some of whose pieces were left (``stop``)

    @property
    def pending(self) -> bool:
        """Whether some buffers' sums are still to be read (:meth:`late_bad`)."""
        return self.checks is not None

    def late_bad(self) -> list[int]:
        """The buffers summed on the device whose CRC-32 differs (after :meth:`finish`, which
        it calls: the copies and the sums landed)."""
        self.finish()
        checks, self.checks = self.checks, None
        if checks is None:
            return []
        t0 = time.perf_counter()
        bad = checks.bad()
        if self._detail is not None:
            self._detail["device_sums_read_s"] = round(time.perf_counter() - t0, 6)
        return bad

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        t0 = time.perf_counter()
        synced = False
        try:
            if self._on_device:
                torch.cuda.synchronize()
                synced = True
        finally:
            t1 = time.perf_counter()
            if self._bounce is not None:
                self._bounce.close(synced=synced)
            if self._ahead is not None:
                self._ahead.release()
        if self._detail is not None:
            self._detail.update(sync_s=round(t1 - t0, 6),
                                release_s=round(time.perf_counter() - t1, 6))


def start_copy_verified(jobs: Sequence[tuple[torch.Tensor, int, torch.Tensor]], *,
                        threads: int | None = None, chunk: int = 16 << 20,
                        detail: dict | None = None, summed: frozenset[int] = frozenset(),
                        on_device: Any = None, device_sums: bool = False,
                        stop: threading.Event | None = None) -> CopyInFlight:
    """For each (host buffer, expected CRC-32, target): copy the buffer into the target chunk by
    chunk on ``threads`` threads, summing each chunk on the way; returns once every buffer is
    summed (the chunks' sums folded in order per buffer), device copies possibly still landing.

    A pageable buffer bound for a device (an adopted snapshot, mapped afresh) goes through
    pinned bounce chunks (:class:`_Bounce`): each thread faults a chunk's pages in with one
    ``madvise``, copies it into one of its two pinned chunks, sums it there (cache-hot) and
    copies it to the device on its own stream. Of the ways measured to bring a fresh mapping to
    the device that was the fastest: 2.5-3.5x pinning the mapping first (docs/memory/).
    The buffers in ``summed`` were summed and faulted in ahead (load/prepared.py): only copied;
    those pinned are copied whole, one call per device on a copy stream, before the pool starts.
    Those of them ``on_device`` copied to the device ahead (load/device_ahead.py) are copied
    from there, device to device, on the current stream once those copies landed.
    With ``device_sums`` (a restore prepared by pinning without summing, load/prepared.py), the
    pinned buffers not summed ahead are copied whole too and summed on the device once landed
    (:mod:`.restore_sums`, where its kernel is ready): their verdict is
    :meth:`CopyInFlight.late_bad`, not ``bad``.
    Once ``stop`` is set, the pieces not started yet are left: their buffers are
    :attr:`CopyInFlight.skipped` (neither copied whole nor judged), the others as without it.
    ``detail`` receives the threads, pieces, step times."""
    from ..manifest import crc32_combine

    start = time.perf_counter()
    threads = threads or thread_counts().copy  # the rank's share of the host's cores
    pinned = {i for i, (src, _, dst) in enumerate(jobs) if _direct_ok(src, dst)}
    t0 = time.perf_counter()
    ahead = _issue_from_device(jobs, on_device, summed)  # device to device: done
    late = ({i for i in pinned - summed - ahead if usable(jobs[i][2].device)}
            if device_sums else set())  # summed on the device after the copy
    if len({jobs[i][2].device for i in late}) > 1:  # one device per load sums there
        late = set()
    direct = ((pinned & summed) | late) - ahead  # whole-buffer copies, at once
    pieces = _pieces([_nbytes(b) for b, _, _ in jobs], chunk, direct | ahead)
    bounced = {i for i, (src, _, dst) in enumerate(jobs)
               if dst.is_cuda and _nbytes(src) and i not in pinned and i not in ahead}
    _issue_direct([jobs[i] for i in sorted(direct, key=lambda i: -_nbytes(jobs[i][0]))])
    checks = DeviceChecks(jobs, sorted(late)) if late else None
    t_direct = time.perf_counter()
    bounce = None
    if bounced:  # the pool warm_bounce() built, or one built now
        bounce = take_warm_bounce(threads, chunk) or _Bounce(threads, chunk)
    t1 = time.perf_counter()

    def run(piece: tuple[int, int, int]) -> tuple[int, int | None, int]:
        i, a, z = piece
        if stop is not None and stop.is_set():
            return i, None, z - a  # left: its buffer is not copied whole
        src, _, dst = jobs[i]
        raw = _bytes(src)[a:z]
        if bounce is not None and i in bounced:
            return i, bounce.copy(raw, _bytes(dst)[a:z], summed=i in summed), z - a
        crc = 0 if i in summed else _crc32(memoryview(raw.numpy()))
        _bytes(dst)[a:z].copy_(raw, non_blocking=dst.is_cuda)
        return i, crc, z - a

    sums: dict[int, int] = {}
    skipped: set[int] = set()
    copying = CopyInFlight([], bounce, any(dst.is_cuda for _, _, dst in jobs), detail,
                           ahead=on_device)
    copying.checks = checks
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for i, crc, n in pool.map(run, pieces):  # in submission order: chunks in order
                if crc is None or i in skipped:
                    skipped.add(i)
                else:
                    sums[i] = crc if i not in sums else crc32_combine(sums[i], crc, n)
    except BaseException:
        copying.finish()  # no buffer is released while a device copy still reads it
        raise
    t2 = time.perf_counter()
    if detail is not None:
        detail.update(threads=threads, cores=cores_per_local_rank(), pieces=len(pieces),
                      bounced=len(bounced), direct=len(direct),
                      setup_s=round(t0 - start, 6), direct_issue_s=round(t_direct - t0, 6),
                      bounce_pinned=bool(bounce and bounce.was_pinned),
                      bounce_warm=bool(bounce is not None and bounce.warm),
                      summed_ahead=len(summed), device_ahead=len(ahead),
                      device_ahead_bytes=sum(_nbytes(jobs[i][0]) for i in ahead),
                      device_summed=len(late),
                      device_summed_bytes=checks.device_bytes if checks else 0,
                      device_sums_issue_s=checks.issue_s if checks else 0.0,
                      bounce_setup_s=round(t1 - t_direct, 6), copy_s=round(t2 - t1, 6))
    copying.skipped = sorted(skipped)
    copying.bad = [i for i, (_, want, _) in enumerate(jobs) if i not in summed
                   and i not in late and i not in skipped and sums.get(i, 0) != want]
    return copying


def _issue_from_device(jobs: Sequence[tuple[torch.Tensor, int, torch.Tensor]], on_device: Any,
                       summed: frozenset[int]) -> set[int]:
    """The buffers copied to the device ahead (and summed ahead) into their targets, device to
    device on the current stream after those copies; the indices copied."""
    if on_device is None:
        return set()
    devices = {jobs[i][2].device for i in on_device.views if i < len(jobs)}
    stream = (torch.cuda.current_stream(next(iter(devices)))
              if len(devices) == 1 and next(iter(devices)).type == "cuda" else None)
    views = on_device.taken(stream)
    done = {i for i, view in views.items()
            if i in summed and i < len(jobs) and jobs[i][2].device == view.device
            and _nbytes(jobs[i][2]) == view.numel()}  # (uint8 views: bytes)
    for i in sorted(done):  # a device memcpy each: one _foreach_copy_ of them took 26 ms to
        _bytes(jobs[i][2]).copy_(views[i], non_blocking=True)  # issue (docs/notes/memory.md)
    return done


def _direct_ok(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src`` can be copied whole into ``dst`` by the device (pinned, bound for one)."""
    return dst.is_cuda and bool(_nbytes(src)) and src.is_pinned()


def _issue_direct(jobs: Sequence[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    """Pinned host buffers into their device targets: one copy stream per device (after the
    work queued on its current stream), each device's copies in one call (entering a stream
    context costs ~25 us, a copy call about as much)."""
    by_device: dict[torch.device, tuple[list, list]] = {}
    for src, _, dst in jobs:
        dsts, srcs = by_device.setdefault(dst.device, ([], []))
        dsts.append(_bytes(dst)), srcs.append(_bytes(src))
    for device, (dsts, srcs) in by_device.items():
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            _copy_all(dsts, srcs, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(stream)  # later work reads the targets


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
    if bounce is not None:
        bounce.warm = True
    return bounce


def drop_warm_bounce(*, background: bool = False) -> bool:
    """Release a pool :func:`warm_bounce` built that no restore took; whether there was one.
    ``background``: unpinned on a thread of its own (``mcx-warm-bounce-release``, not joined):
    ``cudaHostUnregister`` waits for the device, which a load need not."""
    if background:
        with _warm_lock:
            there = bool(_warm)
        if there:
            threading.Thread(target=drop_warm_bounce, name="mcx-warm-bounce-release",
                             daemon=True).start()
        return there
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
        populate(self.host.data_ptr(), self.host.numel(), write=True)  # not in the driver's lock
        err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), self.host.numel(), 0)
        self.pinned = self.was_pinned = int(err) == 0  # else pageable copies: correct, slower
        self.warm = False  # built ahead by warm_bounce()
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
            populate(src.data_ptr(), n)  # a fresh mapping: faulted in by one call
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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)
