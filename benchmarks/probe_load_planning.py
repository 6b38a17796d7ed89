"""What torch DCP's plan exchange cost a storage load: the load as it runs (each rank plans
alone, ``backend.load_metadata.planned_on_each_rank(every_size=True)``) against the same load
with DCP's collectives (every rank's plan gathered to one rank and scattered back, every rank's
read result gathered: what megatron-core <= 0.16 asks for), alternated in one run. On
megatron-core 0.19 both arms are the same (it asks for ``no_dist`` itself).

    torchrun --standalone --nproc-per-node 4 benchmarks/probe_load_planning.py --items 400

Prints, on rank 0, each arm's median load (the slowest rank's) and every repeat.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._bench_modes import sharded  # noqa: E402
from megatron_ckpt_ext import Checkpointer, CkptOptions  # noqa: E402
from megatron_ckpt_ext.backend import load_metadata, load_reader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=400, help="tensors in the state (all ranks')")
    ap.add_argument("--numel", type=int, default=1 << 14, help="elements of each (fp32)")
    ap.add_argument("--repeats", type=int, default=8, help="loads of each arm, alternated")
    ap.add_argument("--verify", action="store_true", help="verifying loads (default: not)")
    ap.add_argument("--out", default="/tmp/probe_load_planning")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {f"w{i}": torch.randn(args.numel) for i in range(args.items)}
    if rank == 0:
        shutil.rmtree(args.out, ignore_errors=True)
    dist.barrier()
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(state, rank, world), args.out, iteration=1)
    local = load_metadata.planned_on_each_rank

    def exchanged(*, every_size: bool = False):  # the arm with DCP's collectives
        return local(every_size=False)

    times: dict[str, list[float]] = {"local": [], "exchanged": []}
    for rep in range(args.repeats):
        for arm in ("local", "exchanged") if rep % 2 == 0 else ("exchanged", "local"):
            load_reader.planned_on_each_rank = local if arm == "local" else exchanged
            like = sharded({k: torch.zeros_like(v) for k, v in state.items()}, rank, world)
            with Checkpointer(CkptOptions(ckpt_verify_load=args.verify)) as ck:
                dist.barrier()
                t = time.perf_counter()
                ck.load(like, args.out)
                took = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[arm].append(round(took.item(), 4))
    load_reader.planned_on_each_rank = local
    if rank == 0:
        for arm, seconds in times.items():
            print(f"{arm}: median {statistics.median(seconds):.3f} s, all {seconds}", flush=True)
        shutil.rmtree(args.out, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
