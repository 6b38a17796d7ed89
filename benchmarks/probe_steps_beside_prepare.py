#!/usr/bin/env python3
"""What preparing the first save's staging costs the training steps that run beside it.

Through the launcher, ``Checkpointer.prepare()`` runs after Megatron-LM's first training step
(a fresh run) or as a resume's load returns: on a background thread it allocates the staging in
/dev/shm (and pins it, with CUDA), then megatron-core plans the first save and the request is
pickled for the writer. On an H200 the steps beside it ran 2-4x slower (~1 s over the first
ten iterations at 134M: docs/MEGATRON_LM.md, thirty-second session). This probe separates what
the host side costs a stand-in step (``--ops`` small tensor operations on the main thread, each
releasing and taking back the interpreter's lock as torch's operations do, which is what a
launch-bound training step is made of; with ``--step-device cuda`` each is a kernel launch, and
the step ends with a synchronisation, so the driver's lock that pinning holds shows too): the
steps alone, then beside a
``prepare()`` of a GPT-shaped state (``benchmarks/plan_cost.py``'s, ``--layers``/``--hidden``),
each variant ``--repeats`` times, alternated:

  none       the steps alone
  prepare    beside ``prepare()`` (allocation, plan, hand-over), as the launcher runs it
  interval   the same with the interpreter's switch interval at ``--interval-ms`` meanwhile
  nopin      ``prepare()`` with the staging left unpinned (no ``cudaHostRegister``: what the
             driver's lock held by pinning costs the steps; a diagnosis, not a setting)
  unpopulated ``prepare()`` pinning pages not faulted in yet, as before the thirty-third
             session (``cudaHostRegister`` then faults them in inside the driver's lock; now
             ``MADV_POPULATE_WRITE`` faults them in first: staging/segments.py ``_register``)
  noplan     ``prepare()`` without the plan ahead (``MCX_PLAN_AHEAD=0``: what the planning's
             hold of the interpreter's lock costs the steps)
  populated  the pages faulted in, none pinned (what the fault-in alone costs the steps; tmpfs
             zeroes a page allocated by ``posix_fallocate`` only when it is first faulted in)
  prezeroed  ``prepare()`` with every segment written with zeros (``pwrite``, no mapping of
             this process touched) as it is allocated, so the fault-in only maps pages

Per variant: the median step time alone and while the preparation ran, their ratio, how long
the preparation took, and the stager's allocation and registration seconds. On one H200 at
1.87 GB (thirty-third session, docs/MEGATRON_LM.md): ``unpopulated`` 3.1-3.8x, ``nopin``
1.04-1.08x, ``noplan`` 3.8x, ``prepare`` (the pages faulted in first) 1.2-1.3x.

    python benchmarks/probe_steps_beside_prepare.py --json out.json
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ckpt_ext import Checkpointer, CkptOptions  # noqa: E402
from plan_cost import GptState, process_group  # noqa: E402

VARIANTS = ("none", "prepare", "interval", "nopin", "unpopulated", "noplan", "populated",
            "prezeroed")


def step(x: torch.Tensor, ops: int) -> torch.Tensor:
    """A launch-bound step's host side: many small operations, each through torch's dispatch
    (on a device: each a kernel launch, then one synchronisation)."""
    for _ in range(ops):
        x = x.mul(1.0001).add_(1e-4)
    if x.is_cuda:
        torch.cuda.synchronize()
    return x


def _patch(variant: str) -> Any:
    """What a diagnosis variant changes for its ``prepare()``; returns the undo."""
    from megatron_ckpt_ext.staging import shm

    if variant == "nopin":  # neither faulted in nor pinned
        register, fault_in = shm._register, shm._fault_in
        shm._register, shm._fault_in = (lambda tensor, nbytes, **_: False), (lambda _: False)
        return lambda: (setattr(shm, "_register", register), setattr(shm, "_fault_in", fault_in))
    if variant == "unpopulated":
        from megatron_ckpt_ext.staging import segments

        populate, segments.populate = segments.populate, lambda *a, **k: False
        return lambda: setattr(segments, "populate", populate)
    if variant == "populated":
        from megatron_ckpt_ext.staging import segments

        register = shm._register

        def fault_in_only(tensor: torch.Tensor, nbytes: int, *, faulted_in: bool = False) -> bool:
            if not faulted_in:  # (one core: _fault_in left it to the registration)
                segments.populate(tensor.data_ptr(), nbytes, write=True)
            return False

        shm._register = fault_in_only
        return lambda: setattr(shm, "_register", register)
    if variant == "prezeroed":
        made = shm._shared_segment

        def zeroed(path: str, nbytes: int, *, key: str) -> torch.UntypedStorage:
            storage = made(path, nbytes, key=key)
            fd, zeros, done = os.open(path, os.O_WRONLY), bytes(8 << 20), 0
            try:
                while done < nbytes:
                    done += os.pwrite(fd, memoryview(zeros)[:min(len(zeros), nbytes - done)],
                                      done)
            finally:
                os.close(fd)
            return storage

        shm._shared_segment = zeroed
        return lambda: setattr(shm, "_shared_segment", made)
    if variant == "noplan":
        old = os.environ.get("MCX_PLAN_AHEAD")
        os.environ["MCX_PLAN_AHEAD"] = "0"
        return lambda: (os.environ.pop("MCX_PLAN_AHEAD") if old is None
                        else os.environ.__setitem__("MCX_PLAN_AHEAD", old))
    return lambda: None


def run(variant: str, state: GptState, ops: int, steps_after: int, interval_ms: float,
        device: str) -> dict:
    options = CkptOptions(async_save=True, use_persistent_ckpt_worker=True,
                          async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True,
                          dist_ckpt_workers=1)
    x = torch.ones(64, device=device)
    root = tempfile.mkdtemp(prefix="probe_steps_")
    with Checkpointer(options, save_dir=root) as ck:
        alone = []
        for _ in range(10):
            t0 = time.perf_counter()
            x = step(x, ops)
            alone.append(time.perf_counter() - t0)
        beside, prepared_s = [], None
        if variant != "none":
            old, patched = sys.getswitchinterval(), _patch(variant)
            if variant == "interval":
                sys.setswitchinterval(interval_ms / 1000)
            try:
                t_prep = time.perf_counter()
                ck.prepare(state.sharded_state_dict(0))
                while prepared_s is None:
                    t0 = time.perf_counter()
                    x = step(x, ops)
                    beside.append(time.perf_counter() - t0)
                    if ck.wait_prepared(timeout_s=0):
                        prepared_s = time.perf_counter() - t_prep
            finally:
                sys.setswitchinterval(old)
                patched()
        stats = dict(getattr(ck._stager, "stats", {}))
        after = []
        for _ in range(steps_after):
            t0 = time.perf_counter()
            x = step(x, ops)
            after.append(time.perf_counter() - t0)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    med = lambda v: round(statistics.median(v), 6) if v else None  # noqa: E731
    out = {"variant": variant, "step_alone_s": med(alone), "step_beside_s": med(beside),
           "steps_beside": len(beside), "beside_total_s": round(sum(beside), 4),
           "step_after_s": med(after), "prepare_s": round(prepared_s, 4) if prepared_s else None,
           "register_s": round(stats.get("register_s", 0.0), 4),
           "allocate_s": round(stats.get("allocate_s", 0.0), 4)}
    if beside:
        out["beside_over_alone"] = round(out["step_beside_s"] / out["step_alone_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ops", type=int, default=400, help="operations a stand-in step makes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval-ms", type=float, default=0.5)
    p.add_argument("--step-device", choices=("cpu", "cuda"), default="cpu",
                   help="where the stand-in step's operations run (the state stays on the host)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    process_group(29563)
    state = GptState(args.layers, args.hidden, "cpu")
    state_bytes = sum(t.numel() * t.element_size() for v in (*state.model.values(),
                                                             *state.optim.values()) for _, t in v)
    rows = []
    for r in range(args.repeats):
        order = args.variants if r % 2 == 0 else list(reversed(args.variants))
        for variant in order:
            row = run(variant, state, args.ops, 5, args.interval_ms, args.step_device)
            row["repeat"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    summary = {}
    for variant in args.variants:
        got = [r for r in rows if r["variant"] == variant]
        summary[variant] = {k: statistics.median(r[k] for r in got if r.get(k) is not None)
                            for k in ("step_alone_s", "step_beside_s", "beside_over_alone",
                                      "prepare_s", "register_s", "allocate_s") if any(r.get(k) is not None for r in got)}
    result = {"state_bytes": state_bytes, "tensors": sum(len(v) for v in (
        *state.model.values(), *state.optim.values())), "ops": args.ops, "cores": os.cpu_count(),
        "step_device": args.step_device,
        "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows,
        "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
