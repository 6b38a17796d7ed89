"""Load benchmark: ours (Checkpointer.load, verifying) vs stock megatron-core load vs plain torch
DCP load, from the page cache (warm) and with the files' pages dropped (cold), side by side in one
run, with three floors measured in the same run: a parallel page-cache read, a parallel cold read,
and a pinned host-to-device copy of the state's bytes.

One process (``torchrun --nproc-per-node 1``); the state is bench_ckpt.py's synthetic GPT, saved
once by our Checkpointer (sync). JSON (docs/benchmarks/README.md, "Load"):
``device``, ``versions``, ``floors`` {``h2d_pinned_gbps``, ``read_warm_gbps``, ``read_cold_gbps``},
``runs`` [{``source``, ``cache``, ``state_bytes``, ``load_s``, ``verified``}].

    torchrun --nproc-per-node 1 benchmarks/bench_load.py --gib 4 --repeats 2 --json $OUT/load.json
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_load.py --cpu-smoke --json /tmp/l.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._bench_modes import (build_state, gpt_shape, sharded,  # noqa: E402
                                      single_process_env, state_bytes)
from megatron_ckpt_ext import Checkpointer, CkptOptions, backend  # noqa: E402

_CHUNK = 64 << 20


def _files(checkpoint: Path) -> list[Path]:
    return sorted(p for p in checkpoint.iterdir() if p.is_file())


def drop_pages(checkpoint: Path) -> None:
    """Evict the checkpoint's pages from the page cache (clean pages go at once)."""
    for path in _files(checkpoint):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def parallel_read_s(checkpoint: Path, threads: int) -> float:
    """Read every byte of the checkpoint, ``_CHUNK`` at a time over ``threads`` threads, each
    into one buffer of its own that it reuses (``preadv``: no allocation, no page faults on the
    destination, so what is timed is the file read itself)."""
    files = _files(checkpoint)
    jobs = [(i, off) for i, p in enumerate(files) for off in range(0, p.stat().st_size, _CHUNK)]
    fds = [os.open(p, os.O_RDONLY) for p in files]
    local = threading.local()

    def read(job: tuple[int, int]) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(_CHUNK))
            buf[::4096] = b"\1" * len(buf[::4096])  # touched once, before the clock matters
        i, off = job
        return os.preadv(fds[i], [buf], off)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: getattr(local, "buf", None), range(threads)))  # start them
            t0 = time.perf_counter()
            list(pool.map(read, jobs))
            return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def best_warm_read_s(checkpoint: Path, thread_counts: list[int]) -> tuple[float, int]:
    """The fastest page-cache read over ``thread_counts`` (the pages are read in once first):
    (seconds, threads)."""
    parallel_read_s(checkpoint, max(thread_counts))
    return min((parallel_read_s(checkpoint, n), n) for n in thread_counts)


def h2d_pinned_s(nbytes: int, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def _same(got: dict, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k].to(want[k].device), v) for k, v in want.items())


def load_ours(root: Path, state: dict, verify: bool,
              threads: int | None = None) -> tuple[float, bool, dict]:
    options = CkptOptions(ckpt_verify_load=verify)
    if threads is not None:
        options = CkptOptions(ckpt_verify_load=verify, ckpt_load_threads=threads)
    with Checkpointer(options) as ck:
        like = _like(state)
        t0 = time.perf_counter()
        got = ck.load(sharded(like, 0, 1), root)
        _sync(state)
        seconds = time.perf_counter() - t0
        report = ck.load_reports[-1]
    return seconds, _same(got, state), report


def load_megatron(checkpoint: Path, state: dict) -> tuple[float, bool]:
    like = _like(state)
    t0 = time.perf_counter()
    got = backend.dist_checkpointing().load(sharded(like, 0, 1), str(checkpoint))
    _sync(state)
    return time.perf_counter() - t0, _same(got, state)


def load_dcp(checkpoint: Path, state: dict) -> tuple[float, bool]:
    import torch.distributed.checkpoint as dcp

    like = _like(state)
    t0 = time.perf_counter()
    dcp.load(like, checkpoint_id=str(checkpoint))
    _sync(state)
    return time.perf_counter() - t0, _same(like, state)


def _sync(state: dict) -> None:
    if any(v.is_cuda for v in state.values()):
        torch.cuda.synchronize()


