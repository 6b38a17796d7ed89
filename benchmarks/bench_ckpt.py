#!/usr/bin/env python3
"""Checkpoint benchmark: training stall and time-to-durable of stock megatron-core/nvrx, torch DCP
and megatron-ckpt-ext, side by side in one invocation (docs/benchmarks/README.md).

One process per rank via torchrun:

    torchrun --nproc-per-node 1 benchmarks/bench_ckpt.py --gib-per-rank 8 4 2 --out /tmp/bench \\
        --json docs/benchmarks/h100.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ckpt.py --cpu-smoke --out /tmp/bs
    torchrun --nproc-per-node 8 benchmarks/bench_ckpt.py --ranks-per-device auto ...  # a node
    python benchmarks/bench_ckpt.py --merge a.json b.json --json all.json   # split GPU runs
    python benchmarks/bench_ckpt.py --plot docs/benchmarks/h100.json        # needs matplotlib
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_modes as bm  # noqa: E402
import _bench_node as node  # noqa: E402

from megatron_ckpt_ext import _crc  # noqa: E402
from megatron_ckpt_ext import _cpu_shim, backend  # noqa: E402
from megatron_ckpt_ext._threads import thread_counts  # noqa: E402

log = logging.getLogger("bench_ckpt")
GIB = 1 << 30
SCHEMA = "megatron-ckpt-ext/bench/1"


# -- arguments -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    node.add_ranks_per_device(p)
    p.add_argument("--gib-per-rank", type=node.positive(float), nargs="+", default=[8.0],
                   help="state sizes per rank in GiB, largest first is cheapest on disk")
    p.add_argument("--saves", type=int, default=10, help="saves per mode (50 for the flatness check)")
    p.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help="subset of: " + " ".join(m.name for m in bm.MODES) +
                   " (or a source: megatron, torch_dcp, ours)")
    p.add_argument("--out", default="/tmp/bench_ckpt", help="checkpoint root (one dir per mode, "
                   "deleted after the mode)")
    p.add_argument("--json", default=None, type=node.writable_file,
                   help="result JSON (default OUT/bench.json); rewritten "
                   "after every mode, so a killed run keeps what it measured")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny state, 3 saves, small floors, no settle time (CI)")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="idle time between a mode's start-up and its first save, standing for the "
                   "training iterations before the first checkpoint (every mode gets the same)")
    p.add_argument("--poll-s", type=float, default=0.01,
                   help="interval of maybe_finalize(blocking=False) polls while waiting for durable")
    p.add_argument("--durable-timeout-s", type=float, default=600.0)
    p.add_argument("--mode-budget-s", type=float, default=0.0,
                   help="stop a mode's saves after this many seconds (0: no limit)")
    p.add_argument("--mode-timeout-s", type=float, default=1200.0,
                   help="watchdog: a mode still running after this many seconds (a hang inside a "
                   "backend) dumps every thread's stack and ends the process; the JSON keeps the "
                   "modes finished before it (0: off)")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="skip the modes not yet started after this many seconds (0: no limit)")
    p.add_argument("--floor-gib", type=_floor_size, default=STATE,
                   help="D2H floor copy size per rank in GiB, or 'state' (the default): each "
                   "state size's own bytes, measured before its modes (a 1 GiB sample of an "
                   "8 GiB state read 1.10-1.14x faster than the whole state's copy at 8 ranks on "
                   "four H100s, docs/node/README.md)")
    p.add_argument("--floor-write-gib", type=_floor_size, default=STATE,
                   help="write floor size per rank in GiB, or 'state' (the default): each state "
                   "size's own bytes, written and fsync'd before its modes (a 2 GiB sample, and "
                   "the cold read back, are measured up front either way)")
    p.add_argument("--write-streams", type=int, default=None,
                   help="writer threads per rank for the write floor (default: as many as a "
                   "save's writer, megatron_ckpt_ext._threads)")
    p.add_argument("--mem-sample-s", type=float, default=0.05)
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip loading our last checkpoint of each mode back (bit-exact check)")
    p.add_argument("--dist-timeout-min", type=int, default=10)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--plot", metavar="JSON", help="only draw JSON's PNG (benchmarks/plot_bench.py)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="only merge result files into --json")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device = "cpu"
        args.gib_per_rank = [SMOKE_GIB]
        args.settle_s = 0.0
        if args.floor_gib != STATE:
            args.floor_gib = 1 / 64
        if args.floor_write_gib != STATE:
            args.floor_write_gib = 1 / 32
        args.durable_timeout_s = min(args.durable_timeout_s, 60.0)
        if "--saves" not in (argv if argv is not None else sys.argv):
            args.saves = 3
    if args.saves < 1:
        p.error("--saves must be >= 1")
    args.modes = _select_modes(p, args.modes)
    return args


SMOKE_GIB = 0.0  # marker: the --cpu-smoke state (bm.SMOKE_SHAPE), not a size in GiB
STATE = "state"  # --floor-gib: the floor copies each state size's own bytes


def _floor_size(text: str) -> float | str:
    if text == STATE:
        return STATE
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size in GiB > 0 or {STATE!r}, got {text!r}")
    return value


def _select_modes(p: argparse.ArgumentParser, wanted: list[str] | None) -> list[bm.ModeSpec]:
    if not wanted:
        return list(bm.MODES)
    by_name = {m.name: m for m in bm.MODES}
    chosen: list[bm.ModeSpec] = []
    for w in wanted:
        matches = [m for m in bm.MODES if m.source == w] if w not in by_name else [by_name[w]]
        if not matches:
            p.error(f"--modes: unknown mode {w!r}; choose from {', '.join(by_name)}")
        chosen += [m for m in matches if m not in chosen]
    return chosen


# -- distributed set-up --------------------------------------------------------------------------
def init_dist(args: argparse.Namespace) -> tuple[node.Layout, torch.device]:
    layout = node.init(args.device, args.ranks_per_device, args.dist_timeout_min)
    # Stock megatron-core / nvrx call torch.cuda.* on their save paths; on CPU-only torch the
    # shim makes that a no-op / "cpu" (megatron_ckpt_ext/_cpu_shim.py). Nothing changes with CUDA.
    _cpu_shim.install()
    device = node.device_of(layout)
    # gloo (ranks sharing a device) warms up on host tensors
    bm.warm_up_default_group(device if layout.backend == "nccl" else torch.device("cpu"))
    return layout, device


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


Ctl = node.Ctl


def progress(start: float, text: str) -> None:
    if rank() == 0:
        print(f"[bench {time.perf_counter() - start:7.1f}s] {text}", flush=True)


# -- floors --------------------------------------------------------------------------------------
def d2h_fields(d2h: dict, device: torch.device) -> dict:
    return {"d2h_pinned_gbps": d2h["slowest_rank_gbps"],
            "d2h_kind": "pinned device-to-host" if device.type == "cuda" else "host memcpy",
            "d2h_bytes_per_rank": d2h["bytes_per_rank"], "d2h_per_rank_gbps": d2h["per_rank_gbps"],
            "d2h_aggregate_gbps": d2h["aggregate_gbps"]}


def write_fields(write: dict) -> dict:
    return {"gbps": write["aggregate_gbps"], "bytes_total": write["bytes_total"],
            "seconds": write["seconds"]}


def measure_floors(args: argparse.Namespace, device: torch.device, ctl: Ctl, out: Path) -> dict:
    """The D2H copy (at ``--floor-gib``; with ``state``, a 1 GiB sample here, kept as
    ``d2h_sample_*``, and each size's own floor before its modes), the disk write and the cold
    read back, each with every rank at once."""
    sample = args.floor_gib == STATE
    gib = (1 / 64 if args.cpu_smoke else 1.0) if sample else args.floor_gib
    d2h = d2h_fields(node.d2h_floor(ctl, device, int(gib * GIB)), device)
    streams = args.write_streams or thread_counts().writer
    write_sample = args.floor_write_gib == STATE
    write_gib = (1 / 32 if args.cpu_smoke else 2.0) if write_sample else args.floor_write_gib
    write = node.write_floor(ctl, out / "floor", int(write_gib * GIB) // streams * streams,
                             streams)
    read = node.read_floor(ctl, out / "floor", streams)
    ctl.barrier()
    if rank() == 0:
        shutil.rmtree(out / "floor", ignore_errors=True)
    out = {"write_streams_per_rank": streams, "all_ranks_at_once": world(),
           "read_cold_gbps": read["aggregate_gbps"], "read_seconds": read["seconds"],
           "d2h_floor_size": STATE if sample else d2h["d2h_bytes_per_rank"],
           "write_floor_size": STATE if write_sample else write["bytes_total"] // world()}
    out.update({("write_sample_" if write_sample else "write_") + k: v
                for k, v in write_fields(write).items()})
    if sample:  # the state's own floor comes with its size; this sample stands beside it
        out.update({k.replace("d2h_", "d2h_sample_", 1): v for k, v in d2h.items()})
    else:
        out.update(d2h)
    return out


# -- one mode ------------------------------------------------------------------------------------
class ModeRun:
    """Start-up, ``--saves`` timed saves, verification and clean-up of one mode on one state."""

    def __init__(self, spec: bm.ModeSpec, ctx: "Bench", state: dict[str, torch.Tensor],
                 size_key: str) -> None:
        self.spec, self.ctx, self.state, self.size_key = spec, ctx, state, size_key
        self.runner = bm.make_runner(spec, ctx.device)
        self.root = ctx.out / size_key / spec.name
        self.nbytes = bm.state_bytes(state)
        self.records: list[dict] = []
        self.summary: dict[str, Any] = {"mode": spec.name, "source": spec.source,
                                        "state_bytes": self.nbytes, "size": size_key}

    def run(self) -> tuple[list[dict], dict]:
        reason = self.runner.unavailable()
        if reason is not None:
            return [], {**self.summary, "status": "skipped", "reason": reason}
        error = None
        if self.ctx.args.mode_timeout_s:
            faulthandler.dump_traceback_later(self.ctx.args.mode_timeout_s, exit=True)
        try:
            self._prepare_root()
            self._start()
            self._saves()
        except Exception as e:  # noqa: BLE001 - one mode's failure must not end the benchmark
            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        error = self._close(error)
        faulthandler.cancel_dump_traceback_later()
        status = {"status": "error", "error": error} if error else {"status": "ok"}
        return self.records, {**self.summary, **status, "info": self.runner.info,
                              "saves_done": len(self.records)}

    def _prepare_root(self) -> None:
        if rank() == 0:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)
        self.ctx.ctl.barrier()

    def _start(self) -> None:
        self.ctx.sampler.rebase()
        t0 = time.perf_counter()
        self.runner.start(self.state)
        self.summary["startup_s"] = round(self.ctx.ctl.max([time.perf_counter() - t0])[0], 6)
        self.summary["settle_s"] = self.ctx.args.settle_s
        time.sleep(self.ctx.args.settle_s)

    def _saves(self) -> None:
        args, started = self.ctx.args, time.perf_counter()
        expected = None
        for i in range(1, args.saves + 1):
            if i == args.saves and args.verify and self.spec.source == "ours":
                expected = {k: v.clone() for k, v in self.state.items()}
            record = self._one_save(i)
            self.records.append(record)
            if i > 1:
                bm.remove_checkpoint(self.root, i - 1)
            self._progress(record)
            elapsed = self.ctx.ctl.max([time.perf_counter() - started])[0]
            if args.mode_budget_s and elapsed > args.mode_budget_s and i < args.saves:
                self.summary["truncated"] = f"--mode-budget-s {args.mode_budget_s} reached"
                return
        if expected is not None:
            ok = self.runner.verify(expected, self.root, args.saves)
            self.summary["verified_bit_exact"] = bool(self.ctx.ctl.max([0.0 if ok else 1.0])[0] == 0)

    def _one_save(self, index: int) -> dict:
        args, ctl = self.ctx.args, self.ctx.ctl
        ctl.barrier()
        t0 = time.perf_counter()
        self.runner.save(self.state, self.root, index)
        blocking = time.perf_counter() - t0
        self.runner.wait_staged(args.durable_timeout_s)
        staged = time.perf_counter() - t0
        bm.mutate(self.state, index)  # training goes on: the checkpoint must not see this
        extra = self.runner.wait_durable(index, max(1, int(args.durable_timeout_s / args.poll_s)),
                                         args.poll_s)
        durable = time.perf_counter() - t0
        peak = self.ctx.sampler.take_peak()
        ranks = ctl.gather((blocking, staged, durable, peak, socket.gethostname()))
        blocking, staged, durable = (max(r[i] for r in ranks) for i in range(3))
        record = self._record(index, blocking, staged, durable, max(r[3].proc for r in ranks),
                              max(r[3].sys for r in ranks), extra)
        record.update(per_rank_figures(ranks))
        return record

    def _record(self, index: int, blocking: float, staged: float, durable: float, host: int,
                host_sys: int, extra: dict) -> dict:
        floors = self.ctx.floors
        floor_s = self.nbytes / (floors["d2h_pinned_gbps"] * 1e9)
        record = {
            "mode": self.spec.name, "source": self.spec.source, "cpu_shm": self.spec.cpu_shm,
            "worker": self.spec.worker, "constant_structure": self.spec.constant_structure,
            "size": self.size_key, "state_bytes": self.nbytes, "world": world(),
            "save_index": index, "blocking_s": round(blocking, 6),
            "staging_done_s": round(staged, 6), "durable_s": round(durable, 6),
            "bench_durable_s": round(durable, 6), "host_extra_bytes": host,
            "host_extra_sys_bytes": host_sys, "floor_d2h_s": round(floor_s, 6),
            "floor_write_s": round(self.nbytes * world() / (floors["write_gbps"] * 1e9), 6),
            "blocking_over_floor": round(blocking / floor_s, 3),
        }
        report = extra.get("report")
        if report is not None:  # ours: the slowest rank's durable, from the Checkpointer
            record.update(durable_s=report["durable_s"], report_mode=report["mode"],
                          report_blocking_s=report["blocking_s"],
                          report_host_extra_bytes=report["host_extra_bytes"], report=report)
        return record

    def _progress(self, r: dict) -> None:
        progress(self.ctx.started, f"{self.ctx.position} {self.spec.name} [{self.size_key}] save "
                 f"{r['save_index']}/{self.ctx.args.saves}: blocking {r['blocking_s']:.3f} s "
                 f"({r['blocking_over_floor']:.1f}x D2H floor), staged {r['staging_done_s']:.3f} s,"
                 f" durable {r['durable_s']:.3f} s, host extra {r['host_extra_bytes'] / GIB:.2f} GiB")

    def _close(self, error: str | None) -> str | None:
        try:
            self.runner.close()
        except Exception as e:  # noqa: BLE001
            error = error or f"close: {type(e).__name__}: {e}"
        errors = [e for e in self.ctx.ctl.gather(error) if e]
        if rank() == 0:
            shutil.rmtree(self.root, ignore_errors=True)
        return f"{errors[0]} (ranks with errors: {len(errors)})" if errors else None


def per_rank_figures(ranks: list[tuple]) -> dict:
    """One save's figures of every rank ((blocking, staged, durable, Peak, host) each): each
    rank's times, the slowest over the median, and the extra host memory of the fullest node:
    its ranks' process trees, plus /dev/shm once (every rank of a node sees all of it), each
    rank's split taken at its own peak. (Adding up each rank's tree peak and /dev/shm's peak
    taken apart mixed moments: at 8 ranks a tree peaked around the worker's start, before the
    staging filled /dev/shm, and the first save read up to 1.085x where no sample of any rank,
    nor the host's own count, held more than at the steady saves.)"""
    nodes: dict[str, list] = {}
    for r in ranks:
        nodes.setdefault(r[4], []).append(r[3])
    node_bytes, node_ranks = max((sum(p.tree for p in peaks) + max(p.shm for p in peaks),
                                  len(peaks)) for peaks in nodes.values())
    blocking = node.spread([r[0] for r in ranks])
    return {"per_rank": {"blocking_s": blocking["per_rank"],
                         "staging_done_s": [round(r[1], 6) for r in ranks],
                         "durable_s": [round(r[2], 6) for r in ranks],
                         "host_extra_bytes": [r[3].proc for r in ranks],
                         # its split at that peak: the rank's process tree (Pss_Anon), /dev/shm
                         "host_extra_tree_bytes": [r[3].tree for r in ranks],
                         "host_extra_shm_bytes": [r[3].shm for r in ranks]},
            "blocking_max_over_median": blocking["max_over_median"],
            "host_extra_node_bytes": node_bytes, "node_ranks": node_ranks}


# -- the whole benchmark -------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.layout, self.device = init_dist(args)
        self.ctl = Ctl()
        self.out = Path(args.out)
        self.json_path = Path(args.json or self.out / "bench.json")
        self.started = time.perf_counter()
        self.sampler = bm.HostMemSampler(args.mem_sample_s)
        self.floors: dict = {}
        self.position = ""
        self.result: dict = {}

    def run(self) -> dict:
        self.floors = measure_floors(self.args, self.device, self.ctl, self.out)
        f = self.floors
        d2h = f.get("d2h_pinned_gbps", f.get("d2h_sample_pinned_gbps"))
        kind = f.get("d2h_kind", f.get("d2h_sample_kind"))
        write = f.get("write_gbps", f.get("write_sample_gbps"))
        progress(self.started, f"floors: D2H {d2h} GB/s ({kind}, {f['d2h_floor_size']}), "
                 f"write {write} GB/s ({f['write_floor_size']})")
        self.result = self._header()
        for size in self.args.gib_per_rank:
            self._size(size)
        self.result["summary"] = summarize(self.result["runs"], self.result["modes"])
        self._write()
        if rank() == 0:
            print_summary(self.result)
        return self.result

    def _header(self) -> dict:
        caps = backend.detect()
        return {
            "schema": SCHEMA, "device": node.describe_device(self.device),
            "versions": {"torch": torch.__version__, "megatron-core": caps.mcore_version,
                         "nvrx": caps.nvrx_version, "python": platform.python_version(),
                         "cuda": torch.version.cuda, "crc32": _crc.IMPLEMENTATION},
            "world": world(), "argv": sys.argv[1:], "world_size": world(),
            "ranks_per_device": self.layout.ranks_per_device,
            "layout": node.layout_json(self.layout), "command": node.command_line(self.layout),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "floors": self.floors, "parts": [{"argv": sys.argv[1:], "floors": self.floors}],
            "modes": [], "runs": [],
        }

    def _size(self, gib: float) -> None:
        shape = bm.GptShape(*bm.SMOKE_SHAPE) if gib == SMOKE_GIB else bm.gpt_shape(gib * GIB)
        state = bm.build_state(shape, device=self.device, rank=rank())
        size_key = size_label(bm.state_bytes(state))
        progress(self.started, f"state {size_key}/rank: GPT hidden {shape.hidden}, {shape.layers} "
                 f"layers, vocab {shape.vocab}, {len(state)} tensors")
        if self.args.floor_gib == STATE:  # this size's own bytes, every rank at once
            d2h = d2h_fields(node.d2h_floor(self.ctl, self.device, bm.state_bytes(state)),
                             self.device)
            self.floors.update(d2h)  # what this size's records divide by
            self.result.setdefault("d2h_floor_by_size", {})[size_key] = d2h
            progress(self.started, f"D2H floor for {size_key}: {d2h['d2h_pinned_gbps']} GB/s")
        if self.args.floor_write_gib == STATE:  # this size's bytes on every rank, fsync'd
            streams = self.floors["write_streams_per_rank"]
            write = write_fields(node.write_floor(
                self.ctl, self.out / "floor", bm.state_bytes(state) // streams * streams,
                streams))
            self.ctl.barrier()
            if rank() == 0:
                shutil.rmtree(self.out / "floor", ignore_errors=True)
            self.floors.update({"write_" + k: v for k, v in write.items()})
            self.result.setdefault("write_floor_by_size", {})[size_key] = write
            progress(self.started, f"write floor for {size_key}: {write['gbps']} GB/s")
        for i, spec in enumerate(self.args.modes, 1):
            self.position = f"mode {i}/{len(self.args.modes)}"
            self._mode(spec, state, size_key, shape)
        del state
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _mode(self, spec: bm.ModeSpec, state: dict, size_key: str, shape: bm.GptShape) -> None:
        elapsed = self.ctl.max([time.perf_counter() - self.started])[0]
        if self.args.deadline_s and elapsed > self.args.deadline_s:
            records, summary = [], {"mode": spec.name, "source": spec.source, "size": size_key,
                                    "state_bytes": bm.state_bytes(state), "status": "skipped",
                                    "reason": f"--deadline-s {self.args.deadline_s} passed"}
        else:
            progress(self.started, f"{self.position} {spec.name} [{size_key}] starting")
            records, summary = ModeRun(spec, self, state, size_key).run()
        summary["gpt_shape"] = {"hidden": shape.hidden, "layers": shape.layers,
                                "vocab": shape.vocab, "tensors": len(state)}
        self.result["runs"] += records
        self.result["modes"].append(summary)
        progress(self.started, f"{self.position} {spec.name} [{size_key}] {summary['status']}"
                 + (f": {summary.get('reason') or summary.get('error')}"
                    if summary["status"] != "ok" else ""))
        self._write()

    def _write(self) -> None:
        if rank() == 0:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.json_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.result, indent=1) + "\n")
            os.replace(tmp, self.json_path)

    def close(self) -> None:
        self.sampler.close()
        dist.destroy_process_group()


