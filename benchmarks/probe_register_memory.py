"""What ``cudaHostRegister`` costs a process's own anonymous memory (Pss_Anon, the host memory
the benchmarks charge to a rank) as a function of how many buffers are registered, not how many
bytes: N /dev/shm segments of S bytes each, mapped, touched, registered one by one (as the
staging registers one segment per tensor), then unregistered.

    python3 benchmarks/probe_register_memory.py --counts 1 32 256 1024 --total-mib 2048

Prints a JSON line per count: Pss_Anon before, after the segments were touched, after they
were registered, after they were unregistered (MiB), and the registered bytes per count.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile

import torch


def pss_anon_mib() -> float:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss_Anon:"):
            return round(int(line.split()[1]) / 1024, 2)
    return 0.0


def one(count: int, total: int) -> dict:
    size = max(4096, total // count // 4096 * 4096)
    maps, out = [], {"count": count, "bytes_each": size, "before": pss_anon_mib()}
    for i in range(count):
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="mcx_probe_")
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        os.close(fd)
        os.unlink(path)
        m.write(b"\1" * size)
        maps.append(m)
    out["touched"] = pss_anon_mib()
    cudart, ptrs = torch.cuda.cudart(), []
    for m in maps:
        t = torch.frombuffer(m, dtype=torch.uint8)
        assert int(cudart.cudaHostRegister(t.data_ptr(), size, 0)) == 0
        ptrs.append((t, t.data_ptr()))
    out["registered"] = pss_anon_mib()
    out["per_registration_kib"] = round((out["registered"] - out["touched"]) * 1024 / count, 1)
    for _, p in ptrs:
        cudart.cudaHostUnregister(p)
    out["unregistered"] = pss_anon_mib()
    del ptrs
    for m in maps:
        m.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--counts", type=int, nargs="+", default=[1, 32, 256, 1024])
    p.add_argument("--total-mib", type=int, default=2048)
    a = p.parse_args()
    torch.zeros(1, device="cuda")
    for count in a.counts:
        print(json.dumps(one(count, a.total_mib << 20)), flush=True)


if __name__ == "__main__":
    main()
