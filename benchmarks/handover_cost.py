"""What handing a save to the persistent writer costs the trainer's process: every pickling
done by multiprocessing (``ForkingPickler.dumps``: the writer queue's feeder thread pickles each
request, its staged tensors' shared-memory handles included), per save, by thread, with the
pickle's size, next to the save's blocking time. The feeder runs beside the save's last steps
and the training step after it, holding the GIL while it pickles.

    python benchmarks/handover_cost.py [--saves 6] [--json OUT]     (or under torchrun, one rank)

Each save also says how many of its long lists (write items, staged tensors) were pickled in
full and how many went by a key the writer knows (``kept``: ``save/handover.py``; none with
``MCX_RESEND_EACH_SAVE=1``); ``made_ahead``: how many ``prepare()`` pickled for the first save
(which then sends them by key).

The state is ``plan_cost.py``'s GPT-shaped one (``--layers 8``: 400 tensors, the 134M recipe's
count); cpu-shm staging, persistent worker, constant structure, as the launcher's recipe.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing.reduction as reduction
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_seconds: dict[str, float] = collections.defaultdict(float)
_bytes: dict[str, int] = collections.defaultdict(int)
_calls: collections.Counter = collections.Counter()


def _count_pickling() -> None:
    real = reduction.ForkingPickler.dumps.__func__

    def dumps(cls, obj, protocol=None):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = real(cls, obj, protocol)
        name = threading.current_thread().name
        _seconds[name] += time.perf_counter() - t
        _bytes[name] += len(out)
        _calls[name] += 1
        return out

    reduction.ForkingPickler.dumps = classmethod(dumps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    _count_pickling()
    import torch.distributed as dist

    from megatron_ckpt_ext import Checkpointer, CkptOptions
    from megatron_ckpt_ext.save import handover
    from plan_cost import GptState

    if not dist.is_initialized():  # under torchrun or as a plain script (a world of one)
        from _bench_node import _single_process_env

        _single_process_env()
        dist.init_process_group("gloo")
    state = GptState(args.layers, args.hidden, "cpu")
    options = CkptOptions(async_save=True, use_persistent_ckpt_worker=True,
                          async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True)
    root = tempfile.mkdtemp(prefix="handover_cost_")
    saves = []
    with Checkpointer(options, save_dir=root) as ck:
        made = handover.stats["made_ahead"]
        ck.prepare(state.sharded_state_dict(0))
        ck.wait_prepared(120)
        made = handover.stats["made_ahead"] - made
        print(json.dumps({"made_ahead": made}), flush=True)
        for s in range(1, args.saves + 1):
            _seconds.clear(), _bytes.clear(), _calls.clear()
            before = dict(handover.stats)
            state.step()
            ck.save(state.sharded_state_dict(s), root, iteration=s)
            ck.maybe_finalize(blocking=True)
            saves.append({"iteration": s, "blocking_s": ck.reports[-1]["blocking_s"],
                          "pickling": {k: {"calls": _calls[k], "ms": round(v * 1e3, 2),
                                           "bytes": _bytes[k]} for k, v in _seconds.items()},
                          # lists the writer keeps (save/handover.py): pickled in full / by key
                          "kept": {k: handover.stats[k] - before[k]
                                   for k in ("sent_whole", "sent_known")}})
            print(json.dumps(saves[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "made_ahead": made,
                                               "saves": saves}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
