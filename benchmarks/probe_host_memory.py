"""Host memory (this process's anonymous memory) taken by each CUDA / NCCL step a checkpointing
trainer goes through: CUDA context, shared-memory segments and their ``cudaHostRegister``, a
registration from another thread, device-to-host copies into them (default and side stream),
``pin_memory``, and NCCL's communicator (created at the first collective).

    python benchmarks/probe_host_memory.py            # CUDA machine, one process

Prints one line per step with ``Rss``, ``Pss_Anon`` and ``Anonymous`` (MiB, from
``/proc/self/smaps_rollup``). Shared memory shows in ``Rss`` only; what a step adds to
``Pss_Anon`` is memory the benchmark's ``host_extra_bytes`` counts. Used to find that NCCL's
communicator, not staging, was behind ~230-320 MB charged to whichever benchmark mode ran first
(docs/benchmarks/README.md).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist

MIB = 1 << 20


def _mem(step: str) -> None:
    got = {}
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss_Anon", "Anonymous"):
                got[key] = int(rest.split()[0]) // 1024
    print(f"{step:36s} " + " ".join(f"{k} {v} MiB" for k, v in got.items()), flush=True)


def _shm_tensor(nbytes: int) -> torch.Tensor:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="mcx-probe-")
    try:
        os.ftruncate(fd, nbytes)
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)
    t.fill_(1)  # touched, as staged buffers are
    return t


def _register(cudart, t: torch.Tensor) -> None:
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        raise SystemExit(f"cudaHostRegister failed: {err}")


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_host_memory: needs CUDA", file=sys.stderr)
        return 2
    _mem("start (torch imported)")
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    _mem("CUDA context")
    cudart = torch.cuda.cudart()
    small, big, other = _shm_tensor(64 * MIB), _shm_tensor(1024 * MIB), _shm_tensor(64 * MIB)
    _mem("3 shm segments (1.1 GiB) touched")
    _register(cudart, small)
    _register(cudart, big)
    _mem("cudaHostRegister 64 MiB + 1 GiB")
    th = threading.Thread(target=_register, args=(cudart, other))
    th.start()
    th.join()
    _mem("cudaHostRegister from a thread")
    src = torch.randn(256 * MIB, device="cuda")  # 1 GiB of float32
    big.view(torch.float32).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    _mem("D2H 1 GiB, default stream")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big.view(torch.float32).copy_(src, non_blocking=True)
    side.synchronize()
    _mem("D2H 1 GiB, side stream")
    for t in (small, big, other):
        cudart.cudaHostUnregister(t.data_ptr())
    _mem("unregistered")
    pinned = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=True)
    _mem("pin_memory 64 MiB")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    _mem("NCCL process group created")
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    _mem("first NCCL all_reduce (communicator)")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    _mem("second NCCL all_reduce")
    dist.destroy_process_group()
    del pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
