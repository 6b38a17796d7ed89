"""A process's first save against its later ones: time to durable, and where the writer thread's
time went, one rank on CPU (async saves, cpu-shm staging, the persistent writer, constant
structure; ``--tensors`` tensors of 16 MiB, ``--saves`` saves ``--gap-s`` apart). With
``MCX_WRITER_TRACE=<dir>`` set it also prints each write's seconds, CPU and system seconds and
minor page faults from the trace (docs/DEBUGGING.md). The checkpoint root is removed at the end.

    MCX_WRITER_TRACE=/tmp/wt python benchmarks/probe_first_write.py --tensors 48
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=48)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--gap-s", type=float, default=1.0)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29633")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron_ckpt_ext import Checkpointer, CkptOptions, backend

    st = backend.sharded_tensor_cls()
    state = {f"w{i}": st.from_rank_offsets(f"w{i}", torch.randn(4 << 20), replica_id=0)
             for i in range(args.tensors)}
    root = Path(tempfile.mkdtemp(prefix="mcx_first_write_"))
    opts = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                       use_persistent_ckpt_worker=True, ckpt_assume_constant_structure=True)
    try:
        with Checkpointer(opts) as ck:
            for it in range(1, args.saves + 1):
                ck.save(state, root, iteration=it)
                ck.maybe_finalize(blocking=True)
                time.sleep(args.gap_s)
        for line in (root / "ckpt_report.jsonl").read_text().splitlines():
            r = json.loads(line)
            print(f"save {r['iteration']}: blocking {r['blocking_s']:.3f} s, durable "
                  f"{r['durable_s']:.3f} s ({r['write_gbps']} GB/s)")
        trace = os.environ.get("MCX_WRITER_TRACE")
        if trace and (Path(trace) / "writer_trace.jsonl").exists():
            for line in (Path(trace) / "writer_trace.jsonl").read_text().splitlines():
                w = json.loads(line)
                if w["what"] == "write":
                    print(f"write: {w['s']:.3f} s, cpu {w.get('cpu_s')} s, sys "
                          f"{w.get('sys_s')} s, minor faults {w.get('minflt')}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
