"""Probe (one GPU): device-to-device copies of many byte buffers, issued as one
``torch._foreach_copy_`` call against one ``copy_`` per buffer, host issue time and time until
landed, repeated. The question it answers: the restore copied to the device ahead
(``--ckpt-restore-prefetch``) spent 26 ms issuing 400 device-to-device copies of 1.88 GB at 134M
(docs/notes/memory.md, twenty-ninth session).

    python benchmarks/probe_d2d_copy.py --mib 1800 --buffers 400 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sizes(total: int, count: int) -> list[int]:
    """Mixed sizes (a model's: a few large, many small) summing to about ``total``."""
    weights = [(i % 7 + 1) ** 3 for i in range(count)]
    scale = total / sum(weights)
    return [max(512, int(w * scale) // 512 * 512) for w in weights]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1800, help="total bytes, MiB")
    p.add_argument("--buffers", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_d2d_copy needs a CUDA device")
    sizes = _sizes(args.mib << 20, args.buffers)
    block = torch.empty(sum(sizes), dtype=torch.uint8, device="cuda")
    srcs, at = [], 0
    for n in sizes:
        srcs.append(block[at:at + n])
        at += n
    dsts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def each() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)

    out: dict = {"bytes": sum(sizes), "buffers": len(sizes), "device": torch.cuda.get_device_name()}
    for name, fn in (("foreach", foreach), ("per_buffer", each)) * 2:
        issue, landed = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            issue.append(t1 - t0)
            landed.append(t2 - t0)
        out[name] = {"issue_s": [round(x, 6) for x in issue],
                     "landed_s": [round(x, 6) for x in landed],
                     "landed_median_s": round(statistics.median(landed), 6),
                     "gbps": round(sum(sizes) / statistics.median(landed) / 1e9, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
