"""What this host gives for reading warm page-cache bytes AND copying them to the device, as
opposed to each alone (the load benchmark's floors are each alone: ``read_warm_gbps``,
``h2d_pinned_gbps``). A warm storage load does both for every byte: the kernel copies the
page cache into a pinned chunk (a read and a write of host memory), then the device copies the
chunk (a third pass over host memory). Measured on FILES of GIB in all (made here, then read
once to warm the page cache), each case at 8 and 16 threads, best of REPEATS:

* ``read``: each thread preads 32 MiB at a time into one pinned buffer of its own (no copy);
* ``h2d``: one thread copies a pinned buffer to the device, the same bytes in all;
* ``read_while_h2d``: ``read`` while another thread copies to the device without pause;
* ``pipeline``: each thread preads into one of two pinned buffers and copies it to the device
  on its own stream, reading the next chunk while the last one's copy runs (what the load's
  reading threads do, without anything else of the load).

    python benchmarks/probe_read_copy_floor.py --dir /tmp/rcf --gib 8 --json out.json

Prints and writes one JSON object: GB/s per case and thread count.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

CHUNK = 32 << 20


def _make(dirname: str, gib: float, files: int) -> list[str]:
    os.makedirs(dirname, exist_ok=True)
    per = int(gib * (1 << 30)) // files // CHUNK * CHUNK
    block = torch.randint(0, 255, (CHUNK,), dtype=torch.uint8).numpy().tobytes()
    paths = []
    for i in range(files):
        path = os.path.join(dirname, f"f{i}.bin")
        if not os.path.exists(path) or os.path.getsize(path) != per:
            with open(path, "wb") as f:
                for _ in range(per // CHUNK):
                    f.write(block)
        paths.append(path)
    return paths


def _chunks(paths: list[str]) -> list[tuple[int, int]]:
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    return [(fd, off) for fd, p in zip(fds, paths) for off in range(0, os.path.getsize(p), CHUNK)]


def _split(chunks: list, threads: int) -> list[list]:
    n = len(chunks)
    return [chunks[i * n // threads:(i + 1) * n // threads] for i in range(threads)]


def _run(threads: int, work) -> float:
    start = threading.Barrier(threads + 1)
    ts = [threading.Thread(target=lambda i=i: (start.wait(), work(i))) for i in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def read_case(chunks: list, threads: int, copying: threading.Event | None = None) -> float:
    parts = _split(chunks, threads)
    bufs = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]

    def work(i: int) -> None:
        view = memoryview(bufs[i].numpy())
        for fd, off in parts[i]:
            os.preadv(fd, [view], off)
    return _run(threads, work)


def pipeline_case(chunks: list, threads: int, device: torch.device) -> float:
    parts = _split(chunks, threads)
    bufs = [[torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            for _ in range(threads)]
    dst = [torch.empty(CHUNK, dtype=torch.uint8, device=device) for _ in range(threads)]
    streams = [torch.cuda.Stream(device) for _ in range(threads)]

    def work(i: int) -> None:
        events = [None, None]
        for k, (fd, off) in enumerate(parts[i]):
            j = k % 2
            if events[j] is not None:
                events[j].synchronize()
            os.preadv(fd, [memoryview(bufs[i][j].numpy())], off)
            with torch.cuda.stream(streams[i]):
                dst[i].copy_(bufs[i][j], non_blocking=True)
            events[j] = torch.cuda.Event()
            events[j].record(streams[i])
        streams[i].synchronize()
    return _run(threads, work)


def h2d_case(nbytes: int, device: torch.device, stop: threading.Event | None = None) -> float:
    src = torch.empty(CHUNK * 4, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(CHUNK * 4, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    t0, moved = time.perf_counter(), 0
    with torch.cuda.stream(stream):
        while (moved < nbytes) if stop is None else not stop.is_set():
            dst.copy_(src, non_blocking=True)
            moved += src.numel()
            if stop is not None:
                stream.synchronize()
    stream.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/mcx_read_copy_floor")
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--threads", type=int, nargs="+", default=[8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    chunks = _chunks(_make(a.dir, a.gib, a.files))
    nbytes = len(chunks) * CHUNK
    read_case(chunks, 16)  # the page cache warm
    out = {"bytes": nbytes, "chunk": CHUNK, "device": torch.cuda.get_device_name(device),
           "cores": os.cpu_count(), "gbps": {}}
    best = lambda f: nbytes / min(f() for _ in range(a.repeats)) / 1e9  # noqa: E731
    out["gbps"]["h2d"] = round(best(lambda: h2d_case(nbytes, device)), 2)
    for t in a.threads:
        out["gbps"][f"read_t{t}"] = round(best(lambda: read_case(chunks, t)), 2)

        def read_while_copying(t: int = t) -> float:
            stop = threading.Event()
            copier = threading.Thread(target=h2d_case, args=(0, device, stop))
            copier.start()
            try:
                return read_case(chunks, t)
            finally:
                stop.set()
                copier.join()
        out["gbps"][f"read_while_h2d_t{t}"] = round(best(read_while_copying), 2)
        out["gbps"][f"pipeline_t{t}"] = round(best(lambda: pipeline_case(chunks, t, device)), 2)
    print(json.dumps(out, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
