"""Where a save's seconds go: our Checkpointer on a synthetic GPT-like state, per mode.

    torchrun --nproc-per-node 1 benchmarks/profile_save.py --gib 1.9 --saves 4 --out prof.json

Each mode: a fresh Checkpointer (start-up timed), ``prepare()`` where it applies, then ``--saves``
saves of the same state (modified in place between saves, like training). ``--finalize`` picks
when the previous save is finalized: ``blocking`` right after each save() (so durable_s - blocking_s
is the writer alone) or ``next`` (at the next save, as a trainer saving often sees it). Prints and
writes every per-save report (its ``phases`` name where the blocking time goes).

``--cprofile-save N`` runs save N of each mode under cProfile and prints the functions with the
most cumulative time (``--cprofile-top``); ``--probe-copy-overlap`` first measures (CUDA only)
how long small host-synchronising CUDA calls take while a large device-to-host copy runs on a
side stream, i.e. whether work that planning does can overlap the staging copies.
``--iteration-ms X`` (CUDA) times each save inside a simulated training iteration (``Iteration``):
the iteration-time increase at a save, the overlapped snapshot's measure.
``--mem-breakdown`` samples, every 20 ms, each process of this rank's tree (trainer, persistent
worker, queue managers, forked writers): ``Pss_Anon`` (forked pages split between sharers) and
``Anonymous``, plus ``/dev/shm``; per save it records each process's peak above its value before
the mode's Checkpointer existed (0 for processes started since), so host memory beyond the staging
buffers is attributed to a process.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH
sys.path.append(str(Path(__file__).resolve().parent))
import _bench_modes as bm  # noqa: E402
from megatron_ckpt_ext import Checkpointer, CkptOptions  # noqa: E402

MODES = {
    "persistent_cpu_shm": dict(async_save=True, use_persistent_ckpt_worker=True,
                               async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True),
    "persistent": dict(async_save=True, use_persistent_ckpt_worker=True,
                       ckpt_assume_constant_structure=True),
    "temporal_cpu_shm": dict(async_save=True, async_ckpt_use_cpu_shm=True,
                             ckpt_assume_constant_structure=True),
    "sync": dict(ckpt_assume_constant_structure=True),
    "persistent_cpu_shm_overlap": dict(async_save=True, use_persistent_ckpt_worker=True,
                                       async_ckpt_use_cpu_shm=True,
                                       ckpt_assume_constant_structure=True,
                                       ckpt_overlap_snapshot=True),
}


class Iteration:
    """``--iteration-ms``: a training iteration's stand-in on CUDA. bf16 matmuls for about the
    given time (forward and backward), then a torch optimizer step (its pre-hook is where an
    overlapped snapshot's copies are waited for) and the state changed in place (every 7th
    tensor), timed until its GPU work is done. A save, when given, is called first: the
    iteration-time increase at a save is what the trainer loses to it."""

    def __init__(self, ms: float, state: dict) -> None:
        self.tensors = [t.data for t in state.values()][::7]
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device="cuda"))], lr=0.0)
        self.n = 20
        self._matmuls()  # cuBLAS warm-up: a cold first timing made the loop 14x too short
        per = min(self._matmuls() for _ in range(3)) / self.n
        self.n = max(1, round(ms / 1e3 / per))

    def _matmuls(self) -> float:
        return self.run(step=False)

    def run(self, save: Any = None, *, step: bool = True) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if save is not None:
            save()
        for _ in range(self.n):
            torch.mm(self.a, self.a, out=self.out)
        if not step:
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        self.opt.step()
        for t in self.tensors:
            t.add_(1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def gpt_like_state(gib: float, device: str, rank: int, world: int) -> dict:
    """fp32 weights + two Adam moments in GPT-like shapes (hidden 1024), random values."""
    from megatron.core.dist_checkpointing import ShardedTensor

    h, total, out, i = 1024, int(gib * 2**30), {}, 0
    shapes = [(h * 3, h), (h, h), (4 * h, h), (h, 4 * h), (h,), (h,)]
    g = torch.Generator(device=device).manual_seed(rank)
    while sum(t.numel() * 4 for t in out.values()) < total:
        shape = shapes[i % len(shapes)]
        for kind in ("w", "exp_avg", "exp_avg_sq"):
            out[f"l{i}.{kind}"] = torch.randn(shape, generator=g, device=device)
        i += 1
    return {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) for k, t in out.items()}


def probe_copy_overlap(gib: float = 4.0) -> dict:
    """Seconds each small synchronising call takes alone and while ``gib`` of device-to-host
    copies (64 MiB each, pinned destination) run on a side stream."""
    n, chunk = max(1, int(gib * 16)), 2**24  # 64 MiB of fp32 each
    src = [torch.randn(chunk, device="cuda") for _ in range(n)]
    dst = [torch.empty(chunk, pin_memory=True) for _ in range(n)]
    side = torch.cuda.Stream()
    probes = {
        "tensor_item": lambda: torch.tensor([1], device="cuda").item(),
        "h2d_pageable_4B": lambda: torch.tensor([1], device="cuda"),
        "d2h_small_current_stream": lambda: torch.ones(1, device="cuda").cpu(),
        "current_stream_sync": lambda: torch.cuda.current_stream().synchronize(),
        "empty_cuda_alloc": lambda: torch.empty(1024, device="cuda"),
    }
    out: dict = {}
    for name, fn in probes.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        alone = time.perf_counter() - t0
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            t_copy = time.perf_counter()
            for d, s_ in zip(dst, src):
                d.copy_(s_, non_blocking=True)
        t0 = time.perf_counter()
        fn()
        during = time.perf_counter() - t0
        side.synchronize()
        copy = time.perf_counter() - t_copy
        out[name] = {"alone_s": round(alone, 6), "during_copy_s": round(during, 6),
                     "copy_s": round(copy, 4)}
    return {"copy_bytes": n * chunk * 4, "probes": out}


class GcPauses:
    """Python garbage-collector pauses (seconds, collections per generation) while active."""

    def __init__(self) -> None:
        self.seconds, self.by_gen, self._t0 = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.by_gen[info["generation"]] += 1

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _smaps(pid: int) -> dict:
    out: dict = bm.smaps_rollup(pid, ("Pss_Anon", "Anonymous"))
    try:
        with open(f"/proc/{pid}/comm") as fh:
            out["comm"] = fh.read().strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _print_growth(label: str, by_mapping: dict) -> None:
    """One line per process of MemBreakdown.by_mapping: total growth, then its top mappings."""
    for pid, rec in by_mapping.items():
        head, rows = rec["growth"][0], rec["growth"][1:]
        print(f"  {label} {rec['comm']} {pid}: {rec['key']} {head['total_grew'] / 1e6:+.1f} MB "
              f"(unmapped {head['unmapped'] / 1e6:.1f} MB); top: " + "; ".join(
                  f"{r['name'][-40:]}@{r['addr']}{' (new)' if r['new'] else ''} size "
                  f"{r['size'] / 1e6:.1f}MB {r['grew'] / 1e6:+.1f}MB" for r in rows), flush=True)


class MemBreakdown:
    """Per-process peak anonymous memory of this rank's process tree, above a baseline."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self._tree, self._shm = bm._process_tree, bm._shm_used
        self.base = {p: _smaps(p) for p in self._tree(os.getpid())}
        self.base_maps = {p: bm.smaps_mappings(p) for p in self._tree(os.getpid())}
        self.base_shm = self._shm()
        self.peak: dict[int, dict] = {}
        self.peak_shm = 0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="mem-breakdown")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self.sample()

    def sample(self) -> None:
        now = {p: _smaps(p) for p in self._tree(os.getpid())}
        shm = self._shm() - self.base_shm
        with self._lock:
            self.peak_shm = max(self.peak_shm, shm)
            for pid, v in now.items():
                if "Pss_Anon" not in v:
                    continue
                b = self.base.get(pid, {})
                pss, anon = v["Pss_Anon"] - b.get("Pss_Anon", 0), v["Anonymous"] - b.get("Anonymous", 0)
                rec = self.peak.setdefault(pid, {"comm": v.get("comm"), "pss_anon": pss,
                                                 "anon": anon, "existed_before": pid in self.base})
                rec["pss_anon"] = max(rec["pss_anon"], pss)  # a trainer's may go below its
                rec["anon"] = max(rec["anon"], anon)         # baseline: forked pages are shared

    def take(self) -> dict:
        self.sample()
        with self._lock:
            out = {"shm_extra_bytes": self.peak_shm,
                   "processes": {str(p): dict(r) for p, r in sorted(self.peak.items())}}
            out["pss_anon_extra_bytes"] = sum(r["pss_anon"] for r in self.peak.values())
            self.peak, self.peak_shm = {}, 0
        return out

    def by_mapping(self, top: int = 12) -> dict:
        """Per process of the tree now: the mappings whose Pss_Anon grew most since the
        baseline; for a process started since (a fork), its Private_Dirty per mapping: the pages
        only it holds (copied on write by it or by the trainer)."""
        out = {}
        for p in self._tree(os.getpid()):
            key = "Pss_Anon" if p in self.base_maps else "Private_Dirty"
            out[str(p)] = {"comm": _smaps(p).get("comm"), "key": key, "growth": bm.mapping_growth(
                self.base_maps.get(p, {}), bm.smaps_mappings(p), key, top=top)}
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _owners(growth: list[dict], least: int = 4 << 20) -> None:
    """--tracemalloc with --mem-stages: the live CPU tensors (found through the collector) whose
    memory lies in each new mapping of this process above ``least`` bytes, and what holds them."""
    for m in growth:
        if not m.get("new") or m["size"] < least:
            continue
        lo = int(m["addr"], 16)
        hi = lo + m["size"]
        frozen = gc.get_freeze_count()
        gc.unfreeze()  # the Checkpointer freezes the trainer's objects before its fork
        try:
            found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and
                     o.device.type == "cpu" and lo <= o.untyped_storage().data_ptr() < hi]
        finally:
            if frozen:
                gc.freeze()
        print(f"    mapping {m['addr']} {m['size'] / 1e6:.1f} MB: {len(found)} CPU tensors "
              + "; ".join(f"{tuple(t.shape)} {t.dtype} held by "
                          + ",".join(sorted({type(r).__name__ for r in gc.get_referrers(t)}))
                          for t in found[:4]), flush=True)


