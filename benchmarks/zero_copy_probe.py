"""Can a warm load skip the host copy? Page-cache pages of a checkpoint file, mapped read-only and
``cudaHostRegister``-ed in place (``cudaHostRegisterReadOnly``), copied by the device straight
from the page cache: no ``pread`` into a pinned bounce chunk, and the CRC-32 read of the same
pages beside it. This probe measures, on one file set held in the page cache, in one run:

* the floors the load benchmark uses: a parallel page-cache read (64 MiB ``preadv``s into one
  buffer per thread that it reuses) and a pinned host-to-device copy;
* ``register``: mapping and registering the files in place, per chunk size and thread count
  (GB/s of bytes registered), and unregistering them;
* ``zero_copy``: the whole path as a load would run it, register a chunk then copy it to the
  device, chunks spread over threads, with and without CRC-32 sums of the same bytes on as many
  summing threads (sums read the mapped pages; registration populated their page tables);
* ``bounce``: today's path for comparison (``pread`` into pinned 32 MiB chunks, copy each to the
  device, sum it), same threads.

    python3 benchmarks/zero_copy_probe.py --dir /tmp/zc --gib 8 --files 4 --threads 4 8 16 \\
        --chunk-mib 64 256 --json $OUT/zero_copy.json

With ``--hybrid Z,B ...`` only the floors and the hybrid runs: Z zero-copy threads and B bouncing
threads at once over one list of 64 MiB chunks (each path from its own end), each pair beside a
plain bounce run with Z+B threads (``bounce``: 32 MiB chunks) (docs/benchmarks/README.md,
twenty-first session).

A figure that cannot be taken (no CUDA, a registration the driver refuses) is reported with its
error, never replaced by another.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH
from megatron_ckpt_ext._crc import IMPLEMENTATION, crc32  # noqa: E402
from megatron_ckpt_ext._crc_device import DeviceCrc, crc32_tensor  # noqa: E402

REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
PROT_READ, MAP_SHARED = 0x1, 0x01
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def make_files(root: Path, gib: float, files: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    each = int(gib * (1 << 30)) // files // (1 << 20) * (1 << 20)
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    paths = []
    for i in range(files):
        p = root / f"f{i}.bin"
        if not p.exists() or p.stat().st_size != each:
            with open(p, "wb") as f:
                left = each
                while left:
                    n = min(left, len(block))
                    f.write(block[:n])
                    left -= n
        paths.append(p)
    return paths


def warm(paths: list[Path]) -> None:
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def spans(paths: list[Path], chunk: int) -> list[tuple[int, int, int]]:
    """(file index, offset, bytes) of every chunk, in file order."""
    out = []
    for i, p in enumerate(paths):
        size = p.stat().st_size
        out += [(i, a, min(chunk, size - a)) for a in range(0, size, chunk)]
    return out


def read_floor(paths: list[Path], threads: int) -> float:
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    work = spans(paths, 64 << 20)
    total = sum(n for _, _, n in work)
    lock, it = threading.Lock(), iter(work)

    started = threading.Barrier(threads + 1)

    def run() -> None:
        buf = bytearray(64 << 20)
        memoryview(buf)[::4096] = b"\1" * len(buf[::4096])  # no faults while timed
        started.wait(timeout=300)
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            i, a, n = job
            os.preadv(fds[i], [memoryview(buf)[:n]], a)

    with ThreadPoolExecutor(threads) as pool:
        jobs = [pool.submit(run) for _ in range(threads)]
        started.wait(timeout=300)
        t = time.perf_counter()
        for j in jobs:
            j.result()
    gbs = total / (time.perf_counter() - t) / 1e9
    for fd in fds:
        os.close(fd)
    return gbs


def h2d_floor(dev: torch.device) -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    out = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    out.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(4):
        out.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * (1 << 30) / (time.perf_counter() - t) / 1e9


class Mapped:
    """The files mapped read-only, shared with the page cache; ``view(i, a, n)`` a CPU uint8
    tensor over bytes [a, a+n) of file i (no copy; never written)."""

    def __init__(self, paths: list[Path]) -> None:
        self.maps = []
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            size = os.fstat(fd).st_size
            addr = _libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
            os.close(fd)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            self.maps.append((addr, size))

    def addr(self, i: int, a: int) -> int:
        return self.maps[i][0] + a

    def view(self, i: int, a: int, n: int) -> torch.Tensor:
        import numpy as np

        arr = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(self.addr(i, a)))
        return torch.from_numpy(arr)

    def close(self) -> None:
        for addr, size in self.maps:
            _libc.munmap(addr, size)
        self.maps = []


def register(m: Mapped, work: list, threads: int, flags: int) -> tuple[float, float, list]:
    """Registers every chunk of ``work`` on ``threads`` threads, then unregisters them; (GB/s
    registering, seconds unregistering, errors)."""
    rt = torch.cuda.cudart()
    errors: list = []
    total = sum(n for _, _, n in work)

    def reg(job):
        i, a, n = job
        err = rt.cudaHostRegister(m.addr(i, a), n, flags)
        if int(err) != 0:
            errors.append((i, a, str(err)))
            return None
        return job

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = [j for j in pool.map(reg, work) if j is not None]
    gbs = total / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    for i, a, _ in done:
        rt.cudaHostUnregister(m.addr(i, a))
    return gbs, time.perf_counter() - t, errors[:3]


def zero_copy(m: Mapped, work: list, threads: int, sums: str | None, dev: torch.device,
              flags: int) -> dict:
    """Register each chunk, copy it to the device on this thread's stream, and (``sums``) hand
    it to a summing thread; every copy and sum waited for. Then unregister (timed apart)."""
    rt = torch.cuda.cudart()
    total = sum(n for _, _, n in work)
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    jobs, lock = _Jobs(work), threading.Lock()
    summer = ThreadPoolExecutor(threads) if sums == "host" else None
    dcrc, raws = DeviceCrc.on(dev), []
    futures, errors, registered = [], [], []
    busy = {"register": 0.0, "issue": 0.0}

    def run() -> None:
        stream = torch.cuda.Stream(device=dev)
        while (job := jobs.next()) is not None:
            (i, a, n), o = job
            t = time.perf_counter()
            err = rt.cudaHostRegister(m.addr(i, a), n, flags)
            t2 = time.perf_counter()
            if int(err) != 0:
                errors.append(str(err))
                continue
            with lock:
                registered.append(m.addr(i, a))
                busy["register"] += t2 - t
            host = m.view(i, a, n)
            with torch.cuda.stream(stream):
                out[o:o + n].copy_(host, non_blocking=True)
                if sums == "device":
                    raws.append(dcrc.linear(out[o:o + n]))
            if summer is not None:
                fut = summer.submit(crc32, memoryview(host.numpy()))
                with lock:
                    futures.append(fut)
            with lock:
                busy["issue"] += time.perf_counter() - t2
        stream.synchronize()

    wall = _run_timed(run, threads, futures, summer)
    t = time.perf_counter()
    for addr in registered:
        rt.cudaHostUnregister(addr)
    unreg = time.perf_counter() - t
    return {"threads": threads, "sums": sums, "seconds": wall, "gbs": total / wall / 1e9,
            "unregister_s": unreg, "register_thread_s": busy["register"],
            "issue_thread_s": busy["issue"], "errors": errors[:3]}


class _Jobs:
    """Chunks (file, offset, bytes) handed out to threads, each with its offset in the output."""

    def __init__(self, work: list) -> None:
        offsets, at = [], 0
        for _, _, n in work:
            offsets.append(at)
            at += n
        self._lock, self._it = threading.Lock(), iter(list(zip(work, offsets)))

    def next(self):  # noqa: ANN201
        with self._lock:
            return next(self._it, None)


def _run_timed(run, threads: int, futures: list, summer) -> float:  # noqa: ANN001
    """Seconds for ``threads`` threads running ``run`` and every sum they handed over."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: run(), range(threads)))
    for f in futures:
        f.result()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    if summer is not None:
        summer.shutdown()
    return wall