def targets(runs: list[dict], floors: dict) -> dict:
    """Issue 22's ratios from this run: the median over repeats of each (variant, cache)."""
    import statistics

    def med(variant: str, cache: str) -> float | None:
        xs = [r["load_s"] for r in runs if r["variant"] == variant and r["cache"] == cache]
        return statistics.median(xs) if xs else None

    on_disk = runs[0]["bytes_on_disk"]
    ours_w, ours_c = med("ours", "warm"), med("ours", "cold")
    bound = min(g for g in (floors["h2d_pinned_gbps"], floors["read_warm_gbps"]) if g)
    out = {"warm_gbps_over_floor": round(on_disk / ours_w / 1e9 / bound, 3),
           "warm_floor_gbps": bound,
           "warm_speedup_over_megatron": round(med("megatron", "warm") / ours_w, 2),
           "cold_gbps_over_floor": round(on_disk / ours_c / 1e9 / floors["read_cold_gbps"], 3),
           "verify_cost_warm": round(ours_w / med("ours_no_verify", "warm") - 1, 3),
           "warm_no_verify_gbps_over_floor": round(
               on_disk / med("ours_no_verify", "warm") / 1e9 / bound, 3)}
    out["met"] = {"warm >= 0.8 x floor": out["warm_gbps_over_floor"] >= 0.8,
                  "warm >= 4x megatron": out["warm_speedup_over_megatron"] >= 4,
                  "cold >= 0.8 x floor": out["cold_gbps_over_floor"] >= 0.8,
                  "verify <= 10% of warm": out["verify_cost_warm"] <= 0.10}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=2, help="runs per source and cache state")
    p.add_argument("--threads", type=int, default=16, help="threads of the read floors")
    p.add_argument("--load-threads", type=int, default=None,
                   help="--ckpt-load-threads for ours (default: the option's default)")
    p.add_argument("--out", default="/tmp/bench_load")
    p.add_argument("--json", required=True)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny state on CPU (CI)")
    args = p.parse_args()
    if not dist.is_initialized():
        single_process_env()  # a plain `python benchmarks/bench_load.py` is a world of one
        dist.init_process_group("gloo")
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    gib = 0.002 if args.cpu_smoke else args.gib
    state = build_state(gpt_shape(gib * 2**30), device=device, rank=0)
    nbytes = state_bytes(state)
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(state, 0, 1), root, iteration=1)
    checkpoint = root / "iter_0000001"
    on_disk = sum(f.stat().st_size for f in _files(checkpoint))

    def floors() -> dict:
        drop_pages(checkpoint)
        cold = parallel_read_s(checkpoint, args.threads)
        warm, warm_threads = best_warm_read_s(checkpoint, sorted({8, args.threads,
                                                                  2 * args.threads}))
        h2d = h2d_pinned_s(nbytes, device)
        return {"read_cold_gbps": round(on_disk / cold / 1e9, 3),
                "read_warm_gbps": round(on_disk / warm / 1e9, 3),
                "h2d_pinned_gbps": round(nbytes / h2d / 1e9, 3) if h2d else None,
                "read_warm_threads": warm_threads}

    measured = [floors()]
    runs = []
    loaders = {"ours": lambda: load_ours(root, state, True, args.load_threads),
               "ours_no_verify": lambda: load_ours(root, state, False, args.load_threads),
               "megatron": lambda: load_megatron(checkpoint, state),
               "torch_dcp": lambda: load_dcp(checkpoint, state)}
    for rep in range(args.repeats):
        for cache in ("cold", "warm"):
            for source, load in loaders.items():
                if cache == "cold":
                    drop_pages(checkpoint)
                else:
                    parallel_read_s(checkpoint, args.threads)  # in the page cache
                out = load()
                entry = {"source": "ours" if source.startswith("ours") else source,
                         "variant": source, "cache": cache, "repeat": rep,
                         "state_bytes": nbytes, "bytes_on_disk": on_disk,
                         "load_s": round(out[0], 4), "bit_exact": out[1],
                         "verified": bool(out[2]["verified"]) if len(out) > 2 else False}
                if len(out) > 2:
                    entry["phases"] = out[2]["phases"]
                    entry["direct_items"] = out[2]["direct_items"]
                    entry["stock_items"] = out[2]["stock_items"]
                runs.append(entry)
                print(f"[bench_load] {source:15s} {cache}: {out[0]:.3f} s "
                      f"({on_disk / out[0] / 1e9:.2f} GB/s) bit_exact={out[1]}", flush=True)
        measured.append(floors())
    caps = backend.detect()
    result = {
        "schema": "megatron-ckpt-ext/bench_load/1", "argv": sys.argv,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "megatron-core": caps.mcore_version,
                     "nvidia-resiliency-ext": caps.nvrx_version},
        "floors": {k: max(m[k] for m in measured) if measured[0][k] is not None else None
                   for k in ("h2d_pinned_gbps", "read_warm_gbps", "read_cold_gbps")},
        "floor_samples": measured, "runs": runs,
    }
    result["targets"] = targets(runs, result["floors"])
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({"floors": result["floors"], "targets": result["targets"]}))
    shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
