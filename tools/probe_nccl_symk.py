"""Does this machine's NCCL run its symmetric-memory kernels (``ncclSymk*``) at all?

A minimal probe without Megatron-FSDP, to tell an environment limit from a wrapper problem
(docs/FSDP.md): on each rank, buffers from PyTorch's NCCL symmetric-memory pool, registered with
``symm_mem.rendezvous``, then ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (SUM) of a
few sizes, profiled; prints and writes the CUDA kernel names per size, and whether any contains
``Symk``. The same with plain (unregistered) buffers as the contrast.

    torchrun --nproc-per-node 2 tools/probe_nccl_symk.py --out $OUT

It keeps the environment the FSDP check requires (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``) unless ``--allow-env`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for nccl_symk_probe.json")
    p.add_argument("--mib", type=float, nargs="+", default=[0.25, 1, 4, 16, 64],
                   help="per-rank input sizes (MiB, bf16)")
    p.add_argument("--allow-env", action="store_true", help="keep the caller's NCCL env as is")
    p.add_argument("--inplace", action="store_true",
                   help="in-place collectives, as Megatron-FSDP runs them (the shard is a view "
                        "of the full buffer, at a different offset on each rank)")
    p.add_argument("--subgroup", action="store_true",
                   help="run on a new_group of all ranks (as a DeviceMesh does), not WORLD")
    p.add_argument("--register", choices=("all", "fsdp"), default="all",
                   help="fsdp: register only what Megatron-FSDP 0.19.2 rendezvouses (the "
                        "all-gather output and the reduce-scatter input), not the other side")
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    args = p.parse_args()
    if not args.allow_env:
        for key, value in REQUIRED_ENV.items():
            os.environ.setdefault(key, value)

    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    from torch.profiler import ProfilerActivity, profile

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.new_group(list(range(world))) if args.subgroup else dist.group.WORLD
    dist.barrier(group=group)
    symm_mem.set_backend("NCCL")
    pool = symm_mem.get_mem_pool(device)

    def kernels(fn) -> list[str]:
        fn()  # warm-up (communicator, registration)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if "nccl" in e.name.lower()})

    results = []
    for mib in args.mib:
        n = int(mib * 2**20 / 2)
        row = {"mib_per_rank": mib}
        for registered in (False, True):
            if registered:
                with torch.cuda.use_mem_pool(pool):
                    ag_out = torch.empty(n * world, dtype=torch.bfloat16, device=device)
                    rs_in = torch.empty(n * world, dtype=torch.bfloat16, device=device)
                    if args.register == "all":
                        ag_in = torch.empty(n, dtype=torch.bfloat16, device=device)
                        rs_out = torch.empty(n, dtype=torch.bfloat16, device=device)
                if args.register == "fsdp":
                    ag_in = torch.empty(n, dtype=torch.bfloat16, device=device)
                    rs_out = torch.empty(n, dtype=torch.bfloat16, device=device)
                mine = ((ag_out, rs_in) if args.inplace or args.register == "fsdp"
                        else (ag_out, ag_in, rs_in, rs_out))
                for t in mine:
                    symm_mem.rendezvous(t, group=group.group_name)
            else:
                ag_out = torch.empty(n * world, dtype=torch.bfloat16, device=device)
                ag_in = torch.empty(n, dtype=torch.bfloat16, device=device)
                rs_in = torch.empty(n * world, dtype=torch.bfloat16, device=device)
                rs_out = torch.empty(n, dtype=torch.bfloat16, device=device)
            if args.inplace:
                ag_in = ag_out[rank * n:(rank + 1) * n]
                rs_out = rs_in[rank * n:(rank + 1) * n]
            ag_in.fill_(rank + 1)
            rs_in.fill_(1)
            key = "registered" if registered else "plain"
            row[f"all_gather_{key}"] = kernels(
                lambda: dist.all_gather_into_tensor(ag_out, ag_in, group=group))
            row[f"reduce_scatter_{key}"] = kernels(
                lambda: dist.reduce_scatter_tensor(rs_out, rs_in, op=dist.ReduceOp.SUM,
                                                   group=group))
            assert float(ag_out[-1]) == world, "all-gather result"
        row["symk_when_registered"] = any("symk" in k.lower() for k in
                                          row["all_gather_registered"] +
                                          row["reduce_scatter_registered"])
        results.append(row)
        if rank == 0:
            print(f"{mib:7.2f} MiB  symk={row['symk_when_registered']}  "
                  f"AG reg {row['all_gather_registered']}  RS reg {row['reduce_scatter_registered']}"
                  f"  | AG plain {row['all_gather_plain']}", flush=True)
    if rank == 0 and args.out:
        info = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "device": torch.cuda.get_device_name(device), "world": world,
                "env": {k: os.environ.get(k) for k in (*REQUIRED_ENV, "NCCL_WIN_ENABLE",
                                                        "NCCL_CUMEM_ENABLE")},
                "inplace": args.inplace, "subgroup": args.subgroup, "register": args.register, "results": results}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"nccl_symk_probe{args.tag}.json").write_text(json.dumps(info, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