def run_mode(name: str, opts: dict, state: dict, root: Path, saves: int, finalize: str,
             cprofile_save: int = 0, cprofile_top: int = 30, mem: bool = False,
             keep_last: int = 0, mem_stages: bool = False, iteration_ms: float = 0.0) -> dict:
    sampler = MemBreakdown() if mem else None
    mem_by_save: list[dict] = []
    stages: dict[str, dict] = {}

    traced = tracemalloc.is_tracing()
    if traced:
        before = tracemalloc.take_snapshot()

    def stage(name: str) -> None:  # where the trainer's new mappings appear (--mem-stages)
        if sampler and mem_stages and _rank() == 0:
            stages[name] = sampler.by_mapping(top=4)
            _print_growth(f"[{name}]", stages[name])
        if traced and sampler and mem_stages and _rank() == 0:
            _owners(stages[name].get(str(os.getpid()), {}).get("growth", [])[1:])
        if traced and _rank() == 0:  # --tracemalloc: what Python allocated since (live)
            diff = tracemalloc.take_snapshot().compare_to(before, "traceback")
            for d in diff[:4]:
                print(f"  [{name}] python +{d.size_diff / 1e6:.1f} MB in {d.count_diff} blocks at "
                      + " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                    for f in list(d.traceback)[-1:-7:-1]), flush=True)

    t0 = time.perf_counter()
    ck = Checkpointer(CkptOptions(**opts))
    startup = time.perf_counter() - t0
    stage("constructed")
    t0 = time.perf_counter()
    ck.prepare(state)
    prepare = time.perf_counter() - t0
    if mem_stages:
        ck.wait_prepared(600)
        ck.maybe_finalize(blocking=True)  # the worker's warm-up request
        stage("prepared")
    profiles: dict[int, str] = {}
    gc_in_save: list[dict] = []
    iterations: list[dict] = []
    loop = Iteration(iteration_ms, state) if iteration_ms and torch.cuda.is_available() else None
    for step in range(1, saves + 1):
        ck.wait_for_snapshot()  # an overlapped save's copies, before the state changes
        for st in list(state.values())[::7]:
            st.data.add_(1.0)
        pauses = GcPauses().__enter__()
        if loop is not None:  # iterations without a save (no write running), then one with it
            plain = sorted(loop.run() for _ in range(3))[1]
            with_save = loop.run(lambda: ck.save(state, root, iteration=step))
            iterations.append({"iteration": step, "plain_s": round(plain, 5),
                               "with_save_s": round(with_save, 5),
                               "increase_s": round(with_save - plain, 5)})
        elif step == cprofile_save:
            prof = cProfile.Profile()
            prof.runcall(ck.save, state, root, iteration=step)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(cprofile_top)
            profiles[step] = text.getvalue()
        else:
            ck.save(state, root, iteration=step)
        pauses.__exit__()
        if step <= 2:
            stage(f"save {step} returned")
        gc_in_save.append({"iteration": step, "gc_s": round(pauses.seconds, 4),
                           "collections": pauses.by_gen})
        if finalize == "blocking":
            ck.maybe_finalize(blocking=True)
            if step <= 2:
                stage(f"save {step} durable")
            if keep_last and step > keep_last and (_rank() == 0):
                shutil.rmtree(root / f"iter_{step - keep_last:07d}", ignore_errors=True)
        if sampler:
            mem_by_save.append({"iteration": step, **sampler.take()})
    ck.maybe_finalize(blocking=True)
    reports = list(ck.reports)
    by_mapping = sampler.by_mapping() if sampler else {}
    ck.close()
    if sampler:
        sampler.close()
    return {"mode": name, "startup_s": startup, "prepare_call_s": prepare, "reports": reports,
            "constructor": getattr(ck, "startup", {}), "cprofile": profiles,
            "gc_in_save": gc_in_save, "mem_by_save": mem_by_save,
            "mem_by_mapping": by_mapping, "mem_stages": stages, "iterations": iterations,
            "iteration_matmuls": loop.n if loop else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.9)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--finalize", choices=("blocking", "next"), default="blocking")
    p.add_argument("--root", default=None, help="checkpoint folder (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--cprofile-save", type=int, default=0, help="profile this save (1-based)")
    p.add_argument("--cprofile-top", type=int, default=30)
    p.add_argument("--probe-copy-overlap", action="store_true")
    p.add_argument("--mem-breakdown", action="store_true", help="per-process host memory per save")
    p.add_argument("--mem-stages", action="store_true",
                   help="with --mem-breakdown: mapping growth after start-up, prepare and saves 1-2")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="trace Python's allocations (FRAMES deep) and print, at each --mem-stages "
                        "stage, the four sites that grew most since the mode's Checkpointer")
    p.add_argument("--iteration-ms", type=float, default=0.0,
                   help="CUDA: time each save inside a simulated training iteration of about "
                        "this many ms of GPU work (iteration-time increase at a save)")
    p.add_argument("--keep-last", type=int, default=0,
                   help="with --finalize blocking: remove checkpoints older than the last N")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    bm.single_process_env()  # a plain `python benchmarks/profile_save.py` is a world of one
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    bm.warm_up_default_group(torch.device("cuda" if cuda else "cpu"))  # NCCL's communicator exists
    rank, world = dist.get_rank(), dist.get_world_size()
    probe = probe_copy_overlap() if a.probe_copy_overlap and cuda else None
    if probe and rank == 0:
        print("copy-overlap probe:", json.dumps(probe), flush=True)
    state = gpt_like_state(a.gib, "cuda" if cuda else "cpu", rank, world)
    if a.tracemalloc:
        tracemalloc.start(a.tracemalloc)
    results = []
    for name in a.modes:
        root = Path(a.root or tempfile.mkdtemp(prefix="mcx_prof_")) / name
        res = run_mode(name, MODES[name], state, root, a.saves, a.finalize, a.cprofile_save,
                       a.cprofile_top, a.mem_breakdown, a.keep_last,
                       a.mem_stages, a.iteration_ms)
        results.append(res)
        if rank == 0:
            print(f"== {name}: startup {res['startup_s']:.2f} s, prepare() {res['prepare_call_s']:.3f} s",
                  flush=True)
            gc_by_it = {g["iteration"]: g for g in res["gc_in_save"]}
            for r in res["reports"]:
                ph = " ".join(f"{k[:-2]}={v:.3f}" for k, v in r["phases"].items())
                g = gc_by_it.get(r["iteration"], {})
                ph += f" | gc {g.get('gc_s')} s {g.get('collections')}"
                print(f"  it{r['iteration']} {r['bytes'] / 1e9:.2f} GB blocking {r['blocking_s']:.3f} "
                      f"durable {r['durable_s']:.3f} staging {r['staging_gbps']} GB/s write "
                      f"{r['write_gbps']} GB/s | {ph}", flush=True)
            for it in res["iterations"]:
                print(f"  it{it['iteration']} iteration {it['plain_s']:.4f} s plain, "
                      f"{it['with_save_s']:.4f} s with the save: +{it['increase_s']:.4f} s", flush=True)
            for m in res["mem_by_save"]:
                procs = " ".join(f"{r['comm']}{'' if r['existed_before'] else '(new)'}="
                                 f"{r['pss_anon'] / 1e6:.0f}MB" for r in m["processes"].values())
                print(f"  mem it{m['iteration']}: shm +{m['shm_extra_bytes'] / 1e9:.3f} GB, "
                      f"Pss_Anon +{m['pss_anon_extra_bytes'] / 1e6:.0f} MB: {procs}", flush=True)
            _print_growth("mappings of", res["mem_by_mapping"])
            for step, text in res["cprofile"].items():
                print(f"  cProfile of save {step}:\n{text}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    if rank == 0 and a.out:
        Path(a.out).write_text(json.dumps({"gib": a.gib, "finalize": a.finalize, "world": world,
                                           "probe_copy_overlap": probe, "results": results},
                                          indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
