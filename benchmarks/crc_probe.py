"""Checksum throughput on this host, for each candidate installed: one thread, and N threads at
once on separate buffers (each releases the GIL on large buffers). What verification at load
and the snapshot's sums can cost is bounded by it; the package uses ``isal`` (zlib's CRC-32
values, so every manifest verifies with either) where installed (megatron_ckpt_ext/_crc.py).

Candidates: zlib's CRC-32, ISA-L's CRC-32 (``isal``, zlib's polynomial), CRC-32C (``crc32c``,
``google_crc32c``: another polynomial, what object stores use) and XXH3-64 (``xxhash``).

    python3 benchmarks/crc_probe.py --threads 1 8 16 --json $OUT/crc_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


def candidates() -> dict[str, Callable[[bytes], int]]:
    found: dict[str, Callable[[bytes], int]] = {"zlib.crc32": zlib.crc32}
    try:
        from isal.isal_zlib import crc32
        found["isal.crc32"] = crc32
    except ImportError:
        pass
    try:
        import crc32c
        found["crc32c.crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c
        found["google_crc32c.value"] = google_crc32c.value
    except ImportError:
        pass
    try:
        import xxhash
        found["xxhash.xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    return found


def rate(fn: Callable[[bytes], int], n: int, mib: int, rounds: int) -> float:
    bufs = [os.urandom(mib << 20) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(fn, bufs))
        t = time.perf_counter()
        for _ in range(rounds):
            list(pool.map(fn, bufs))
        s = time.perf_counter() - t
    return round(n * rounds * (mib << 20) / s / 1e9, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {"zlib": zlib.ZLIB_RUNTIME_VERSION, "cpus": os.cpu_count(), "mib": args.mib,
           "gbps": {name: {n: rate(fn, n, args.mib, args.rounds) for n in args.threads}
                    for name, fn in candidates().items()}}
    for name, by_n in out["gbps"].items():
        print(f"{name:22s} " + "  ".join(f"{n:2d} thr {g:6.2f} GB/s" for n, g in by_n.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