def size_label(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}GiB" if nbytes >= GIB / 10 else f"{nbytes / (1 << 20):.1f}MiB"


# -- summary -------------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


def _mode_summary(runs: list[dict]) -> dict:
    blocking = [r["blocking_s"] for r in sorted(runs, key=lambda r: r["save_index"])]
    durable = [r["durable_s"] for r in sorted(runs, key=lambda r: r["save_index"])]
    staged = [r["staging_done_s"] for r in sorted(runs, key=lambda r: r["save_index"])]
    host = [r["host_extra_bytes"] for r in runs]
    first = runs[0]
    out = {
        "saves": len(runs), "state_bytes": first["state_bytes"],
        "blocking_first3_s": blocking[:3], "blocking_median_4_n_s": _median(blocking[3:]),
        "blocking_steady_s": _median(blocking[2:]),  # 3rd save onward (the steady state)
        "staging_done_steady_s": _median(staged[2:]),
        "durable_first_s": durable[0], "durable_steady_s": _median(durable[2:]),
        "host_extra_max_bytes": max(host),
        "host_extra_sys_max_bytes": max(r["host_extra_sys_bytes"] for r in runs),
        "floor_d2h_s": first["floor_d2h_s"], "floor_write_s": first["floor_write_s"],
    }
    if "report_host_extra_bytes" in first:
        out["report_host_extra_max_bytes"] = max(r["report_host_extra_bytes"] for r in runs)
    out.update(_per_rank_summary(sorted(runs, key=lambda r: r["save_index"])))
    if out["blocking_steady_s"] is not None:
        out["steady_over_floor"] = round(out["blocking_steady_s"] / first["floor_d2h_s"], 3)
    return out


