#!/usr/bin/env python3
"""Cold-read probe: how the order of a load's reads moves the cold read rate of one checkpoint.
Reads every tensor item of a torch_dist checkpoint (offsets from its .metadata) with the page
cache dropped first, in three orders: per file in offset order on one thread each (stock's
pattern), largest item first over N threads (32 MiB chunks), and file/offset order over N threads;
with ``--direct`` also each file's stripes read with ``O_DIRECT`` (aligned spans into an aligned
buffer, bypassing the page cache and its read-ahead), one stream and ``--threads`` stripes.
``--threads 2,4,8`` sweeps the stripes orders over each count (keys ``stripes_t4``...).

    python benchmarks/read_order_probe.py CHECKPOINT_DIR [--threads 8] [--json OUT]
    python benchmarks/read_order_probe.py /tmp/probe --make-gb 1.88 --items 400   # writes one first

``--make-gb`` first writes a torch DCP checkpoint of that many GB in ``--items`` tensors into one
file (a rank's file as ``--dist-ckpt-workers 1`` writes it, the 134M recipe's shape by default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 32 << 20


def _items(ckpt: Path) -> list[tuple[str, int, int]]:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    return [(s.relative_path, s.offset, s.length) for s in md.storage_data.values()]


def _make(ckpt: Path, nbytes: int, items: int) -> None:
    """A one-file torch DCP checkpoint of ``items`` float32 tensors, ``nbytes`` in all."""
    import torch
    import torch.distributed.checkpoint as dcp

    n = nbytes // 4 // items
    state = {f"t{i:04d}": torch.full((n,), float(i)) for i in range(items)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt), thread_count=1,
                                                        single_file_per_rank=True))


def _drop(ckpt: Path) -> None:
    for p in ckpt.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _run(ckpt: Path, jobs: list[tuple[str, int, int]], threads: int) -> float:
    fds = {name: os.open(ckpt / name, os.O_RDONLY) for name in {j[0] for j in jobs}}
    bufs: dict[int, bytearray] = {}

    def read(job: tuple[str, int, int]) -> None:
        import threading

        buf = bufs.setdefault(threading.get_ident(), bytearray(CHUNK))
        os.preadv(fds[job[0]], [memoryview(buf)[:job[2]]], job[1])

    _drop(ckpt)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))
    seconds = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return seconds


def _chunked(items: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return [(n, o + a, min(CHUNK, ln - a)) for n, o, ln in items for a in range(0, ln, CHUNK)]


def main() -> int:
    global CHUNK
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("--threads", default="8", help="a count, or counts separated by commas")
    p.add_argument("--direct", action="store_true", help="also the O_DIRECT stripes")
    p.add_argument("--chunk-mib", type=int, default=32)
    p.add_argument("--json", type=Path)
    p.add_argument("--make-gb", type=float, default=None)
    p.add_argument("--items", type=int, default=400)
    args = p.parse_args()
    CHUNK = args.chunk_mib << 20
    counts = [int(t) for t in str(args.threads).split(",")]
    if args.make_gb:
        _make(args.ckpt, int(args.make_gb * 1e9), args.items)
    items = _items(args.ckpt)
    total = sum(i[2] for i in items)
    files = sorted({i[0] for i in items})
    by_offset = sorted(items, key=lambda i: (i[0], i[1]))
    orders: dict = {"per_file_sequential": None}
    if len(counts) == 1:
        orders.update({"largest_first": _chunked(sorted(items, key=lambda i: -i[2])),
                       "file_offset": _chunked(by_offset)})
    if args.direct:
        orders["direct_per_file"] = "direct1"
    for n in counts:
        tag = "" if len(counts) == 1 else f"_t{n}"
        orders.update({f"stripes{tag}": ("stripes", n),
                       # each stripe's descriptor POSIX_FADV_SEQUENTIAL
                       f"stripes_fadv_sequential{tag}": ("stripes", n),
                       # the files' whole range POSIX_FADV_WILLNEED first
                       f"willneed_then_stripes{tag}": ("stripes", n)})
        if args.direct:
            orders[f"direct_stripes{tag}"] = ("direct", n)
    out = {"bytes": total, "items": len(items), "files": len(files), "threads": args.threads,
           "chunk_mib": args.chunk_mib, "gbps": {}}
    for name, jobs in orders.items():
        if jobs == "direct1" or (isinstance(jobs, tuple) and jobs[0] == "direct"):
            per_file = [[j for j in _chunked(by_offset) if j[0] == f] for f in files]
            if jobs != "direct1":
                per_file = [s for f in per_file for s in _stripes(f, jobs[1])]
            _drop(args.ckpt)
            t = time.perf_counter()
            with ThreadPoolExecutor(len(per_file)) as pool:
                list(pool.map(lambda js: _run_direct(args.ckpt, js), per_file))
            seconds = time.perf_counter() - t
        elif jobs is None or isinstance(jobs, tuple):
            # one thread per file, its chunks in order; or each file's chunks cut into
            # ``threads`` contiguous stripes (of about equal bytes), one thread per stripe
            per_file = [[j for j in _chunked(by_offset) if j[0] == f] for f in files]
            if jobs is not None:
                per_file = [s for f in per_file for s in _stripes(f, jobs[1])]
            advice = (os.POSIX_FADV_SEQUENTIAL if name.startswith("stripes_fadv_sequential")
                      else None)
            _drop(args.ckpt)
            t = time.perf_counter()
            if name.startswith("willneed_then_stripes"):
                for f in files:
                    fd = os.open(args.ckpt / f, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    os.close(fd)
            with ThreadPoolExecutor(len(per_file)) as pool:
                list(pool.map(lambda js: _run_serial(args.ckpt, js, advice), per_file))
            seconds = time.perf_counter() - t
        else:
            seconds = _run(args.ckpt, jobs, counts[0])
        out["gbps"][name] = round(total / seconds / 1e9, 3)
        print(f"[read_order_probe] {name:22s} {total / seconds / 1e9:.3f} GB/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def _stripes(jobs: list, n: int) -> list[list]:
    total, out, cur, acc = sum(j[2] for j in jobs), [], [], 0
    for j in jobs:
        cur.append(j)
        acc += j[2]
        if acc >= total * (len(out) + 1) / n:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def _run_serial(ckpt: Path, jobs: list[tuple[str, int, int]], advice: int | None = None) -> None:
    buf = bytearray(CHUNK)
    fd = os.open(ckpt / jobs[0][0], os.O_RDONLY)
    try:
        if advice is not None:
            os.posix_fadvise(fd, 0, 0, advice)
        for _, off, n in jobs:
            os.preadv(fd, [memoryview(buf)[:n]], off)
    finally:
        os.close(fd)


def _run_direct(ckpt: Path, jobs: list[tuple[str, int, int]], align: int = 4096) -> None:
    """``jobs`` (consecutive spans of one file) read with ``O_DIRECT``: each span widened to
    ``align`` at both ends, into an anonymous mapping (page-aligned)."""
    import mmap

    buf = mmap.mmap(-1, CHUNK + 2 * align)
    fd = os.open(ckpt / jobs[0][0], os.O_RDONLY | os.O_DIRECT)
    try:
        for _, off, n in jobs:
            start = off - off % align
            end = -(-(off + n) // align) * align
            os.preadv(fd, [memoryview(buf)[:end - start]], start)
    finally:
        os.close(fd)
        buf.close()


if __name__ == "__main__":
    sys.exit(main())
