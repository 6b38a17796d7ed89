"""What building the device CRC (megatron_ckpt_ext/_crc_device.py) costs a trainer's host memory:
Pss_Anon and Rss of this process (MB, /proc/self/smaps_rollup) after CUDA is up, after
``import triton``, once the kernel is compiled and checked (``warm_up``: Triton's cache cold in a
fresh machine's first process, warm in the next), and after ``malloc_trim(0)``. Run it twice in a
row to see both caches:

    python3 benchmarks/probe_device_crc_memory.py; python3 benchmarks/probe_device_crc_memory.py
"""
from __future__ import annotations

import ctypes
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH


def memory() -> dict:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss_Anon"):
            out[key] = round(int(rest.split()[0]) / 1024, 1)
    return out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_device_crc_memory needs a CUDA device")
    steps = {}
    torch.zeros(1, device="cuda")
    steps["cuda_up"] = memory()
    t = time.perf_counter()
    importlib.import_module("triton")
    steps["import_triton"] = memory()
    from megatron_ckpt_ext import _crc_device

    _crc_device.warm_up(torch.cuda.current_device())
    while not _crc_device.ready(torch.cuda.current_device()):
        time.sleep(0.01)
        if time.perf_counter() - t > 120:
            break
    steps["ready"] = memory()
    steps["ready_s"] = round(time.perf_counter() - t, 3)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    steps["after_malloc_trim"] = memory()
    print(json.dumps(steps))


if __name__ == "__main__":
    main()
