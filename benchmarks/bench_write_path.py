"""What one checkpoint writer stream costs per byte: raw writes vs torch.save records, CRC on/off.

The torch_dist format writes every tensor as a ``torch.save`` zip record into a bucket file, then
fsyncs the file (torch DCP ``_write_item``, nvrx's ``_write_bucket_to_storage``). This measures,
on one thread and the same target directory, for the same tensors:

* ``raw``: ``file.write(memoryview(tensor))`` per tensor, then fsync (the benchmark's write floor);
* ``torch_save_crc``: ``torch.save(tensor, file)`` per tensor, then fsync (torch's default);
* ``torch_save_no_crc``: the same with ``torch.serialization.set_crc32_options(False)`` (what our
  writer does, ``save.write_path.crc_free``).

``--streams N`` (N > 1) adds ``raw_xN``: the same tensors split over N threads, each writing and
fsyncing its own file (does this disk go faster with more writer streams?).

``--page-cache-probe`` then writes ``--rounds`` raw files twice: ``kept`` keeps every file (as
checkpoints accumulate, so each round writes into page-cache pages the host never used before),
``dropped`` keeps them too but drops each one's pages once fsync'd (what our writer does,
``save.write_path.page_cache_free``). On a VM that backs guest memory on first touch the first
is much slower; deleting each file at once, as the variants above do, hides it.

Variants alternate over ``--rounds`` so drifting disk speed hits all of them; each figure is
bytes / (write + fsync) seconds. ``--sink memory`` writes into a BytesIO instead (serialisation
cost alone). Prints a table and writes JSON (``--json``).

    python benchmarks/bench_write_path.py --dir /tmp/wp --gib 2 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_modes import time_threads  # noqa: E402

VARIANTS = ("raw", "torch_save_crc", "torch_save_no_crc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/mcx_write_path", help="target directory (removed after)")
    p.add_argument("--gib", type=float, default=2.0, help="bytes written per variant and round")
    p.add_argument("--tensor-mib", type=float, default=64.0, help="size of each tensor")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sink", choices=("file", "memory"), default="file")
    p.add_argument("--streams", type=int, default=1, help="also raw writes over N threads")
    p.add_argument("--page-cache-probe", action="store_true",
                   help="also: files kept vs kept with their pages dropped")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def make_tensors(gib: float, tensor_mib: float) -> list[torch.Tensor]:
    n = max(1, int(gib * 1024 / tensor_mib))
    numel = int(tensor_mib * 2**20) // 4
    g = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=g) for _ in range(n)]  # random: never zeros


def write_streams(tensors: list[torch.Tensor], target: Path, streams: int) -> float:
    """Raw writes of ``tensors`` split over ``streams`` threads, a file (fsync'd) each."""
    def one(i: int) -> None:
        path = target.with_suffix(f".{i}")
        try:
            with open(path, "wb") as f:
                for t in tensors[i::streams]:
                    f.write(memoryview(t.numpy()).cast("B"))
                f.flush()
                os.fsync(f.fileno())
        finally:
            path.unlink(missing_ok=True)

    return time_threads(one, streams)


def page_cache_probe(tensors: list[torch.Tensor], target_dir: Path, rounds: int) -> dict:
    """Seconds per round of raw fsync'd writes into new files that are kept, then the same with
    each file's pages dropped after its fsync (files kept too); all removed at the end."""
    out: dict[str, list[float]] = {"kept": [], "dropped": []}
    for how in out:
        paths = []
        for r in range(rounds):
            path = target_dir / f"probe_{how}_{r}.bin"
            paths.append(path)
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                _write_all("raw", tensors, f)
                f.flush()
                os.fsync(f.fileno())
                if how == "dropped":
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            out[how].append(time.perf_counter() - t0)
            print(f"page-cache probe {how:8s} round {r + 1}/{rounds} {out[how][-1]:7.3f} s",
                  flush=True)
        for path in paths:
            path.unlink()
    return out


def write_once(variant: str, tensors: list[torch.Tensor], target: Path, sink: str) -> float:
    if variant.startswith("raw_x"):
        return write_streams(tensors, target, int(variant[len("raw_x"):]))
    crc_before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(variant != "torch_save_no_crc")
    try:
        t0 = time.perf_counter()
        if sink == "memory":
            stream: io.IOBase = io.BytesIO()
            _write_all(variant, tensors, stream)
            return time.perf_counter() - t0
        with open(target, "wb") as f:
            _write_all(variant, tensors, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0
    finally:
        torch.serialization.set_crc32_options(crc_before)
        if target.exists():
            target.unlink()


def _write_all(variant: str, tensors: list[torch.Tensor], stream: io.IOBase) -> None:
    for t in tensors:
        if variant == "raw":
            stream.write(memoryview(t.numpy()).cast("B"))
        else:
            torch.save(t, stream)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target_dir = Path(args.dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    tensors = make_tensors(args.gib, args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    variants = VARIANTS + ((f"raw_x{args.streams}",) if args.streams > 1 and args.sink == "file" else ())
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    probe: dict[str, list[float]] | None = None
    try:
        for r in range(args.rounds):
            for v in variants:
                s = write_once(v, tensors, target_dir / f"{v}.bin", args.sink)
                seconds[v].append(s)
                print(f"round {r + 1}/{args.rounds} {v:18s} {s:7.3f} s  "
                      f"{nbytes / s / 1e9:6.2f} GB/s", flush=True)
        if args.page_cache_probe and args.sink == "file":
            probe = page_cache_probe(tensors, target_dir, max(args.rounds, 3))
    finally:
        shutil.rmtree(target_dir, ignore_errors=True)
    summary = {v: {"median_s": statistics.median(s),
                   "median_gbps": nbytes / statistics.median(s) / 1e9, "seconds": s}
               for v, s in seconds.items()}
    raw = summary["raw"]["median_s"]
    for v in variants:
        summary[v]["over_raw"] = summary[v]["median_s"] / raw
    result = {"schema": "megatron-ckpt-ext/write-path/1", "host": platform.node(),
              "torch": torch.__version__, "sink": args.sink, "dir": str(target_dir),
              "bytes": nbytes, "tensors": len(tensors), "rounds": args.rounds, "variants": summary}
    if probe is not None:  # later rounds: the first of "dropped" has no freed pages to reuse yet
        result["page_cache_probe"] = {
            how: {"seconds": s, "gbps": [round(nbytes / x / 1e9, 3) for x in s],
                  "median_gbps_after_first": round(nbytes / statistics.median(s[1:]) / 1e9, 3)}
            for how, s in probe.items()}
    print(f"\n{nbytes / 1e9:.2f} GB in {len(tensors)} tensors, sink={args.sink}, median of "
          f"{args.rounds}:")
    if probe is not None:
        for how, rec in result["page_cache_probe"].items():
            print(f"  page cache {how:8s} {rec['median_gbps_after_first']:6.2f} GB/s "
                  f"(rounds 2+; all: {rec['gbps']})")
    for v in variants:
        print(f"  {v:18s} {summary[v]['median_gbps']:6.2f} GB/s  "
              f"{summary[v]['over_raw']:5.2f}x raw")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
