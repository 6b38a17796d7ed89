"""CRC-32 throughput on this host: one thread, and N threads at once on separate 32 MiB buffers
(zlib releases the GIL). What inline load verification can cost is bounded by it.

    python3 benchmarks/crc_probe.py --threads 1 8 16
"""
from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    out = {"zlib": zlib.ZLIB_RUNTIME_VERSION, "cpus": os.cpu_count(), "gbps": {}}
    for n in args.threads:
        bufs = [os.urandom(args.mib << 20) for _ in range(n)]
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(zlib.crc32, bufs))
            t = time.perf_counter()
            for _ in range(args.rounds):
                list(pool.map(zlib.crc32, bufs))
            s = time.perf_counter() - t
        out["gbps"][n] = round(n * args.rounds * (args.mib << 20) / s / 1e9, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
