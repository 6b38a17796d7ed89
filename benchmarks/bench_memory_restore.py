"""Restore benchmark: how fast a restarted job gets its state back from this node's sealed
snapshot (the memory tier) against storage (ours, warm and cold) and stock megatron-core (warm
and cold), one process, one run, with the pinned host-to-device floor measured in the same run.

A child process plays the job that was killed: it builds the state (the same seed), saves it
(async, cpu-shm, persistent worker, constant structure) a few times (each save's blocking time and
the background seal time, with the memory tier on and off) and ends without close(), leaving its
sealed snapshot in /dev/shm. This process then restores it. JSON fields: ``device``,
``versions``, ``world_size``, ``command``, ``floors`` {``h2d_pinned_gbps``}, ``runs``
[{``source`` ("ours"|"stock"), ``tier`` ("memory"|"storage"), ``cache`` ("warm"|"cold" for
storage; for memory None, or "built": the load starts once ``prepare_restore``'s preparation is
done, as when the model build outlasts it; ``prepared_wait_s`` how long that took),
``bytes``, ``load_s``, ``model``, ``bit_exact``}], ``save_path`` (the seal's cost).

    python benchmarks/bench_memory_restore.py --gib 8 --json $OUT/restore.json
    python benchmarks/bench_memory_restore.py --cpu-smoke --json /tmp/r.json      (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _bench_node as node  # noqa: E402

from benchmarks._bench_modes import (build_state, gpt_shape, sharded,  # noqa: E402
                                      single_process_env, state_bytes)
from benchmarks.bench_load import (_files, _like, _same, drop_pages, h2d_pinned_s,  # noqa: E402
                                   parallel_read_s)
from megatron_ckpt_ext import _crc  # noqa: E402
from megatron_ckpt_ext import Checkpointer, CkptOptions, backend  # noqa: E402
from megatron_ckpt_ext.load import prepared  # noqa: E402
from megatron_ckpt_ext.staging.retained import read_seal, seal_path  # noqa: E402

CPU_SHM = dict(async_save=True, async_ckpt_use_cpu_shm=True, use_persistent_ckpt_worker=True,
               ckpt_assume_constant_structure=True)


def init_world_1() -> None:
    """One process, with or without torchrun: a world of one."""
    if dist.is_initialized():
        return
    single_process_env()
    dist.init_process_group("gloo")


def the_state(gib: float, device: torch.device) -> dict[str, torch.Tensor]:
    return build_state(gpt_shape(gib * 2**30), device=device, rank=0)


def killed_job(args: argparse.Namespace, device: torch.device) -> dict:
    """Save ``--saves`` times with the memory tier off, then on (each save committed and, when
    on, sealed before the next), then leave without close()."""
    state = the_state(args.gib, device)
    root = Path(args.out)
    figures: dict = {}
    for tier in ("off", "on"):
        with_tier = tier == "on"
        ck = Checkpointer(CkptOptions(**CPU_SHM, ckpt_memory_restore=with_tier))
        ck.prepare(sharded(state, 0, 1))
        ck.wait_prepared()
        blocking, seal_s = [], []
        for it in range(1, args.saves + 1):
            ck.save(sharded(state, 0, 1), root, iteration=it)
            ck.maybe_finalize(blocking=True)
            blocking.append(ck.reports[-1]["blocking_s"])
            t0 = time.perf_counter()
            while with_tier and read_seal(seal_path("/dev/shm", root, 0)) is None:
                time.sleep(0.001)
            seal_s.append(time.perf_counter() - t0)
        figures[tier] = {"blocking_s": blocking, "seal_after_commit_s": seal_s}
        if not with_tier:
            ck.close()
            shutil.rmtree(root, ignore_errors=True)
    sys.stdout.flush()
    Path(args.child_json).write_text(json.dumps(figures))
    os._exit(0)  # no close(): the snapshot of the last save stays sealed, as after a crash


def restore(root: Path, state: dict, options: CkptOptions,
            built: bool = False) -> tuple[float, bool, dict]:
    """Restore ``root`` into targets like ``state``. ``prepare_restore`` runs before the targets
    are built, as a restarted job would; ``built``: the load starts once the preparation is done
    (a model build that outlasts it, as the real client's ~1B restart), its time in the report's
    ``prepared_wait_s``, not in the load's."""
    with Checkpointer(options) as ck:
        t = time.perf_counter()
        ck.prepare_restore(root)
        like = _like(state)
        if built:
            prepared.wait()
        waited = time.perf_counter() - t
        t0 = time.perf_counter()
        got = ck.load(sharded(like, 0, 1), root)
        if any(v.is_cuda for v in state.values()):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return seconds, _same(got, state), dict(ck.load_reports[-1], prepared_wait_s=waited)


def stock(checkpoint: Path, state: dict) -> tuple[float, bool, dict]:
    like = _like(state)
    t0 = time.perf_counter()
    got = backend.dist_checkpointing().load(sharded(like, 0, 1), str(checkpoint))
    if any(v.is_cuda for v in state.values()):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, _same(got, state), {"tier": "storage"}


CASES = ("ours-memory", "ours-memory-built", "ours-storage-warm", "ours-storage-cold",
         "stock-storage-warm", "stock-storage-cold")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="/tmp/bench_memory_restore")
    p.add_argument("--json", required=True, type=node.writable_file)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny state on CPU (CI)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                   help="loads to time each repeat (default all)")
    p.add_argument("--child-json", help=argparse.SUPPRESS)  # the killed job's own run
    args = p.parse_args()
    node.out_dir(args.out)  # before any process group or state exists
    init_world_1()
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if args.cpu_smoke:
        args.gib = 0.002
    if args.child_json:
        return killed_job(args, device)
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    child = Path(args.json).with_suffix(".killed_job.json")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}  # its own world
    subprocess.run([sys.executable, *sys.argv, "--child-json", str(child)], check=True, env=env)
    state = the_state(args.gib, device)
    nbytes = state_bytes(state)
    checkpoint = root / f"iter_{args.saves:07d}"
    keep = CkptOptions(**CPU_SHM, ckpt_keep_memory_snapshot=True)  # the next repeat adopts again
    storage = CkptOptions(**CPU_SHM, ckpt_memory_restore=False)
    # the storage loads read a copy: a load of the original with the memory tier off frees its
    # snapshot (nobody would adopt it), and the next repeat's memory case would find none
    copy = root.with_name(root.name + "_storage")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(root, copy)
    copied = copy / checkpoint.name
    cases = [("ours", "memory", None, lambda: restore(root, state, keep)),
             ("ours", "memory", "built", lambda: restore(root, state, keep, built=True)),
             ("ours", "storage", "warm", lambda: restore(copy, state, storage)),
             ("ours", "storage", "cold", lambda: restore(copy, state, storage)),
             ("stock", "storage", "warm", lambda: stock(copied, state)),
             ("stock", "storage", "cold", lambda: stock(copied, state))]
    cases = [c for c in cases if "-".join(x for x in c[:3] if x) in args.cases]
    runs = []
    for rep in range(args.repeats):
        for source, tier, cache, load in cases:
            if cache == "cold":
                drop_pages(copied)
            elif cache == "warm":  # the writer drops what it wrote from the page cache
                parallel_read_s(copied, 16)
            seconds, exact, report = load()
            runs.append({"source": source, "tier": report.get("tier"), "expected_tier": tier,
                         "cache": cache, "bytes": nbytes, "load_s": round(seconds, 4),
                         "model": f"synthetic GPT {args.gib:g} GiB", "bit_exact": exact,
                         "repeat": rep, "phases": report.get("phases"),
                         "prepared_wait_s": round(report.get("prepared_wait_s", 0.0), 4),
                         "memory_steps": report.get("memory_steps"),
                         "memory_detail": report.get("memory_detail")})
            print(f"[restore] {source:5s} {tier:7s} {cache or '-':4s} {seconds:.3f} s "
                  f"({nbytes / seconds / 1e9:.2f} GB/s) tier={report.get('tier')} "
                  f"bit_exact={exact} {report.get('memory_steps') or ''} "
                  f"{report.get('memory_detail') or ''}", flush=True)
    h2d = h2d_pinned_s(nbytes, device)
    caps = backend.detect()
    result = {
        "schema": "megatron-ckpt-ext/bench_memory_restore/1", "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "megatron-core": caps.mcore_version,
                     "nvidia-resiliency-ext": caps.nvrx_version,
                         "crc32": _crc.IMPLEMENTATION},
        "world_size": 1, "state_bytes": nbytes,
        "bytes_on_disk": sum(f.stat().st_size for f in _files(checkpoint)),
        "floors": {"h2d_pinned_gbps": round(nbytes / h2d / 1e9, 3) if h2d else None},
        "save_path": json.loads(child.read_text()), "runs": runs,
    }
    result["summary"] = summary(runs, result["floors"])
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({"floors": result["floors"], "summary": result["summary"],
                      "save_path": result["save_path"]}))
    drop_snapshot(root)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(copy, ignore_errors=True)
    dist.destroy_process_group()
    return 0