def _per_rank_summary(runs: list[dict]) -> dict:
    """Each rank's steady blocking (its median over saves 3..N, else all), the slowest rank
    over the median one, and the fullest node's extra host memory."""
    if not all("per_rank" in r for r in runs):
        return {}  # records of a run before per-rank figures
    steady = runs[2:] or runs
    per_rank = [statistics.median(r["per_rank"]["blocking_s"][i] for r in steady)
                for i in range(len(runs[0]["per_rank"]["blocking_s"]))]
    spread = node.spread(per_rank)
    return {"per_rank_blocking_steady_s": spread["per_rank"],
            "blocking_steady_max_over_median": spread["max_over_median"],
            "host_extra_node_max_bytes": max(r["host_extra_node_bytes"] for r in runs),
            "node_ranks": max(r.get("node_ranks", 1) for r in runs)}


def _ratio(stock: float | None, ours: float | None) -> float | None:
    return round(stock / ours, 3) if stock and ours else None


def _flatness(runs: list[dict]) -> dict | None:
    """Extra host memory over saves 2..N: spread (max - min) relative to the median."""
    values = [r["host_extra_bytes"] for r in sorted(runs, key=lambda r: r["save_index"])][1:]
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    spread = (max(values) - min(values)) / mid if mid else 0.0
    return {"saves": len(values) + 1, "min_bytes": min(values), "max_bytes": max(values),
            "spread_pct": round(100 * spread, 3), "flat_pm_1pct": spread <= 0.02}


