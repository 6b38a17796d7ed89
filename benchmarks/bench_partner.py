"""Partner copies (--ckpt-memory-partner): what they cost per save and what a restart after
losing a node gets from them, two ranks standing for two nodes (each its own shared-memory
directory) on one host, one run.

Per round (partner copies off, then on, ``--rounds`` times): ``--saves`` saves of a GPT-shaped
state of ``--gib`` per rank (async, cpu-shm, persistent worker, constant structure), each
followed by a fixed "training step" (``--step-matmuls`` CPU matmuls on one thread, timed: what
the background copy takes from training on this host); per save its blocking time, and with
copies on the copy's seconds (``partner_copy_s``: the sender's, from the seal to the partner's
acknowledgement) and the time from the commit until the copy is sealed on the partner.
Then restores of the last save (values compared bit for bit): from memory with both nodes
intact, from memory after node 0's directory is emptied (rank 0 fetches its snapshot back from
the copy on node 1), and from storage (memory tier off): cold (its pages dropped, as on a
replaced node) and warm (its pages read first: the writer drops what it wrote from the page
cache). Node memory: the bytes in
each node's directory with copies on and off.

JSON: ``device``, ``versions``, ``world_size``, ``command``, ``bytes_per_rank``, ``rounds``
[{``partner``, ``blocking_s``, ``step_s``, ``copy_s``, ``sealed_on_partner_after_commit_s``}],
``node_bytes`` {``off``, ``on``}, ``restores`` [{``case``, ``tier``, ``load_s``,
``partner_fetch``, ``bit_exact``}] (rank 0's; ``load_s`` the slowest rank's), ``summary``.

    torchrun --nproc-per-node 2 benchmarks/bench_partner.py --gib 1 --json $OUT/partner.json
    torchrun --nproc-per-node 2 benchmarks/bench_partner.py --cpu-smoke --json /tmp/p.json  (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _bench_node as node  # noqa: E402

from benchmarks._bench_modes import build_state, gpt_shape, sharded, state_bytes  # noqa: E402
from benchmarks.bench_load import drop_pages, parallel_read_s  # noqa: E402
from megatron_ckpt_ext import Checkpointer, CkptOptions, backend  # noqa: E402
from megatron_ckpt_ext.save.layout import checkpoint_name, read_tracker  # noqa: E402
from megatron_ckpt_ext.staging import ShmStager  # noqa: E402
from megatron_ckpt_ext.staging.partner import replica_path  # noqa: E402
from megatron_ckpt_ext.staging.retained import read_seal  # noqa: E402

CPU_SHM = dict(async_save=True, async_ckpt_use_cpu_shm=True, use_persistent_ckpt_worker=True,
               ckpt_assume_constant_structure=True)


def node_dir(base: Path, rank: int) -> str:
    return str(base / f"node{rank}")


def checkpointer(base: Path, rank: int, **options) -> Checkpointer:
    stager = ShmStager(job_id="benchpartner", rank=rank, shm_dir=node_dir(base, rank), reuse=True)
    return Checkpointer(CkptOptions(**CPU_SHM, most_recent_k=2, **options), stager=stager)


def step(a: torch.Tensor, matmuls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(matmuls):
        a = torch.tanh(a @ a)
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):  # a seal's temporary file may be renamed meanwhile
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(os.path.join(path, name)).st_size
    return total


def save_round(args, base: Path, root: Path, state: dict, rank: int, world: int,
               partner: bool, iteration0: int, keep: bool) -> dict:
    """``--saves`` saves; ``keep``: the last one's snapshot (and copy) stay at the close, for
    the restores (else the close frees them, so the next round starts from empty nodes)."""
    a = torch.rand(256, 256)
    blocking, steps, copies, sealed_after = [], [], [], []
    with checkpointer(base, rank, ckpt_memory_partner=partner,
                      ckpt_keep_memory_snapshot=keep) as ck:
        ck.prepare(sharded(state, rank, world))
        ck.wait_prepared()
        for i in range(args.saves):
            it = iteration0 + i
            next(iter(state.values())).view(-1)[0] = it  # each save's bytes differ
            ck.save(sharded(state, rank, world), root, iteration=it)
            ck.maybe_finalize(blocking=True)
            blocking.append(ck.reports[-1]["blocking_s"])  # (the report comes at the commit)
            committed = time.perf_counter()
            steps.append(step(a, args.step_matmuls))
            if partner:
                copy = replica_path(node_dir(base, (rank + 1) % world), root, rank)
                deadline = time.monotonic() + 120
                while getattr(read_seal(copy), "iteration", None) != it or \
                        ck.staging_stats().get("partner_iteration") != it:  # (acknowledged)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {rank}: no copy of iteration {it}")
                    time.sleep(0.001)
                sealed_after.append(time.perf_counter() - committed)
                copies.append(ck.staging_stats().get("partner_copy_s"))
            dist.barrier()
        node = dir_bytes(node_dir(base, rank))
    return {"partner": partner, "blocking_s": blocking, "step_s": steps, "copy_s": copies,
            "sealed_on_partner_after_commit_s": sealed_after, "node_bytes": node}


def restore(base: Path, root: Path, state: dict, rank: int, world: int, **options) -> dict:
    like = {k: torch.zeros_like(v) for k, v in state.items()}
    with checkpointer(base, rank, ckpt_keep_memory_snapshot=True, **options) as ck:
        dist.barrier()
        t0 = time.perf_counter()
        got = ck.load(sharded(like, rank, world), root)
        if any(v.is_cuda for v in got.values()):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        report = ck.load_reports[-1]
    same = all(torch.equal(got[k], state[k]) for k in state)
    slowest = max(dist_gather(seconds))
    return {"tier": report.get("tier"), "load_s": round(slowest, 6), "bit_exact": same,
            "partner_fetch": report.get("memory_detail", {}).get("partner_fetch"),
            "partner_s": report.get("memory_steps", {}).get("partner_s")}


def dist_gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state per rank")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--step-matmuls", type=int, default=40)
    p.add_argument("--out", default="/tmp/bench_partner")
    p.add_argument("--json", required=True, type=node.writable_file)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the state lives (cuda: every rank on the one GPU, each its own "
                   "share of it, gloo for the control plane)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny state (CI)")
    args = p.parse_args()
    node.out_dir(args.out)  # before any process group or state exists
    if args.cpu_smoke:
        args.gib, args.saves, args.rounds, args.step_matmuls = 0.01, 2, 1, 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    base = Path("/dev/shm") / f"mcxbench_partner_{os.environ.get('MASTER_PORT', '0')}"
    root = Path(args.out) / "ckpt"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        for r in range(world):
            shutil.rmtree(node_dir(base, r), ignore_errors=True)
            os.makedirs(node_dir(base, r))
    dist.barrier()
    device = torch.device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    state = build_state(gpt_shape(args.gib * 2**30), device=device, rank=rank)
    rounds, it = [], 1
    try:
        for n in range(args.rounds):
            for partner in (False, True):
                rounds.append(save_round(args, base, root, state, rank, world, partner, it,
                                         keep=partner and n == args.rounds - 1))
                it += args.saves
        restores = []
        for case, options in (("memory, both nodes", {"ckpt_memory_partner": True}),
                              ("memory, node 0 lost", {"ckpt_memory_partner": True}),
                              ("storage, cold", {"ckpt_memory_restore": False}),
                              ("storage, warm", {"ckpt_memory_restore": False})):
            if case == "memory, node 0 lost" and rank == 0:
                for name in os.listdir(node_dir(base, 0)):
                    os.unlink(os.path.join(node_dir(base, 0), name))
            if case == "storage, cold" and rank == 0:  # (a replaced node's page cache)
                drop_pages(checkpoint_name(root, read_tracker(root)))
            if case == "storage, warm" and rank == 0:  # the writer dropped what it wrote from
                parallel_read_s(checkpoint_name(root, read_tracker(root)), 8)  # the page cache
            dist.barrier()
            restores.append({"case": case, **restore(base, root, state, rank, world, **options)})
        all_rounds = dist_gather(rounds)
    except BaseException:  # no barrier: the other rank may never reach one; torchrun ends it
        traceback.print_exc()
        shutil.rmtree(node_dir(base, rank), ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    if rank != 0:
        dist.destroy_process_group()
        return 0
    caps = backend.detect()
    per_rank = [[r for r in ranks] for ranks in all_rounds]

    def pooled(partner: bool, key: str) -> list[float]:
        return [v for ranks in per_rank for r in ranks if r["partner"] is partner for v in r[key]]

    summary = {
        "blocking_median_s": {k: statistics.median(pooled(v, "blocking_s"))
                              for k, v in (("off", False), ("on", True))},
        "step_median_s": {k: statistics.median(pooled(v, "step_s"))
                          for k, v in (("off", False), ("on", True))},
        "copy_median_s": statistics.median(pooled(True, "copy_s")),
        "copy_gbps": state_bytes(state) / 1e9 / statistics.median(pooled(True, "copy_s")),
        "sealed_on_partner_after_commit_median_s":
            statistics.median(pooled(True, "sealed_on_partner_after_commit_s")),
        "node_bytes": {k: max(r["node_bytes"] for ranks in per_rank for r in ranks
                              if r["partner"] is v) for k, v in (("off", False), ("on", True))},
    }
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    out = {"device": f"{name}, {os.cpu_count()} cores", "versions": {"torch": torch.__version__,
                                         "megatron-core": caps.mcore_version},
           "world_size": world, "ranks_per_device": world if args.device == "cuda" else None,
           "command": "torchrun --nproc-per-node %d %s" % (world, " ".join(sys.argv)),
           "bytes_per_rank":
           state_bytes(state), "rounds": per_rank, "restores": restores, "summary": summary}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps({"summary": summary, "restores": restores}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
