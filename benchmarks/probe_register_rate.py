"""How fast this host pins staging memory, and what could make it faster: the first save's
preparation faults in and ``cudaHostRegister``s every staging segment (/dev/shm, one per tensor);
on one H200 a 1B state's 12 GB took ~8 s, and training steps beside it ran ~35 % slower.

Per variant, SEGMENTS segments of TOTAL/SEGMENTS bytes each: the seconds to fault the pages in
(``MADV_POPULATE_WRITE``), to register them, and to unregister them, with THREADS threads each
taking its share of the segments (both steps). Variants:
  shm        /dev/shm files, as the staging makes them
  shm_huge   the same with ``MADV_HUGEPAGE`` before the fault-in (takes effect only where the
             kernel lets shared memory use huge pages: see ``host``)
  anon_huge  private anonymous memory with ``MADV_HUGEPAGE`` (what a process's own pinned
             buffer could use; not shareable with a writer or a restart)
Also what the host allows: transparent huge pages for anonymous and shared memory, and the
/dev/shm mount's options; the huge pages each variant got (``ShmemHugePages``/``AnonHugePages``).

    python3 benchmarks/probe_register_rate.py --total-gib 4 --segments 256 --threads 1 4 \
        --json /tmp/register_rate.json
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_ckpt_ext._runtime import madvise, populate  # noqa: E402

_MADV_HUGEPAGE = 14


def _read(path: str) -> str | None:
    try:
        return open(path).read().strip()
    except OSError:
        return None


def host() -> dict:
    mounts = [line for line in (_read("/proc/mounts") or "").splitlines() if " /dev/shm " in line]
    return {"thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            "dev_shm_mount": mounts[0] if mounts else None, "kernel": os.uname().release,
            "page_size": os.sysconf("SC_PAGE_SIZE")}


def _meminfo_kib(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _segments(variant: str, count: int, size: int) -> list:
    out = []
    for _ in range(count):
        if variant == "anon_huge":
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="mcx_probe_reg_")
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
            os.close(fd)
            os.unlink(path)
        out.append(m)
    return out


def _address(m: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _in_threads(threads: int, work, items: list) -> float:
    t0 = time.perf_counter()
    shares = [items[i::threads] for i in range(threads)]
    pool = [threading.Thread(target=lambda s=s: [work(x) for x in s]) for s in shares]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


def one(variant: str, total: int, count: int, threads: int) -> dict:
    size = max(1 << 21, total // count // (1 << 21) * (1 << 21))  # whole 2 MiB pages
    maps = _segments(variant, count, size)
    addrs = [(_address(m), size) for m in maps]
    huge_key = "AnonHugePages" if variant == "anon_huge" else "ShmemHugePages"
    huge_before = _meminfo_kib(huge_key)
    advised = all(madvise(a, n, _MADV_HUGEPAGE) for a, n in addrs) if "huge" in variant else None
    cudart = torch.cuda.cudart()
    errors: list = []

    def register(x):
        err = int(cudart.cudaHostRegister(x[0], x[1], 0))
        if err:
            errors.append(err)

    populate_s = _in_threads(threads, lambda x: populate(x[0], x[1], write=True), addrs)
    huge_mib = (_meminfo_kib(huge_key) - huge_before) / 1024
    register_s = _in_threads(threads, register, addrs)
    unregister_s = _in_threads(threads, lambda x: cudart.cudaHostUnregister(x[0]), addrs)
    del addrs
    for m in maps:
        m.close()
    gb = count * size / 1e9
    return {"variant": variant, "threads": threads, "segments": count, "bytes": count * size,
            "madvise_hugepage_ok": advised, "huge_pages_mib": round(huge_mib, 1),
            "populate_s": round(populate_s, 4), "register_s": round(register_s, 4),
            "unregister_s": round(unregister_s, 4),
            "populate_gbps": round(gb / populate_s, 2), "register_gbps": round(gb / register_s, 2),
            "register_errors": errors[:3]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total-gib", type=float, default=4.0)
    p.add_argument("--segments", type=int, default=256)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    p.add_argument("--variants", nargs="+", default=["shm", "shm_huge", "anon_huge"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.zeros(1, device="cuda")  # the context first: its set-up is not the register's
    out = {"host": host(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "benchmarks/probe_register_rate.py " + " ".join(sys.argv[1:]), "rows": []}
    print(json.dumps(out["host"]), flush=True)
    for r in range(a.repeats):
        for variant in a.variants:
            for threads in a.threads:
                row = one(variant, int(a.total_gib * 2**30), a.segments, threads)
                row["repeat"] = r
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