def _targets(mode: dict, stock: dict | None, bytes_: int) -> dict:
    """The issue's targets for our cpu-shm mode (measured here, not asserted in tests)."""
    t: dict[str, Any] = {}
    node_ranks = mode.get("node_ranks", 1)
    if mode.get("blocking_steady_s") is not None:
        # one rank: <= 1.05x its copy floor (issue 31); several ranks of a node: <= 1.1x the
        # floor measured with all of them copying at once (issue 33)
        factor = 1.1 if node_ranks > 1 else 1.05
        bound = factor * mode["floor_d2h_s"]
        t[f"steady_blocking_le_{factor}x_d2h_floor"] = {"value_s": mode["blocking_steady_s"],
                                                        "bound_s": round(bound, 6),
                                                        "met": mode["blocking_steady_s"] <= bound}
    if stock and stock.get("blocking_first3_s"):
        bound = stock["blocking_first3_s"][0] / 5
        t["first_blocking_le_stock_first/5"] = {"value_s": mode["blocking_first3_s"][0],
                                                "bound_s": round(bound, 6),
                                                "met": mode["blocking_first3_s"][0] <= bound}
    if mode.get("durable_steady_s") is not None:
        bound = 1.25 * mode["floor_write_s"]
        t["durable_le_1.25x_write_floor"] = {"value_s": mode["durable_steady_s"],
                                             "bound_s": round(bound, 6),
                                             "met": mode["durable_steady_s"] <= bound}
    # measured: process tree (Pss_Anon, the writer process included) + /dev/shm; buffers: what
    # the Checkpointer itself reports holding (staging buffers only)
    if node_ranks > 1:
        # several ranks on a node: each rank's own figure counts all of /dev/shm (every rank
        # sees it), so the bound is the node's: its process trees + /dev/shm once, against the
        # bytes its ranks stage
        node_bytes, staged = mode["host_extra_node_max_bytes"], node_ranks * bytes_
        t["host_node_le_1.02x_node_staged"] = {
            "value_bytes": node_bytes, "node_ranks": node_ranks, "staged_bytes": staged,
            "bound_bytes": int(1.02 * staged), "ratio": round(node_bytes / staged, 4),
            "met": node_bytes <= 1.02 * staged}
        return t
    t["host_extra_le_1.05x_state"] = {"value_bytes": mode["host_extra_max_bytes"],
                                      "buffers_bytes": mode.get("report_host_extra_max_bytes"),
                                      "bound_bytes": int(1.05 * bytes_),
                                      "met": mode["host_extra_max_bytes"] <= 1.05 * bytes_}
    return t