def bounce(paths: list[Path], threads: int, sums: str | None, dev: torch.device) -> dict:
    """Today's path: pread 32 MiB into a pinned chunk (two per thread), copy it to the device,
    sum it on a summing thread; the chunk goes back once copied and summed."""
    import queue

    chunk = 32 << 20
    work = spans(paths, chunk)
    total = sum(n for _, _, n in work)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    free: queue.Queue = queue.Queue()
    dcrc, raws = DeviceCrc.on(dev), []
    for _ in range(2 * threads + (threads if sums == "host" else 0)):
        free.put(torch.empty(chunk, dtype=torch.uint8, pin_memory=True))
    jobs, lock = _Jobs(work), threading.Lock()
    summer = ThreadPoolExecutor(threads) if sums == "host" else None
    futures = []

    def give_back(ev, buf, view):
        if view is not None:
            crc32(view)
        ev.synchronize()
        free.put(buf)

    def run() -> None:
        stream = torch.cuda.Stream(device=dev)
        while (job := jobs.next()) is not None:
            (i, a, n), o = job
            buf = free.get()
            view = memoryview(buf.numpy())[:n]
            os.preadv(fds[i], [view], a)
            with torch.cuda.stream(stream):
                out[o:o + n].copy_(buf[:n], non_blocking=True)
                if sums == "device":
                    raws.append(dcrc.linear(out[o:o + n]))
                ev = torch.cuda.Event()
                ev.record(stream)
            if summer is not None:
                fut = summer.submit(give_back, ev, buf, view)
                with lock:
                    futures.append(fut)
            else:
                give_back(ev, buf, None)
        stream.synchronize()

    wall = _run_timed(run, threads, futures, summer)
    for fd in fds:
        os.close(fd)
    return {"threads": threads, "sums": sums, "seconds": wall, "gbs": total / wall / 1e9}


