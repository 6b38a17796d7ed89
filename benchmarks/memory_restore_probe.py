"""Probe: ways to bring a /dev/shm segment (a sealed snapshot, mapped afresh as a restarted
process does) to the GPU, with its CRC-32, each on a fresh mapping of the same file:

* ``mmap_pageable``: map, then chunked copies from the mapping to the device (pageable) on N
  threads, summing each chunk first (the memory tier's first version);
* ``mmap_populate``: the same after ``madvise(MADV_POPULATE_READ)`` of the mapping;
* ``register``: map, ``cudaHostRegister`` the mapping, then pinned copies (sum on N threads);
* ``pread_pinned``: ``preadv`` from the file into per-thread pinned chunks, sum, copy async;
* ``map_bounce``: map, then per thread: copy a chunk of the mapping into one of its two pinned
  bounce chunks (numpy, GIL released; the copy faults the mapping's pages in), sum the bounce
  chunk (cache-hot), copy it to the device async on the thread's stream;
* ``map_bounce_populate``: the same with ``MADV_POPULATE_READ`` of each chunk before its copy;
* floors: pinned host-to-device of the same bytes, and the CRC-32 alone over the mapping.

    python benchmarks/memory_restore_probe.py --gib 8 --json $OUT/probe.json
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

import torch

try:
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

MADV_POPULATE_READ = 22


def make_segment(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    block = os.urandom(64 << 20)
    for off in range(0, nbytes, len(block)):
        os.pwrite(fd, block[: min(len(block), nbytes - off)], off)
    os.close(fd)


def fresh_map(path: str, nbytes: int) -> torch.Tensor:
    fd = os.open(path, os.O_RDWR)
    try:
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    finally:
        os.close(fd)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


def chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, nbytes)) for a in range(0, nbytes, chunk)]


def copy_sum(src: torch.Tensor, dst: torch.Tensor, threads: int, chunk: int) -> float:
    def run(span):
        a, z = span
        crc32(memoryview(src[a:z].numpy()))
        dst[a:z].copy_(src[a:z], non_blocking=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, chunks(src.numel(), chunk)))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def next_chunk(local: threading.local, chunk: int, n: int) -> tuple[int, torch.Tensor]:
    """This thread's next of its two pinned chunks (allocated at its first call), once the
    device copy from it is done; its index and its first ``n`` bytes."""
    if not hasattr(local, "bufs"):
        local.bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        local.events = [None, None]
        local.i = 0
        local.stream = torch.cuda.Stream()
    i = local.i = 1 - local.i
    if local.events[i] is not None:
        local.events[i].synchronize()
    return i, local.bufs[i][:n]


def to_device(local: threading.local, i: int, buf: torch.Tensor, dst: torch.Tensor) -> None:
    """``buf`` (chunk ``i``) to ``dst`` on this thread's stream; the chunk's event records it."""
    with torch.cuda.stream(local.stream):
        dst.copy_(buf, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(local.stream)
    local.events[i] = ev


def pread_pinned(path: str, dst: torch.Tensor, threads: int, chunk: int) -> float:
    fd = os.open(path, os.O_RDONLY)
    local = threading.local()

    def run(span):
        a, z = span
        i, buf = next_chunk(local, chunk, z - a)
        os.preadv(fd, [memoryview(buf.numpy())], a)
        crc32(memoryview(buf.numpy()))
        to_device(local, i, buf, dst[a:z])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: None, range(threads)))
        t0 = time.perf_counter()
        list(pool.map(run, chunks(dst.numel(), chunk)))
    torch.cuda.synchronize()
    os.close(fd)
    return time.perf_counter() - t0


def map_bounce(path: str, dst: torch.Tensor, threads: int, chunk: int,
               populate: bool = False) -> float:
    """Fresh mapping -> per-thread pinned bounce chunks -> device (see the module's text)."""
    import numpy as np

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    local = threading.local()
    t0 = time.perf_counter()
    src = fresh_map(path, dst.numel())
    base = src.data_ptr()
    src_np = src.numpy()

    def run(span):
        a, z = span
        i, buf = next_chunk(local, chunk, z - a)
        if populate:
            libc.madvise(ctypes.c_void_p(base + a), ctypes.c_size_t(z - a), MADV_POPULATE_READ)
        np.copyto(buf.numpy(), src_np[a:z])
        crc32(memoryview(buf.numpy()))
        to_device(local, i, buf, dst[a:z])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, chunks(dst.numel(), chunk)))
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    del src_np, src
    return took


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=8)
    p.add_argument("--threads", default="8,16")
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--variants", default="mmap_pageable,mmap_populate,register,pread_pinned,"
                   "map_bounce,map_bounce_populate,crc_only_faulted")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    nbytes = int(args.gib * 2**30)
    chunk = args.chunk_mib << 20
    path = f"/dev/shm/mcxprobe_{os.getpid()}"
    make_segment(path, nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    out = {"bytes": nbytes, "h2d_pinned_gbps": nbytes / (time.perf_counter() - t0) / 1e9,
           "runs": []}
    del pinned
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    want = set(args.variants.split(","))
    for name in ("map_bounce", "map_bounce_populate"):
        for threads in [int(t) for t in args.threads.split(",")] if name in want else []:
            for c in (4 << 20, chunk):
                out["runs"].append((name, threads, map_bounce(path, dst, threads, c,
                                                              populate=name.endswith("populate")),
                                    {"chunk_mib": c >> 20}))
    for threads in [int(t) for t in args.threads.split(",")]:
        if "mmap_pageable" in want:
            src = fresh_map(path, nbytes)
            out["runs"].append(("mmap_pageable", threads, copy_sum(src, dst, threads, chunk)))
            del src
        if "register" not in want:
            if "pread_pinned" in want:
                out["runs"].append(("pread_pinned", threads,
                                    pread_pinned(path, dst, threads, chunk)))
            continue
        src = fresh_map(path, nbytes)
        t0 = time.perf_counter()
        rc = libc.madvise(ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(nbytes),
                          MADV_POPULATE_READ)
        populate = time.perf_counter() - t0
        out["runs"].append(("mmap_populate", threads, populate + copy_sum(src, dst, threads, chunk),
                            {"populate_s": populate, "rc": rc}))
        del src
        src = fresh_map(path, nbytes)
        t0 = time.perf_counter()
        err = torch.cuda.cudart().cudaHostRegister(src.data_ptr(), nbytes, 0)
        reg = time.perf_counter() - t0
        out["runs"].append(("register", threads, reg + copy_sum(src, dst, threads, chunk),
                            {"register_s": reg, "err": int(err)}))
        torch.cuda.cudart().cudaHostUnregister(src.data_ptr())
        del src
        out["runs"].append(("pread_pinned", threads, pread_pinned(path, dst, threads, chunk)))
        src = fresh_map(path, nbytes)
        src[::4096].sum()  # faulted in
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda s: crc32(memoryview(src[s[0]:s[1]].numpy())),
                          chunks(nbytes, chunk)))
        out["runs"].append(("crc_only_faulted", threads, time.perf_counter() - t0))
        del src
    os.unlink(path)
    for r in out["runs"]:
        r_list = list(r)
        print(f"{r_list[0]:18s} threads={r_list[1]:3d} {r_list[2]:.3f} s "
              f"{nbytes / r_list[2] / 1e9:6.2f} GB/s {r_list[3] if len(r_list) > 3 else ''}")
    print(f"h2d pinned floor {out['h2d_pinned_gbps']:.2f} GB/s")
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