def summarize(runs: list[dict], modes: list[dict]) -> dict:
    """Per size and mode: blocking of saves 1-3, median of 4..N, steady (3..N), durable, host
    memory; ratios stock/ours per counterpart pair; flatness and targets of our modes."""
    by: dict[str, dict[str, list[dict]]] = {}
    for r in runs:
        by.setdefault(r["size"], {}).setdefault(r["mode"], []).append(r)
    specs = {m.name: m for m in bm.MODES}
    out: dict[str, Any] = {"per_size": {}, "ratios": [], "host_flatness": {}, "targets": {}}
    for size, per_mode in by.items():
        table = {name: _mode_summary(rs) for name, rs in per_mode.items()}
        out["per_size"][size] = table
        for name, row in table.items():
            spec = specs.get(name)
            if spec is None or spec.source != "ours":
                continue
            out["host_flatness"][f"{size}/{name}"] = _flatness(per_mode[name])
            stock = table.get(spec.baseline or "")
            sync = table.get("megatron-sync")
            out["ratios"].append({
                "size": size, "ours": name, "stock": spec.baseline,
                "first_stock_over_ours": _ratio(stock and stock["blocking_first3_s"][0],
                                                row["blocking_first3_s"][0]),
                "steady_stock_over_ours": _ratio(stock and stock["blocking_steady_s"],
                                                 row["blocking_steady_s"]),
                "durable_steady_stock_over_ours": _ratio(stock and stock["durable_steady_s"],
                                                         row["durable_steady_s"]),
                "steady_megatron_sync_over_ours": _ratio(sync and sync["blocking_steady_s"],
                                                         row["blocking_steady_s"]),
            })
            if spec.cpu_shm:
                out["targets"][f"{size}/{name}"] = _targets(row, stock, row["state_bytes"])
    out["not_run"] = [{k: m.get(k) for k in ("size", "mode", "status", "reason", "error")}
                      for m in modes if m["status"] != "ok"]
    return out


