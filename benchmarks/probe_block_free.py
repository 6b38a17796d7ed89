"""Probe (one GPU): what freeing the restore's copy-ahead block costs, and whom it holds up.
In the thirtieth session's restarts the block's free cost the load ~7 ms per GB wherever it
ran (in line, or on a thread while the load's next CUDA calls waited; docs/MEMORY.md), where
the session before had 0.8 ms for 1.88 GB. For each size and kind (an ordinary block freed by
the caching allocator's ``empty_cache``, a managed block of ``load/managed_block.py``), it times:

- ``inline_s``: the free on the main thread, the device idle;
- ``beside``: a main-thread loop of small launches, each synchronised, while a thread frees
  the block: its longest iteration (``max_ms``: what the free held the launches up) and its
  iterations' total beyond the same count alone (``extra_s``);
- ``paced``: the same while a thread frees the block in ``--piece-mib`` pieces (each its own
  allocation), ``--pace-ms`` apart.

    python benchmarks/probe_block_free.py --gib 2 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from megatron_ckpt_ext.load.managed_block import managed_block


def _blocks(kind: str, nbytes: int, piece: int) -> list[torch.Tensor]:
    sizes = [min(piece, nbytes - at) for at in range(0, nbytes, piece)]
    if kind == "ordinary":
        out = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    else:
        out = [managed_block(n, torch.device("cuda", torch.cuda.current_device())) for n in sizes]
        if any(b is None for b in out):
            raise SystemExit("no managed memory on this device")
    for b in out:
        b.fill_(1)
    torch.cuda.synchronize()
    return out


def _free(kind: str, holder: list, pace_s: float = 0.0) -> None:
    while holder:
        holder.pop()
        if kind == "ordinary":
            torch.cuda.empty_cache()
        if pace_s:
            time.sleep(pace_s)


def _loop(launches: int, beside: threading.Thread | None = None) -> list[float]:
    """Each iteration's seconds: ``launches`` of them, or until ``beside`` has ended."""
    x, took = torch.ones(1024, device="cuda"), []
    while len(took) < launches or (beside is not None and beside.is_alive()):
        t = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - t)
    return took


def _beside(kind: str, holder: list, alone: list[float], pace_s: float = 0.0) -> dict:
    thread = threading.Thread(target=_free, args=(kind, holder, pace_s))
    t = time.perf_counter()
    thread.start()
    took = _loop(len(alone), thread)
    thread.join()
    typical = sorted(alone)[len(alone) // 2]
    return {"free_s": round(time.perf_counter() - t, 4), "max_ms": round(max(took) * 1e3, 3),
            "extra_s": round(sum(took) - typical * len(took), 4), "iterations": len(took)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, nargs="+", default=[2.0, 12.0])
    p.add_argument("--kinds", nargs="+", default=["ordinary", "managed"])
    p.add_argument("--launches", type=int, default=2000)
    p.add_argument("--piece-mib", type=int, default=256)
    p.add_argument("--pace-ms", type=float, default=5.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_block_free needs a CUDA device")
    rows = []
    _loop(args.launches)  # warm
    for gib in args.gib:
        nbytes = int(gib * (1 << 30))
        for kind in args.kinds:
            alone = _loop(args.launches)
            row = {"gib": gib, "kind": kind, "alone_max_ms": round(max(alone) * 1e3, 3)}
            holder = _blocks(kind, nbytes, nbytes)
            t = time.perf_counter()
            _free(kind, holder)
            torch.cuda.synchronize()
            row["inline_s"] = round(time.perf_counter() - t, 4)
            row["beside"] = _beside(kind, _blocks(kind, nbytes, nbytes), alone)
            pieces = _blocks(kind, nbytes, args.piece_mib << 20)
            row["pieces"] = len(pieces)
            row["paced"] = _beside(kind, pieces, alone, args.pace_ms / 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "launches": args.launches, "piece_mib": args.piece_mib, "pace_ms": args.pace_ms,
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
