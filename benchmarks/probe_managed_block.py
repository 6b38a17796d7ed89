"""Probe (one GPU): can the restore's copy-ahead block (``--ckpt-restore-prefetch``) give way to
the model built beside it? The block is taken while the device is still empty, before the
model exists (docs/MEMORY.md: why the flag is off by default). Held in CUDA managed memory
(``cudaMallocManaged``) and prefetched to the device, its pages may be evicted to host memory
by the driver when an ordinary allocation (the caching allocator's ``cudaMalloc``) needs the
room. The probe answers, in one process:

1. the block's fill rate from pinned host memory and its device-to-device copy rate out, against
   an ordinary device block;
2. whether ordinary allocations beyond what was free beside the block succeed (eviction), and
   whether the block's bytes are intact afterwards;
3. the copy-out rate once evicted.

    python benchmarks/probe_managed_block.py --block-gib 16 --fill-frac 0.9 --json out.json

The CUDA runtime and the prefetch call are the package's (``load/managed_block.py``); the
results in docs/memory/probes/ were made by this probe's first version (6d71c61), which had its
own copies of them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch

from megatron_ckpt_ext.load.managed_block import (_LOCATION_DEVICE, _Location, _prefetch,
                                                  _runtime)


def _version(rt: ctypes.CDLL) -> int:
    v = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(v))
    return v.value


class _Managed:
    """A managed allocation exposed to torch through ``__cuda_array_interface__``."""

    def __init__(self, rt: ctypes.CDLL, nbytes: int, device: int, advise: bool) -> None:
        self.rt, self.nbytes = rt, nbytes
        ptr = ctypes.c_void_p()
        rc = rt.cudaMallocManaged(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 1)  # global
        if rc:
            raise RuntimeError(f"cudaMallocManaged: {rc}")
        self.ptr = ptr.value
        if advise:  # cudaMemAdviseSetPreferredLocation = 3 (CUDA 12.2+: the _v2 call)
            advise_fn = rt.cudaMemAdvise if _version(rt) >= 13000 else rt.cudaMemAdvise_v2
            rc = advise_fn(ctypes.c_void_p(self.ptr), ctypes.c_size_t(nbytes), 3,
                           _Location(_LOCATION_DEVICE, device))
            if rc:
                print(f"cudaMemAdvise preferred location: {rc}")
        rc = _prefetch(rt, self.ptr, nbytes, device, torch.cuda.current_stream().cuda_stream)
        if rc:
            print(f"cudaMemPrefetchAsync: {rc} (driver or API mismatch; pages fault in)")
        torch.cuda.synchronize()
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (self.ptr, False), "version": 2}

    def free(self) -> None:
        if self.ptr:
            self.rt.cudaFree(ctypes.c_void_p(self.ptr))
            self.ptr = 0


def _rate(fn, nbytes: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round(nbytes / (time.perf_counter() - t) / 1e9, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-gib", type=float, default=16, help="the block's size")
    p.add_argument("--fill-frac", type=float, default=0.9,
                   help="ordinary allocations made afterwards, of the memory free before")
    p.add_argument("--piece-mib", type=int, default=1024)
    p.add_argument("--no-advise", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_managed_block needs a CUDA device")
    rt, dev = _runtime(), torch.cuda.current_device()
    free0, total = torch.cuda.mem_get_info()
    nbytes = int(args.block_gib * (1 << 30)) >> 20 << 20
    out: dict = {"device": torch.cuda.get_device_name(), "cudart": _version(rt),
                 "torch": torch.__version__, "free0": free0, "total": total,
                 "block_bytes": nbytes, "advise": not args.no_advise}
    piece = min(nbytes, 1 << 30)  # a pinned GiB copied into each GiB of the block
    src = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    src.random_(0, 256)
    sample = torch.arange(0, nbytes, 4093, dtype=torch.int64)
    expect = src[sample % piece].clone()

    def fill() -> None:
        for at in range(0, nbytes, piece):
            n = min(piece, nbytes - at)
            block[at:at + n].copy_(src[:n], non_blocking=True)

    t = time.perf_counter()
    m = _Managed(rt, nbytes, dev, advise=not args.no_advise)
    out["managed_alloc_prefetch_s"] = round(time.perf_counter() - t, 4)
    block = torch.as_tensor(m, device="cuda")
    out["free_after_block"] = torch.cuda.mem_get_info()[0]
    out["fill_gbps"] = _rate(fill, nbytes)
    out["fill_again_gbps"] = _rate(fill, nbytes)
    dst = torch.empty(piece, dtype=torch.uint8, device="cuda")
    out["d2d_out_gbps"] = _rate(lambda: dst.copy_(block[:piece]), piece)
    plain = torch.empty(piece, dtype=torch.uint8, device="cuda")
    out["d2d_plain_gbps"] = _rate(lambda: dst.copy_(plain), piece)
    del plain
    torch.cuda.empty_cache()

    want, held, err = int(free0 * args.fill_frac), [], None
    t = time.perf_counter()
    while sum(x.numel() for x in held) + (args.piece_mib << 20) <= want:
        try:
            held.append(torch.empty(args.piece_mib << 20, dtype=torch.uint8, device="cuda"))
            held[-1].fill_(1)
        except torch.OutOfMemoryError as e:
            err = str(e).splitlines()[0]
            break
    torch.cuda.synchronize()
    out["ordinary_wanted"] = want
    out["ordinary_got"] = sum(x.numel() for x in held)
    out["ordinary_beyond_free_beside_block"] = out["ordinary_got"] - out["free_after_block"]
    out["ordinary_s"] = round(time.perf_counter() - t, 3)
    out["oom"] = err
    out["free_after_ordinary"] = torch.cuda.mem_get_info()[0]
    out["d2d_out_after_gbps"] = _rate(lambda: dst.copy_(block[:piece]), piece)
    got = block[sample.to("cuda")].cpu()
    out["intact"] = bool(torch.equal(got, expect))
    del held
    torch.cuda.empty_cache()
    out["d2d_out_after_release_gbps"] = _rate(lambda: dst.copy_(block[:piece]), piece)
    del block
    m.free()
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