def hybrid(m: Mapped, paths: list[Path], zt: int, bt: int, dev: torch.device,
           flags: int = REGISTER_READ_ONLY) -> dict:
    """Both paths at once over one set of 64 MiB chunks in file order: ``zt`` threads take
    chunks from the front and copy them zero-copy (register, copy; unregistered after the
    clock), ``bt`` threads take them from the back and bounce them (pread into one of two
    pinned chunks of their own, copy): each path takes chunks at its own rate until they meet.
    No sums. Seconds, GB/s, and the bytes each path moved."""
    import collections

    rt = torch.cuda.cudart()
    work = spans(paths, 64 << 20)
    offsets, at = [], 0
    for _, _, n in work:
        offsets.append(at)
        at += n
    total = at
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    left, lock = collections.deque(zip(work, offsets)), threading.Lock()
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    registered, moved, errors = [], {"zero_copy": 0, "bounce": 0}, []
    pinned = [[torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
              for _ in range(bt)]

    def take(front: bool):  # noqa: ANN202
        with lock:
            return (left.popleft() if front else left.pop()) if left else None

    def zero() -> None:
        stream = torch.cuda.Stream(device=dev)
        while (job := take(True)) is not None:
            (i, a, n), o = job
            err = rt.cudaHostRegister(m.addr(i, a), n, flags)
            if int(err) != 0:
                errors.append(str(err))
                continue
            with lock:
                registered.append(m.addr(i, a))
                moved["zero_copy"] += n
            with torch.cuda.stream(stream):
                out[o:o + n].copy_(m.view(i, a, n), non_blocking=True)
        stream.synchronize()

    def bounce_run(t: int) -> None:
        stream, landed, k = torch.cuda.Stream(device=dev), [None, None], 0
        while (job := take(False)) is not None:
            (i, a, n), o = job
            if landed[k % 2] is not None:
                landed[k % 2].synchronize()
            buf = pinned[t][k % 2]
            os.preadv(fds[i], [memoryview(buf.numpy())[:n]], a)
            with torch.cuda.stream(stream):
                out[o:o + n].copy_(buf[:n], non_blocking=True)
            landed[k % 2] = stream.record_event()
            k += 1
            with lock:
                moved["bounce"] += n
        stream.synchronize()

    torch.cuda.synchronize()
    t = time.perf_counter()
    with ThreadPoolExecutor(zt + bt) as pool:
        jobs = [pool.submit(zero) for _ in range(zt)] + \
            [pool.submit(bounce_run, b) for b in range(bt)]
        for j in jobs:
            j.result()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    t = time.perf_counter()
    for addr in registered:
        rt.cudaHostUnregister(addr)
    unreg = time.perf_counter() - t
    for fd in fds:
        os.close(fd)
    return {"zero_copy_threads": zt, "bounce_threads": bt, "seconds": wall,
            # a refused registration leaves its chunk unmoved: no rate then (the errors say why)
            "gbs": None if errors else total / wall / 1e9, "moved": moved, "unregister_s": unreg,
            "errors": errors[:3]}


def device_crc_rate(dev: torch.device, paths: list[Path]) -> dict:
    """The device CRC alone: 32 MiB pieces of one file's bytes on the device, one stream; and
    that its value is zlib's (the host CRC of the same bytes)."""
    import megatron_ckpt_ext._crc_device as cd

    data = Path(paths[0]).read_bytes()[: 1 << 30]
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    d = host.to(dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    first = crc32_tensor(d[: (100 << 20) + 13])
    out = {"kernel": cd._kernel() is not None, "first_call_s": time.perf_counter() - t,
           "matches_host": first == crc32(memoryview(data)[: (100 << 20) + 13])}
    out["matches_host_odd"] = all(
        crc32_tensor(d[a:a + n]) == crc32(memoryview(data)[a:a + n])
        for a, n in ((5, 1), (7, 1023), (1, 1025), (3, 262151), (11, (33 << 20) + 5)))
    dcrc, kept = DeviceCrc.on(dev), cd._KERNEL[0]
    for name, kernel in (("triton", kept), ("torch", None)):
        cd._KERNEL[:] = [kernel]
        for piece in (8 << 20, 32 << 20):
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            t = time.perf_counter()
            for _ in range(2):
                raws = [dcrc.linear(d[a:a + piece]) for a in range(0, d.numel(), piece)]
            torch.cuda.synchronize()
            out[f"{name}_gbs_{piece >> 20}mib"] = 2 * d.numel() / (time.perf_counter() - t) / 1e9
            out[f"{name}_peak_extra_bytes_{piece >> 20}mib"] = \
                torch.cuda.max_memory_allocated(dev) - base
            del raws
    cd._KERNEL[:] = [kept]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="where the files are made (the checkpoint disk)")
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--threads", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--chunk-mib", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--hybrid", nargs="*", default=[], metavar="Z,B",
                   help="only the hybrid runs (after the floors): Z zero-copy threads and B "
                        "bouncing threads at once, e.g. 4,12 (each pair --repeats times, beside "
                        "plain bounce runs with Z+B threads)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("zero_copy_probe needs a CUDA device")
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    paths = make_files(Path(a.dir), a.gib, a.files)
    total = sum(q.stat().st_size for q in paths)
    warm(paths)
    res: dict = {"bytes": total, "files": len(paths), "crc": IMPLEMENTATION,
                 "cores": len(os.sched_getaffinity(0)), "device": torch.cuda.get_device_name(0),
                 "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                 "floors": {}, "register": [], "zero_copy": [], "bounce": []}
    res["floors"]["warm_read_gbs"] = max(read_floor(paths, t) for t in (8, 16, 32))
    res["floors"]["h2d_pinned_gbs"] = h2d_floor(dev)
    print("floors", res["floors"], flush=True)
    if a.hybrid:
        res["hybrid"] = []
        m = Mapped(paths)
        try:
            for _ in range(a.repeats):
                for pair in a.hybrid:
                    zt, bt = (int(v) for v in pair.split(","))
                    row = hybrid(m, paths, zt, bt, dev)
                    res["hybrid"].append(row)
                    print("hybrid", row, flush=True)
                    row = bounce(paths, zt + bt, None, dev)
                    res["bounce"].append(row)
                    print("bounce", row, flush=True)
        finally:
            m.close()
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return
    res["device_crc"] = device_crc_rate(dev, paths)
    print("device_crc", res["device_crc"], flush=True)
    m = Mapped(paths)
    try:
        for chunk in a.chunk_mib:
            work = spans(paths, chunk << 20)
            for threads in a.threads:
                for flags in (REGISTER_READ_ONLY,):
                    for _ in range(a.repeats):
                        gbs, unreg, errs = register(m, work, threads, flags)
                        row = {"chunk_mib": chunk, "threads": threads, "flags": flags,
                               "gbs": gbs, "unregister_s": unreg, "errors": errs}
                        res["register"].append(row)
                        print("register", row, flush=True)
        for chunk in a.chunk_mib:
            work = spans(paths, chunk << 20)
            for threads in a.threads:
                for sums in (None, "host", "device"):
                    for _ in range(a.repeats):
                        row = zero_copy(m, work, threads, sums, dev, REGISTER_READ_ONLY)
                        row["chunk_mib"] = chunk
                        res["zero_copy"].append(row)
                        print("zero_copy", row, flush=True)
    finally:
        m.close()
    for threads in a.threads:
        for sums in (None, "host", "device"):
            row = bounce(paths, threads, sums, dev)
            res["bounce"].append(row)
            print("bounce", row, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