def drop_snapshot(root: Path) -> None:
    """This run's snapshot only (``shm clean`` would remove every job's on the node)."""
    seal = read_seal(seal_path("/dev/shm", root, 0))
    if seal is None:
        return
    for entry in seal.entries:
        if entry.path and os.path.exists(entry.path):
            os.unlink(entry.path)
    os.unlink(seal.file)


def summary(runs: list[dict], floors: dict) -> dict:
    import statistics

    def med(source: str, tier: str, cache: str | None) -> float | None:
        xs = [r["load_s"] for r in runs
              if (r["source"], r["expected_tier"], r["cache"]) == (source, tier, cache)]
        return statistics.median(xs) if xs else None

    memory, warm = med("ours", "memory", None), med("ours", "storage", "warm")
    built = med("ours", "memory", "built")
    out = {"memory_s": memory, "memory_built_s": built, "ours_storage_warm_s": warm,
           "ours_storage_cold_s": med("ours", "storage", "cold"),
           "stock_warm_s": med("stock", "storage", "warm"),
           "stock_cold_s": med("stock", "storage", "cold"),
           "memory_over_warm_storage": round(memory / warm, 3) if memory and warm else None,
           "all_bit_exact": all(r["bit_exact"] for r in runs),
           "tiers_as_expected": all(r["tier"] == r["expected_tier"] for r in runs)}
    if floors.get("h2d_pinned_gbps") and memory:
        nbytes = runs[0]["bytes"]
        out["memory_gbps_over_h2d_floor"] = round(nbytes / memory / 1e9
                                                  / floors["h2d_pinned_gbps"], 3)
        if built:  # the load once the preparation is done (the model build outlasting it)
            out["memory_built_gbps_over_h2d_floor"] = round(
                nbytes / built / 1e9 / floors["h2d_pinned_gbps"], 3)
    return out


if __name__ == "__main__":
    sys.exit(main())
