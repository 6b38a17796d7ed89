#!/usr/bin/env python3
"""What a restore prepared beside the model build costs the build (one GPU, no torchrun).

The launcher starts ``Checkpointer.prepare_restore`` as Megatron-LM's ``setup_model_and_optimizer``
begins: a sealed snapshot is mapped, summed (``presum_pieces``) and its buffers pinned one by one
(``cudaHostRegister``) on a background thread; a storage restore makes its pinned read chunks.
The real client showed the build (``model-and-optimizer-setup`` less ``load-checkpoint``) taking
0.6-0.7 s beside it against 0.1 s without (docs/MEGATRON_LM.md, twenty-seventh session). This
probe times a stand-in build on the main thread (``--params`` parameters made on the device and
initialised, a module per tensor, as a model's constructor does) alone and beside each part of
the preparation, on buffers of ``--gib`` in ``--buffers`` files under /dev/shm, each variant
``--repeats`` times, alternated:

  none        the build alone
  register    one thread registers every buffer, largest first (pin_adopted_now)
  paced       the same with ``--pause-ms`` between buffers
  presum      16 threads fault in and CRC-32 every buffer (presum_pieces)
  prepare     presum, then register: the whole preparation of a restore from memory
  chunks      16 pinned 64 MiB chunks allocated (a storage restore's read chunks)

``--fresh`` maps the files afresh before each variant, as a restarted process does (the
default reuses the mapping that wrote them: its pages are already in).

    python benchmarks/probe_build_beside_prepare.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

from megatron_ckpt_ext.staging.retained import presum_pieces

DEVICE = ["cuda"]
VARIANTS = ("none", "register", "paced", "presum", "prepare", "chunks")


def make_buffers(gib: float, count: int, prefix: str) -> list[torch.Tensor]:
    total = int(gib * 2**30)
    sizes = [total // count // 4096 * 4096] * count
    out = []
    for i, n in enumerate(sizes):
        path = f"/dev/shm/{prefix}_{i}"
        with open(path, "wb") as fh:
            fh.truncate(n)
        t = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
        t.fill_(i % 251)  # pages present, as a sealed snapshot's are
        out.append(t)
    return out


def build(params: int, tensors: int) -> list[torch.nn.Module]:
    """A model's constructor on the device: modules made and their weights initialised."""
    per = max(1, params // tensors)
    cols = 1024
    rows = max(1, per // cols)
    mods = []
    for _ in range(tensors):
        m = torch.nn.Linear(cols, rows, bias=True, device=DEVICE[0], dtype=torch.float32)
        torch.nn.init.normal_(m.weight, std=0.02)
        torch.nn.init.zeros_(m.bias)
        mods.append(m)
    if DEVICE[0] == "cuda":
        torch.cuda.synchronize()
    return mods


def register(buffers: list[torch.Tensor], pause_s: float = 0.0) -> None:
    if DEVICE[0] != "cuda":  # a dry run on a CPU host: nothing to register
        return
    for b in sorted(buffers, key=lambda t: -t.numel()):
        err = torch.cuda.cudart().cudaHostRegister(b.data_ptr(), b.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: {err}")
        if pause_s:
            time.sleep(pause_s)


def unregister(buffers: list[torch.Tensor]) -> None:
    if DEVICE[0] != "cuda":
        return
    for b in buffers:
        torch.cuda.cudart().cudaHostUnregister(b.data_ptr())


def background(variant: str, buffers: list[torch.Tensor], pause_s: float, kept: list) -> None:
    if variant in ("presum", "prepare"):
        presum_pieces(buffers, threads=16)
    if variant in ("register", "prepare"):
        register(buffers)
    if variant == "paced":
        register(buffers, pause_s)
    if variant == "chunks":
        kept.extend(torch.empty(64 << 20, dtype=torch.uint8, pin_memory=DEVICE[0] == "cuda")
                    for _ in range(16))


def remap(buffers: list[torch.Tensor], prefix: str) -> list[torch.Tensor]:
    """The same files mapped afresh, nothing faulted in: what a restarted process maps."""
    return [torch.from_file(f"/dev/shm/{prefix}_{i}", shared=True, size=b.numel(),
                            dtype=torch.uint8) for i, b in enumerate(buffers)]


def one(variant: str, buffers: list[torch.Tensor], args: argparse.Namespace) -> dict:
    if args.fresh:
        buffers = remap(buffers, args.prefix)
    kept: list = []
    done: dict = {}

    def run() -> None:
        t0 = time.perf_counter()
        background(variant, buffers, args.pause_ms / 1000, kept)
        done["bg_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=run) if variant != "none" else None
    t0 = time.perf_counter()
    if thread is not None:
        thread.start()
    mods = build(args.params, args.tensors)
    build_s = time.perf_counter() - t0
    if thread is not None:
        thread.join()
    both_s = time.perf_counter() - t0
    del mods
    if DEVICE[0] == "cuda":
        torch.cuda.empty_cache()
    if variant in ("register", "paced", "prepare"):
        unregister(buffers)
    kept.clear()
    return {"build_s": round(build_s, 4), "bg_s": round(done.get("bg_s", 0.0), 4),
            "both_s": round(both_s, 4)}


def copies(buffers: list[torch.Tensor], threads_list: list[int], repeats: int) -> dict:
    """What a restore's copies cost without any preparation: every buffer copied to the device
    from its pageable mapping (the driver stages it) on 1..N threads, against registering them
    all (alone, nothing beside it) and the copy once registered."""
    from concurrent.futures import ThreadPoolExecutor

    nbytes = sum(b.numel() for b in buffers)
    dst = [torch.empty(b.numel(), dtype=torch.uint8, device=DEVICE[0]) for b in buffers]

    def copy_all(threads: int) -> float:
        def one(i: int) -> None:
            dst[i].copy_(buffers[i])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(buffers))))
        if DEVICE[0] == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    out: dict = {"bytes": nbytes}
    # a restarted process maps the snapshot afresh: its first copy faults every page in
    out[f"pageable_fresh_t{max(threads_list)}_s"] = round(copy_all(max(threads_list)), 4)
    for threads in threads_list:
        got = [copy_all(threads) for _ in range(repeats)]
        out[f"pageable_t{threads}_s"] = round(min(got), 4)
    t0 = time.perf_counter()
    register(buffers)
    out["register_s"] = round(time.perf_counter() - t0, 4)
    for threads in (1, max(threads_list)):
        out[f"pinned_t{threads}_s"] = round(min(copy_all(threads) for _ in range(repeats)), 4)
    t0 = time.perf_counter()
    unregister(buffers)
    out["unregister_s"] = round(time.perf_counter() - t0, 4)
    print("copies", out, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.75, help="the snapshot's bytes (134M: 1.75)")
    p.add_argument("--buffers", type=int, default=400)
    p.add_argument("--params", type=int, default=134_000_000)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pause-ms", type=float, default=2.0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--json", default=None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run")
    p.add_argument("--fresh", action="store_true",
                   help="map the buffers afresh before each variant (a restarted process's "
                   "mapping: registering or summing then faults every page in)")
    p.add_argument("--copies", action="store_true",
                   help="also time the restore's copies without preparation: pageable copies on "
                   "1, 4 and 16 threads, registration alone, pinned copies")
    args = p.parse_args()
    DEVICE[0] = args.device
    if args.device == "cuda":
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
    prefix = args.prefix = f"mcx_probe_build_{os.getpid()}"
    buffers = make_buffers(args.gib, args.buffers, prefix)
    try:
        one("none", buffers, args)  # warm: allocator, kernels
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for _ in range(args.repeats):
            for v in args.variants:
                runs[v].append(one(v, buffers, args))
                print(v, runs[v][-1], flush=True)
        copied = None
        if args.copies:  # a fresh mapping of the same files, as a restarted process has
            copied = copies(remap(buffers, prefix), [1, 4, 16], args.repeats)
    finally:
        for i in range(args.buffers):
            try:
                os.unlink(f"/dev/shm/{prefix}_{i}")
            except OSError:
                pass
    summary = {v: {k: statistics.median(r[k] for r in rs) for k in ("build_s", "bg_s", "both_s")}
               for v, rs in runs.items()}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                       "args": vars(args), "copies": copied,
                       "runs": runs, "median": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