def print_summary(result: dict) -> None:
    s = result["summary"]
    print(f"\nfloors: D2H {result['floors']['d2h_pinned_gbps']} GB/s, write "
          f"{result['floors']['write_gbps']} GB/s ({result['device']})")
    for size, table in s["per_size"].items():
        print(f"\n[{size} per rank] blocking s: #1 #2 #3 | median 4..N | steady/floor | durable "
              "steady | host extra GiB")
        for name, row in table.items():
            first3 = " ".join(f"{v:7.3f}" for v in row["blocking_first3_s"])
            print(f"  {name:34s} {first3:24s} | {row['blocking_median_4_n_s'] or float('nan'):7.3f}"
                  f" | {row.get('steady_over_floor') or float('nan'):6.1f}x | "
                  f"{row['durable_steady_s'] or float('nan'):7.3f} | "
                  f"{row['host_extra_max_bytes'] / GIB:.2f}")
    for r in s["ratios"]:
        print(f"  ratio {r['size']} {r['stock']} / {r['ours']}: first {r['first_stock_over_ours']}, "
              f"steady {r['steady_stock_over_ours']}")
    for m in s["not_run"]:
        print(f"  not run: {m['size']} {m['mode']}: {m['status']}: {m.get('reason') or m.get('error')}")


# -- merge / plot --------------------------------------------------------------------------------
def merge(paths: list[str], out: str) -> dict:
    """Concatenate the runs of several invocations (a GPU run split by --modes or sizes)."""
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise SystemExit(f"--merge: no such result file: {', '.join(missing)}")
    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**parts[0], "runs": [], "modes": [], "parts": []}
    for part in parts:
        if (part["device"], part["versions"]) != (parts[0]["device"], parts[0]["versions"]):
            raise SystemExit(f"--merge: {paths[parts.index(part)]} was measured on another device "
                             "or stack; merge only runs of one machine")
        merged["runs"] += part["runs"]
        merged["modes"] += part["modes"]
        merged["parts"] += part.get("parts", [{"argv": part.get("argv"), "floors": part["floors"]}])
    merged["summary"] = summarize(merged["runs"], merged["modes"])
    Path(out).write_text(json.dumps(merged, indent=1) + "\n")
    print_summary(merged)
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    if args.plot:
        import plot_bench

        print(plot_bench.plot(args.plot))
        return 0
    if args.merge:
        if not args.json:
            raise SystemExit("--merge needs --json OUT")
        merge(args.merge, args.json)
        return 0
    node.out_dir(args.out)  # before any process group or state exists
    bench = Bench(args)
    try:
        bench.run()
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
