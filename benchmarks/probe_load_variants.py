"""Where a one-rank warm load loses to the host's own read-and-copy loop: the load's reading
threads, host chunk size and copies left in flight varied in one process, against the loop of
``bench_load.read_h2d_s`` with the same threads and piece sizes, on the same saved state.

    torchrun --nproc-per-node 1 benchmarks/probe_load_variants.py --gib 8 --json OUT.json

Each variant (``T<threads>_C<chunk MiB>_F<in flight>``) is a block of loads (one not timed: its
host chunks are pinned by it), ours verifying and not, ``--repeats`` each, alternated; the blocks
run twice, the second time in reverse order (drift shows as a difference between the two).
Every load is checked bit-exact; each records ``read_detail`` (how long its read step waited for
the sums, how long the device's summing thread worked). The JSON holds each load's seconds and phases and, per variant,
the medians. A probe, not a benchmark of record: its defaults come from
``benchmarks/bench_load.py`` (which it imports)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_load  # noqa: E402
from megatron_ckpt_ext.backend import direct_read, read_copies  # noqa: E402

_MIB = 1 << 20


def _variant(name: str) -> tuple[int, int, int, float]:
    """``T<threads>_C<chunk MiB>_F<in flight>[_S<us>]``: ``S`` sets the interpreter's switch
    interval (``sys.setswitchinterval``, default 5000 us) for the variant's loads; any other
    part is refused (the ``_M`` variants measured host sums of small chunks, taken out after
    the twentieth session's A/B: docs/benchmarks/README.md)."""
    t, c, f, *rest = name.split("_")
    extra = {part[0]: int(part[1:]) for part in rest}
    if set(extra) - {"S"}:
        raise SystemExit(f"variant {name}: unknown part(s) {sorted(set(extra) - {'S'})}")
    switch = extra["S"] * 1e-6 if "S" in extra else _SWITCH
    return int(t[1:]), int(c[1:]) * _MIB, int(f[1:]), switch


_SWITCH = sys.getswitchinterval()


def _apply(chunk: int, in_flight: int, switch: float) -> None:
    direct_read.DEFAULT_CHUNK = chunk
    read_copies.IN_FLIGHT = in_flight
    sys.setswitchinterval(switch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", nargs="+",
                   default=["T8_C32_F1", "T16_C32_F1", "T8_C64_F1", "T16_C64_F1", "T16_C64_F2"])
    p.add_argument("--loop-chunks", type=int, nargs="+", default=[32, 64],
                   help="piece sizes (MiB) of the host's own loop, each with 8 and 16 threads")
    p.add_argument("--out", default="/tmp/probe_load_variants")
    p.add_argument("--json", required=True)
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args(argv)
    args = bench_load.parse_args(["--gib", str(a.gib), "--out", a.out, "--json", a.json,
                                  "--caches", "warm"] + (["--cpu-smoke"] if a.cpu_smoke else []))
    bench = bench_load.LoadBench(args)
    files = bench_load._share(bench.checkpoint)
    bench_load.parallel_read_s(files, 16)  # in the page cache
    loops = {}
    for chunk_mib in a.loop_chunks:
        bench_load._CHUNK = chunk_mib * _MIB
        for threads in (8, 16):
            seconds = [bench_load.read_h2d_s(files, threads, bench.device) for _ in range(3)]
            loops[f"T{threads}_C{chunk_mib}"] = [round(s, 4) for s in seconds]
            print(f"loop T{threads} C{chunk_mib}: {loops[f'T{threads}_C{chunk_mib}']}", flush=True)
    loads: list[dict] = []
    order = a.variants + list(reversed(a.variants))
    for block, name in enumerate(order):
        threads, chunk, in_flight, switch = _variant(name)
        _apply(chunk, in_flight, switch)
        bench_load.load_ours(bench.root, bench.state, False, threads)  # pins this size's chunks
        for rep in range(a.repeats):
            for verify in (True, False):
                bench_load.parallel_read_s(files, 16)
                seconds, exact, report = bench_load.load_ours(bench.root, bench.state, verify,
                                                              threads)
                if not exact:
                    raise SystemExit(f"{name}: a load was not bit-exact")
                loads.append({"variant": name, "block": block, "verify": verify,
                              "load_s": round(seconds, 4),
                              "applied": {"chunk_mib": direct_read.DEFAULT_CHUNK // _MIB,
                                          "in_flight": read_copies.IN_FLIGHT,
                                          "switch_us": round(sys.getswitchinterval() * 1e6)},
                              "device_summed_bytes": report.get("device_summed_bytes", 0),
                              "read_detail": report.get("read_detail", {}),
                              "direct_items": report.get("direct_items"),
                              "phases": {k: round(v, 4) for k, v in
                                         report.get("phases", {}).items()}})
                print(name, "verify" if verify else "plain", round(seconds, 4),
                      loads[-1]["phases"], loads[-1]["read_detail"], flush=True)
    summary = {}
    for name in a.variants:
        for verify in (True, False):
            got = [x["load_s"] for x in loads if x["variant"] == name and x["verify"] == verify]
            summary[f"{name}_{'verify' if verify else 'plain'}"] = {
                "median_s": round(statistics.median(got), 4), "min_s": min(got),
                "max_s": max(got), "gbps_median": round(bench.on_disk / statistics.median(got)
                                                        / 1e9, 2)}
    out = {"command": " ".join(["torchrun --nproc-per-node 1 benchmarks/probe_load_variants.py"]
                               + (argv if argv is not None else sys.argv[1:])),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "bytes_on_disk": bench.on_disk, "host_loops_s": loops, "loads": loads,
           "summary": summary}
    sys.setswitchinterval(_SWITCH)
    Path(a.json).write_text(json.dumps(out, indent=1))
    for k, v in summary.items():
        print(k, v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
