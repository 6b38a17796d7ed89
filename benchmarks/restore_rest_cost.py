"""What a restore from memory spends on the rest of the state: megatron-core's load of the
common state and the ShardedObjects from storage (``load/memory.py: _load_rest_and_fill``),
with ``.metadata`` unpickled once for the load's readers (``backend.metadata_read_once``, the
default) and once per reader (megatron-core's own way), alternated in one process, on the
134M-shaped state of ``plan_cost.py`` (``--layers 8``: 400 tensors).

    python benchmarks/restore_rest_cost.py [--repeats 12] [--json OUT]   (or torchrun, 1 rank)

On megatron-core 0.19 the common state is loaded apart from the ShardedObjects, so its load
builds two readers; on 0.16 it reads ``common.pt`` and the variants do the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from benchmarks._bench_modes import single_process_env  # noqa: E402
from megatron_ckpt_ext import Checkpointer, CkptOptions, backend  # noqa: E402
from megatron_ckpt_ext.load import memory  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    single_process_env()
    dist.init_process_group("gloo")
    from plan_cost import GptState

    state = GptState(args.layers, args.hidden, "cpu")
    root = Path(tempfile.mkdtemp()) / "ckpt"
    options = CkptOptions(async_save=True, use_persistent_ckpt_worker=True,
                          async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True)
    with Checkpointer(options) as ck:
        ck.save(state.sharded_state_dict(1), root, iteration=1)
        ck.maybe_finalize(blocking=True)
    path = root / "iter_0000001"
    once = backend.metadata_read_once
    variants = {"one_metadata_read": once, "a_read_per_reader": contextlib.nullcontext}
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for _ in range(args.repeats):
            for name, context in variants.items():
                backend.metadata_read_once = context
                t = time.perf_counter()
                memory._load_rest_and_fill(state.sharded_state_dict(0), path, lambda: None)
                seconds[name].append(time.perf_counter() - t)
    finally:
        backend.metadata_read_once = once
    caps = backend.detect()
    med = {k: statistics.median(v[2:] or v) for k, v in seconds.items()}  # the first two warm up
    result = {"command": "python benchmarks/restore_rest_cost.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "versions": {"megatron-core": caps.mcore_version, "nvrx": caps.nvrx_version},
              "median_s": {k: round(v, 5) for k, v in med.items()},
              "ratio": round(med["one_metadata_read"] / med["a_read_per_reader"], 3),
              "seconds": {k: [round(x, 5) for x in v] for k, v in seconds.items()}}
    dist.destroy_process_group()
    print(json.dumps({k: result[k] for k in ("versions", "median_s", "ratio")}))
    if args.json:  # (one rank)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
