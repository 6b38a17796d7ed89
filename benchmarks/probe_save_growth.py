"""How a persistent writer's save changes host memory over many saves: one rank (gloo), a state of
``--tensors`` CPU tensors, async persistent cpu-shm saves under a constant structure, each
finalized before the next; after every ``--every`` saves, the Pss_Anon of the trainer and of its
persistent writer (forked children) beyond their figures after the first save. A flat line is
the goal: growth per save times the saves of a long run is what a node loses.

    python benchmarks/probe_save_growth.py --saves 40 --tensors 400 --json out.json

Found with it (docs/notes/save_path.md, twelfth session): the trainer kept every replayed save's
writer through a cache keyed by bound methods, and on nvrx 0.4 the writer never collected its
cyclic garbage (its loop turns the collector off)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _bench_modes as bm  # noqa: E402
from megatron_ckpt_ext import Checkpointer, CkptOptions, backend  # noqa: E402


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--saves", type=int, default=40)
    p.add_argument("--tensors", type=int, default=400)
    p.add_argument("--numel", type=int, default=4096, help="elements per tensor (fp32)")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--root", default=None, help="checkpoint folder (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 500}",
                                rank=0, world_size=1)
    st = backend.sharded_tensor_cls()
    tensors = [torch.randn(args.numel) for _ in range(args.tensors)]
    root = args.root or tempfile.mkdtemp(prefix="mcx_growth_")
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          use_persistent_ckpt_worker=True, ckpt_assume_constant_structure=True)
    rows, base = [], None
    started = time.perf_counter()
    with Checkpointer(options, save_dir=root) as ck:
        for i in range(1, args.saves + 1):
            state = {f"t{k}": st.from_rank_offsets(f"t{k}", t, replica_id=0)
                     for k, t in enumerate(tensors)}
            ck.save(state, root, iteration=i)
            ck.maybe_finalize(blocking=True)
            mine = os.getpid()
            now = {"trainer": bm.smaps_rollup(mine).get("Pss_Anon", 0),
                   "writer": sum(bm.smaps_rollup(q).get("Pss_Anon", 0)
                                 for q in bm._process_tree(mine) if q != mine)}
            base = base or now
            if i == 1 or i % args.every == 0:
                rows.append({"save": i, **{k: now[k] - base[k] for k in now}})
                print(f"save {i}: trainer {rows[-1]['trainer'] / 1e6:+.2f} MB, "
                      f"writer {rows[-1]['writer'] / 1e6:+.2f} MB", flush=True)
    last, half = rows[-1], rows[len(rows) // 2]
    span = max(1, last["save"] - half["save"])
    caps = backend.detect()
    versions = {"torch": torch.__version__, "megatron-core": caps.mcore_version,
                "nvidia-resiliency-ext": caps.nvrx_version}
    result = {"command": " ".join(sys.argv), "versions": versions, "tensors": args.tensors, "numel": args.numel, "rows": rows,
              "per_save_bytes_second_half": {k: round((last[k] - half[k]) / span)
                                             for k in ("trainer", "writer")},
              "wall_s": round(time.perf_counter() - started, 2)}
    print("growth per save over the second half (bytes):", result["per_save_bytes_second_half"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
