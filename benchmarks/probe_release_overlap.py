"""Does handing back a load's pinned read chunks slow a save's staging copy that runs meanwhile?

The real client's end-of-training save after a cold resume once blocked 0.140 s against
0.038-0.045 s for every other save (H200, twentieth session): the save before it committed just
before it started (Megatron finalized it at the save's entry), and that commit started the
release of the load's kept chunks (``direct_read.PinnedChunks.release_shared``: torch's cached
pinned blocks freed). This probe times, in one process, a device-to-host copy of a state's bytes
tensor by tensor into pinned memory (as the staging copies), alone and with the release of
COUNT x CHUNK MiB of pinned chunks started on a thread just before it, alternated, REPEATS each;
the release at once (``--pace-ms 0``, as until the twentieth session) and one chunk at a time,
PACE ms apart (what ``backend.release_read_chunks`` does now).

    python3 benchmarks/probe_release_overlap.py --gib 1.75 --count 24 --chunk-mib 64 \
        --pace-ms 0 5 --json OUT

Prints one JSON line per case and writes them to --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ckpt_ext.backend import direct_read  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.75)
    p.add_argument("--tensors", type=int, default=400)
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--chunk-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--pace-ms", type=float, nargs="+", default=[0.0, 5.0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA"}))
        return 0
    dev = torch.device("cuda", 0)
    per = int(a.gib * 2**30) // a.tensors // 4
    src = [torch.randn(per, device=dev) for _ in range(a.tensors)]
    dst = [torch.empty(per, pin_memory=True) for _ in range(a.tensors)]
    stream = torch.cuda.Stream(dev)

    def copy_s() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(stream):
            for s, d in zip(src, dst):
                d.copy_(s, non_blocking=True)
        stream.synchronize()
        return time.perf_counter() - t

    def release_case(pace_s: float) -> tuple[float, float]:
        pool = direct_read.PinnedChunks.shared(a.count, a.chunk_mib << 20, pin=True)
        pool.make_ahead()
        took: list[float] = []

        def release() -> None:
            t = time.perf_counter()
            direct_read.PinnedChunks.release_shared(pace_s)
            took.append(time.perf_counter() - t)

        thread = threading.Thread(target=release)
        thread.start()
        seconds = copy_s()
        thread.join()
        return seconds, took[0]

    copy_s()  # first touch
    rows: dict = {"copy_alone_s": []}
    for pace in a.pace_ms:
        rows[f"pace_{pace:g}ms"] = {"copy_with_release_s": [], "release_s": []}
    for _ in range(a.repeats):
        rows["copy_alone_s"].append(round(copy_s(), 4))
        for pace in a.pace_ms:
            seconds, release = release_case(pace / 1e3)
            rows[f"pace_{pace:g}ms"]["copy_with_release_s"].append(round(seconds, 4))
            rows[f"pace_{pace:g}ms"]["release_s"].append(round(release, 4))
    alone = statistics.median(rows["copy_alone_s"])
    for pace in a.pace_ms:
        row = rows[f"pace_{pace:g}ms"]
        row["median_ratio"] = round(statistics.median(row["copy_with_release_s"]) / alone, 3)
    out = {"device": torch.cuda.get_device_name(dev), "gib": a.gib, "tensors": a.tensors,
           "count": a.count, "chunk_mib": a.chunk_mib, **rows}
    print(json.dumps(out), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
