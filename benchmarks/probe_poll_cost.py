"""What the launcher's per-iteration call costs a training step: Megatron-LM calls
``maybe_finalize_async_save(blocking=False)`` once per iteration, which the launcher serves with
``Checkpointer.maybe_finalize(blocking=False)``. Idle (nothing pending) it should cost nothing;
while a save's write is pending it asks the writer's state and agrees with the other ranks (a
collective). This probe times CALLS such calls in each state, cpu-shm staging with the persistent
worker as the launcher's recipe, on ``plan_cost.py``'s GPT-shaped state (``--hidden`` sets its
size, so the write lasts long enough to be polled).

    python benchmarks/probe_poll_cost.py --hidden 1024 --calls 2000 --json out.json

Prints one JSON object: per state (``idle``; ``pending``, the write still running; ``commit``,
the call that found it done and committed it) the calls timed and their median, 99th
percentile and largest time in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from megatron_ckpt_ext import Checkpointer, CkptOptions  # noqa: E402
from plan_cost import GptState, process_group  # noqa: E402


def _figures(times: list[float]) -> dict:
    if not times:
        return {"calls": 0}
    us = sorted(t * 1e6 for t in times)
    return {"calls": len(us), "median_us": round(statistics.median(us), 1),
            "p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 1),
            "max_us": round(us[-1], 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    process_group(29571)
    state = GptState(args.layers, args.hidden, "cpu")
    options = CkptOptions(async_save=True, use_persistent_ckpt_worker=True,
                          async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True,
                          dist_ckpt_workers=1)
    root = tempfile.mkdtemp(prefix="probe_poll_")
    idle, pending, commits, state_bytes = [], [], [], 0
    with Checkpointer(options, save_dir=root) as ck:
        for iteration in (1, 2):  # the second is a steady save: what a run polls after
            ck.save(state.sharded_state_dict(0), root, iteration=iteration)
            state_bytes = ck.staging_stats().get("bytes_staged", 0) // iteration
            while not ck.idle:  # the write pending: poll as Megatron's loop does
                t0 = time.perf_counter()
                committed = ck.maybe_finalize(blocking=False)
                (commits if committed else pending).append(time.perf_counter() - t0)
                time.sleep(0.001)
        ck.maybe_finalize(blocking=True)
        for _ in range(args.calls):
            t0 = time.perf_counter()
            ck.maybe_finalize(blocking=False)
            idle.append(time.perf_counter() - t0)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    out = {"state_bytes": state_bytes, "cores": os.cpu_count(),
           "command": "benchmarks/probe_poll_cost.py " + " ".join(sys.argv[1:]),
           "idle": _figures(idle), "pending": _figures(pending), "commit": _figures(commits)}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
