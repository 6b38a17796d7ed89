"""How long pinning a load's host chunks takes (``torch.empty(..., pin_memory=True)``, as the
storage read's chunk pool makes them: COUNT chunks of CHUNK MiB), in this process alone or with
every local rank pinning at once (run under torchrun: each rank pins on its own device).

    torchrun --nproc-per-node 4 benchmarks/probe_pinning.py --count 24 --chunk-mib 32

Prints one JSON line per rank: seconds for the whole set, the slowest single chunk.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--chunk-mib", type=int, default=32)
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local % torch.cuda.device_count())
    torch.zeros(1, device="cuda")
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
    t0, slowest, kept = time.perf_counter(), 0.0, []
    for _ in range(a.count):
        t = time.perf_counter()
        kept.append(torch.empty(a.chunk_mib << 20, dtype=torch.uint8, pin_memory=True))
        slowest = max(slowest, time.perf_counter() - t)
    print(json.dumps({"rank": local, "count": a.count, "chunk_mib": a.chunk_mib,
                      "seconds": round(time.perf_counter() - t0, 4),
                      "slowest_chunk_s": round(slowest, 4)}), flush=True)


if __name__ == "__main__":
    main()
