"""Where a save's seconds go: our Checkpointer on a synthetic GPT-like state, per mode.

    torchrun --nproc-per-node 1 scripts/profile_save.py --gib 1.9 --saves 4 --out prof.json

Each mode: a fresh Checkpointer (start-up timed), ``prepare()`` where it applies, then ``--saves``
saves of the same state (modified in place between saves, like training). ``--finalize`` picks
when the previous save is finalized: ``blocking`` right after each save() (so durable_s - blocking_s
is the writer alone) or ``next`` (at the next save, as a trainer saving often sees it). Prints and
writes every per-save report (its ``phases`` name where the blocking time goes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH
from megatron_ckpt_ext import Checkpointer, CkptOptions  # noqa: E402

MODES = {
    "persistent_cpu_shm": dict(async_save=True, use_persistent_ckpt_worker=True,
                               async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True),
    "persistent": dict(async_save=True, use_persistent_ckpt_worker=True,
                       ckpt_assume_constant_structure=True),
    "temporal_cpu_shm": dict(async_save=True, async_ckpt_use_cpu_shm=True,
                             ckpt_assume_constant_structure=True),
    "sync": dict(ckpt_assume_constant_structure=True),
}


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


def run_mode(name: str, opts: dict, state: dict, root: Path, saves: int, finalize: str) -> dict:
    t0 = time.perf_counter()
    ck = Checkpointer(CkptOptions(**opts))
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck.prepare(state)
    prepare = time.perf_counter() - t0
    for step in range(1, saves + 1):
        for st in list(state.values())[::7]:
            st.data.add_(1.0)
        ck.save(state, root, iteration=step)
        if finalize == "blocking":
            ck.maybe_finalize(blocking=True)
    ck.maybe_finalize(blocking=True)
    reports = list(ck.reports)
    ck.close()
    return {"mode": name, "startup_s": startup, "prepare_call_s": prepare, "reports": reports,
            "constructor": getattr(ck, "startup", {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.9)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--finalize", choices=("blocking", "next"), default="blocking")
    p.add_argument("--root", default=None, help="checkpoint folder (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = gpt_like_state(a.gib, "cuda" if cuda else "cpu", rank, world)
    results = []
    for name in a.modes:
        root = Path(a.root or tempfile.mkdtemp(prefix="mcx_prof_")) / name
        res = run_mode(name, MODES[name], state, root, a.saves, a.finalize)
        results.append(res)
        if rank == 0:
            print(f"== {name}: startup {res['startup_s']:.2f} s, prepare() {res['prepare_call_s']:.3f} s",
                  flush=True)
            for r in res["reports"]:
                ph = " ".join(f"{k[:-2]}={v:.3f}" for k, v in r["phases"].items())
                print(f"  it{r['iteration']} {r['bytes'] / 1e9:.2f} GB blocking {r['blocking_s']:.3f} "
                      f"durable {r['durable_s']:.3f} staging {r['staging_gbps']} GB/s write "
                      f"{r['write_gbps']} GB/s | {ph}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    if rank == 0 and a.out:
        Path(a.out).write_text(json.dumps({"gib": a.gib, "finalize": a.finalize, "world": world,
                                           "results": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
