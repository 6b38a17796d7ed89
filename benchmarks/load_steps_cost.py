"""What a storage load's host-side steps cost, on any machine (CPU tensors, one rank): the 8 GiB
benchmark's state (``bench_load.py --gib 8``: 492 items) at 1/4096 of its bytes, saved once,
then LOADS loads, each after ``prepare_restore`` and a pause (a model build); prints one JSON
line with the medians of the load and of its report's ``metadata_s``, ``read_s``, ``other_s``.
An A/B of two trees: run it under each, PYTHONPATH=<tree> (the benchmarks are taken from
this checkout).

    PYTHONPATH=<tree> python benchmarks/load_steps_cost.py --label new --loads 10
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/, after PYTHONPATH's tree

from benchmarks._bench_modes import gpt_shape, sharded  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="")
    p.add_argument("--loads", type=int, default=10)
    p.add_argument("--pause-s", type=float, default=0.3)
    p.add_argument("--port", type=int, default=29631)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=0,
                            world_size=1)
    import megatron_ckpt_ext
    from megatron_ckpt_ext import Checkpointer, CkptOptions

    state: dict[str, torch.Tensor] = {}
    for name, local in gpt_shape(8 * 2**30).weights():
        small = (max(1, math.prod(local) // 4096),)
        state[f"model.{name}"] = torch.randn(small).to(torch.bfloat16)
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq"):
            state[f"optimizer.{kind}.{name}"] = torch.randn(small)
    root = Path(tempfile.mkdtemp(prefix="mcx_load_steps_"))
    try:
        with Checkpointer(CkptOptions()) as ck:
            ck.save(sharded(state, 0, 1), root, iteration=1)
        rows = []
        for _ in range(a.loads):
            like = {k: torch.empty_like(v) for k, v in state.items()}
            with Checkpointer(CkptOptions()) as ck:
                ck.prepare_restore(root)
                time.sleep(a.pause_s)
                t = time.perf_counter()
                ck.load(sharded(like, 0, 1), root)
                rows.append((time.perf_counter() - t, ck.load_reports[-1]["phases"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    med = statistics.median
    print(json.dumps({"label": a.label, "package": os.path.dirname(megatron_ckpt_ext.__file__),
                      "items": len(state), "loads": a.loads,
                      "load_s": round(med(r[0] for r in rows), 4),
                      **{k: round(med(r[1][k] for r in rows), 4)
                         for k in ("metadata_s", "read_s", "other_s")}}))


if __name__ == "__main__":
    main()
