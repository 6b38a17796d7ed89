"""Load benchmark: ours (Checkpointer.load, verifying) vs stock megatron-core load vs plain torch
DCP load, from the page cache (warm) and with the files' pages dropped (cold), side by side in one
run, with three floors measured in the same run with every rank at once: a parallel page-cache
read, a parallel cold read (each rank its share of the files), and a pinned host-to-device copy of
each rank's state.

One process per rank (torchrun, or a plain script: a world of one); ``--ranks-per-device`` as in
bench_ckpt.py (benchmarks/_bench_node.py). The state is bench_ckpt.py's synthetic GPT, saved once
by our Checkpointer (sync), every rank its shard. Every load is started on all ranks by one
barrier; ``load_s`` is the slowest rank's. JSON (docs/benchmarks/README.md, "Load"):
``device``, ``versions``, ``world_size``, ``ranks_per_device``, ``layout``, ``command``,
``floors`` {``h2d_pinned_gbps``, ``read_warm_gbps``, ``read_cold_gbps``} (aggregates; the cold
one null where ``--caches warm`` times no cold load),
``first_load`` (the process's first load, of the first source, timed apart before the repeats:
it pays what later loads find done; null with ``--no-first-load``),
``runs`` [{``source``, ``cache``, ``state_bytes``, ``load_s``, ``per_rank_load_s``,
``max_over_median``, ``verified``, ``load_threads`` (ours: its reading threads a rank), and for
ours ``phases`` (each the slowest rank's at it), rank 0's ``read_detail`` (its read step's wait
for the sums), and every rank's own ``rank_phases`` and ``verify_detail`` {name: [rank 0's,
...]}: the verification's steps, ``settle_s`` holding a rank until the slowest one's reads end)}];
with several ``--load-threads`` values, ``by_load_threads`` {value: the targets of its runs}.

    torchrun --nproc-per-node 1 benchmarks/bench_load.py --gib 4 --repeats 2 --json $OUT/load.json
    torchrun --nproc-per-node 8 benchmarks/bench_load.py --gib 1 --json $OUT/load8.json  # a node
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_load.py --cpu-smoke --json /tmp/l.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _bench_node as node  # noqa: E402
from benchmarks._bench_modes import build_state, gpt_shape, sharded, state_bytes  # noqa: E402
from megatron_ckpt_ext import _crc  # noqa: E402
from megatron_ckpt_ext import Checkpointer, CkptOptions, backend  # noqa: E402
from megatron_ckpt_ext._threads import thread_counts  # noqa: E402
from megatron_ckpt_ext.backend import direct_read  # noqa: E402

_CHUNK = 64 << 20


def _files(checkpoint: Path) -> list[Path]:
    return sorted(p for p in checkpoint.iterdir() if p.is_file())


def drop_pages(checkpoint: Path) -> None:
    """Evict the checkpoint's pages from the page cache (clean pages go at once)."""
    for path in _files(checkpoint):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def parallel_read_s(files: Path | list[Path], threads: int,
                    ready: Callable[[], None] = lambda: None) -> float:
    """Read every byte of ``files`` (a checkpoint directory: all its files), ``_CHUNK`` at a time
    over ``threads`` threads, each into one buffer of its own that it reuses (``preadv``: no
    allocation, no page faults on the destination, so what is timed is the file read itself);
    the clock starts after ``ready()`` (a barrier: every rank reads at once)."""
    files = _files(files) if isinstance(files, Path) else files
    jobs = [(i, off) for i, p in enumerate(files) for off in range(0, p.stat().st_size, _CHUNK)]
    fds = [os.open(p, os.O_RDONLY) for p in files]
    local = threading.local()
    started = threading.Barrier(threads)

    def buffer() -> memoryview:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(_CHUNK))
            buf[::4096] = b"\1" * len(buf[::4096])  # touched once, before the clock matters
        return buf

    def start(_: int) -> None:  # one per thread (each waits for all): every buffer made
        buffer()
        started.wait(timeout=300)

    def read(job: tuple[int, int]) -> int:
        i, off = job
        return os.preadv(fds[i], [buffer()], off)

    try:
        with ThreadPoolExecutor(threads) as pool:
            try:
                list(pool.map(start, range(threads)))
            except BaseException:  # (Ctrl-C) the started threads must not wait for the others
                started.abort()
                raise
            ready()
            t0 = time.perf_counter()
            list(pool.map(read, jobs))
            return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def read_h2d_s(files: list[Path], threads: int, device: torch.device,
               ready: Callable[[], None] = lambda: None) -> float:
    """The host's own warm load with nothing of ours: ``threads`` threads each read their
    ``_CHUNK`` pieces of ``files`` into one of two pinned buffers of their own and copy each to
    the device on a stream of their own, reading the next piece while the last one's copy runs
    (every byte crosses host memory three times, as in any storage load: the read's two passes
    and the device's; on a CPU the copy is a host copy). The clock starts after ``ready()``;
    raises if any byte of ``files`` was not moved."""
    cuda = device.type == "cuda"
    jobs = [(i, off) for i, p in enumerate(files) for off in range(0, p.stat().st_size, _CHUNK)]
    fds = [os.open(p, os.O_RDONLY) for p in files]
    pinned = [[torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
              for _ in range(threads)]
    sinks = [torch.empty(_CHUNK, dtype=torch.uint8, device=device) for _ in range(threads)]
    streams = [torch.cuda.Stream(device) if cuda else None for _ in range(threads)]

    def work(t: int) -> int:
        landed: list = [None, None]
        moved = 0
        for k, (i, off) in enumerate(jobs[t::threads]):
            slot = pinned[t][k % 2]
            if landed[k % 2] is not None:
                landed[k % 2].synchronize()  # this buffer's last copy is done
            got = os.preadv(fds[i], [memoryview(slot.numpy())], off)
            if cuda:
                with torch.cuda.stream(streams[t]):
                    sinks[t][:got].copy_(slot[:got], non_blocking=True)
                landed[k % 2] = streams[t].record_event()
            else:
                sinks[t][:got].copy_(slot[:got])
            moved += got
        if cuda:
            streams[t].synchronize()
        return moved

    try:
        with ThreadPoolExecutor(threads) as pool:
            ready()
            t0 = time.perf_counter()
            moved = sum(pool.map(work, range(threads)))
            seconds = time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)
        del pinned, sinks
        node.release_cached(device)
    want = sum(p.stat().st_size for p in files)
    if moved != want:
        raise RuntimeError(f"read_h2d_s moved {moved} of {want} bytes")
    return seconds


def h2d_pinned_s(nbytes: int, device: torch.device) -> float | None:
    """One rank's pinned host-to-device copy (None without a device)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _share(checkpoint: Path) -> list[Path]:
    """This rank's share of the checkpoint's files (together the ranks read every file once)."""
    return _files(checkpoint)[dist.get_rank()::dist.get_world_size()]


def read_floors(ctl: node.Ctl, checkpoint: Path, threads: int, cold: bool = True) -> dict:
    """Cold (unless ``cold`` is False: no cold load is timed, so no cold floor is needed; the
    cold figures are then None), then warm (best over thread counts) parallel reads of every
    rank's share of the files, every rank at once: aggregate GB/s (all ranks' bytes over the
    slowest rank's seconds) and each rank's seconds."""
    share, on_disk = _share(checkpoint), sum(f.stat().st_size for f in _files(checkpoint))
    cold_s = None
    if cold:
        drop_pages(checkpoint)
        ctl.barrier()
        cold_s = ctl.gather(parallel_read_s(share, threads, ready=ctl.barrier))
    warm: list[float] | None = None
    for n in sorted({max(1, threads // 2), threads, 2 * threads}):
        parallel_read_s(share, n)  # in the page cache
        seconds = ctl.gather(parallel_read_s(share, n, ready=ctl.barrier))
        if warm is None or max(seconds) < max(warm):
            warm, warm_threads = seconds, n
    return {"read_cold_gbps": round(on_disk / max(cold_s) / 1e9, 3) if cold_s else None,
            "read_warm_gbps": round(on_disk / max(warm) / 1e9, 3),
            "read_warm_threads": warm_threads,
            "read_cold_s": node.spread(cold_s) if cold_s else None,
            "read_warm_s": node.spread(warm)}


def _by_rank(dicts: list[dict]) -> dict[str, list]:
    """{name: [rank 0's value, rank 1's, ...]} from each rank's {name: value}."""
    return {name: [d.get(name) for d in dicts] for name in dicts[0]} if dicts else {}


def _spread_line(entry: dict) -> str:
    """Fastest-slowest rank of the read step (read + host-to-device) and of the verification's
    steps: a rank that read first waits at ``settle``."""
    rp, vd = entry["rank_phases"], entry.get("verify_detail", {})
    step = [a + b for a, b in zip(rp["read_s"], rp["h2d_s"])]
    parts = [f"read step {min(step):.3f}-{max(step):.3f} s"]
    for name in ("settle_s", "check_s", "agree_s"):
        if vd.get(name) and None not in vd[name]:
            parts.append(f"{name[:-2]} {min(vd[name]):.3f}-{max(vd[name]):.3f} s")
    return ", ".join(parts)


def _like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def _same(got: dict, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k].to(want[k].device), v) for k, v in want.items())


def _shards(like: dict[str, torch.Tensor]) -> dict:
    return sharded(like, dist.get_rank(), dist.get_world_size())


def load_ours(root: Path, state: dict, verify: bool, threads: int | None = None,
              ready: Callable[[], None] = lambda: None,
              build_s: float = 0.0) -> tuple[float, bool, dict]:
    options = CkptOptions(ckpt_verify_load=verify)
    if threads is not None:
        options = CkptOptions(ckpt_verify_load=verify, ckpt_load_threads=threads)
    with Checkpointer(options) as ck:
        ck.prepare_restore(root)  # as the launcher does before a load (the device CRC, built)
        time.sleep(build_s)  # the model build a resume runs between the two (--build-s)
        like = _like(state)
        ready()
        t0 = time.perf_counter()
        got = ck.load(_shards(like), root)
        _sync(state)
        seconds = time.perf_counter() - t0
        report = ck.load_reports[-1]
    return seconds, _same(got, state), report


def load_megatron(checkpoint: Path, state: dict,
                  ready: Callable[[], None] = lambda: None) -> tuple[float, bool]:
    like = _like(state)
    ready()
    t0 = time.perf_counter()
    got = backend.dist_checkpointing().load(_shards(like), str(checkpoint))
    _sync(state)
    return time.perf_counter() - t0, _same(got, state)


def load_dcp(checkpoint: Path, state: dict,
             ready: Callable[[], None] = lambda: None) -> tuple[float, bool]:
    import torch.distributed.checkpoint as dcp

    like = _like(state)
    ready()
    t0 = time.perf_counter()
    dcp.load(like, checkpoint_id=str(checkpoint))
    _sync(state)
    return time.perf_counter() - t0, _same(like, state)


def _sync(state: dict) -> None:
    if any(v.is_cuda for v in state.values()):
        torch.cuda.synchronize()


SOURCES = ("ours", "ours_no_verify", "megatron", "torch_dcp")


def device_crc_ready(device: torch.device, timeout: float = 120.0) -> dict:
    """Builds the device CRC a verifying load sums with and waits (at most ``timeout``) until it
    is ready, so that every timed load sums there, as a resumed trainer's does when the
    launcher's ``prepare_restore`` built it while the model was built. Seconds to ready (a first
    compile, or Triton's cache); ready False where it never is (no CUDA, no Triton,
    MCX_DEVICE_CRC_TRITON=0: the loads sum on the host)."""
    from megatron_ckpt_ext import _crc_device

    if device.type != "cuda":
        return {"ready": False, "why": "no CUDA"}
    since = time.perf_counter()
    deadline = time.monotonic() + timeout
    while not _crc_device.warm_up(device):
        if time.monotonic() > deadline or _crc_device._kernel() is None:
            return {"ready": False, "why": "no kernel" if _crc_device._kernel() is None
                    else f"not ready in {timeout} s"}
        time.sleep(0.02)
    return {"ready": True, "ready_s": round(time.perf_counter() - since, 3)}


def targets(runs: list[dict], floors: dict) -> dict:
    """Issue 22's ratios from this run: the median over repeats of each (variant, cache); with
    several ranks, the slowest rank against the median one."""
    def med(variant: str, cache: str, key: str = "load_s") -> float | None:
        xs = [r[key] for r in runs if r["variant"] == variant and r["cache"] == cache
              and r.get(key) is not None]
        return statistics.median(xs) if xs else None

    on_disk = runs[0]["bytes_on_disk"]
    ours_w, ours_c = med("ours", "warm"), med("ours", "cold")
    bound = min(g for g in (floors["h2d_pinned_gbps"], floors["read_warm_gbps"]) if g)
    out = {"warm_floor_gbps": bound,
           "warm_speedup_over_megatron": _ratio(med("megatron", "warm"), ours_w),
           "cold_gbps_over_floor": _ratio(on_disk / 1e9 / floors["read_cold_gbps"], ours_c)
           if floors["read_cold_gbps"] else None,  # no cold floor where no cold load ran
           "verify_cost_warm": _ratio(ours_w, med("ours_no_verify", "warm"), minus=1),
           "warm_no_verify_gbps_over_floor": _ratio(on_disk / 1e9 / bound,
                                                    med("ours_no_verify", "warm")),
           "warm_max_over_median": med("ours", "warm", "max_over_median")}
    out["warm_gbps_over_floor"] = _ratio(on_disk / 1e9 / bound, ours_w)
    checks = {"warm >= 0.8 x floor": ("warm_gbps_over_floor", lambda v: v >= 0.8),
              "warm >= 4x megatron": ("warm_speedup_over_megatron", lambda v: v >= 4),
              "cold >= 0.8 x floor": ("cold_gbps_over_floor", lambda v: v >= 0.8),
              "verify <= 10% of warm": ("verify_cost_warm", lambda v: v <= 0.10)}
    # a source or cache state not run (--sources, --caches) leaves its check out
    out["met"] = {name: ok(out[key]) for name, (key, ok) in checks.items()
                  if out[key] is not None}
    out["met"]["warm: no rank > 1.2x the median"] = (out["warm_max_over_median"] or 1.0) <= 1.2
    return out


def _ratio(a: float | None, b: float | None, minus: float = 0.0) -> float | None:
    return round(a / b - minus, 3) if a is not None and b else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=node.positive(float), default=4.0, help="state size per rank")
    p.add_argument("--repeats", type=node.positive(int), default=2,
                   help="runs per source and cache state")
    p.add_argument("--threads", type=int, default=None,
                   help="threads per rank of the read floors (default: twice the reading "
                   "threads that suit this rank's share of the cores)")
    p.add_argument("--load-threads", type=node.positive(int), nargs="+", default=[None],
                   help="--ckpt-load-threads for ours (default: the option's default); several "
                   "values: each repeat loads ours with each in turn (an A/B in one run), the "
                   "runs name theirs (load_threads) and the targets are the first value's")
    node.add_ranks_per_device(p)
    p.add_argument("--no-first-load", dest="first_load", action="store_false",
                   help="time no separate first load (by default the process's first load, of "
                        "the first source, is timed apart as first_load, and the repeats after)")
    p.add_argument("--build-s", type=float, default=0.0,
                   help="seconds between our prepare_restore() and the load (the model build a "
                        "resume runs meanwhile; 0: none)")
    p.add_argument("--out", default="/tmp/bench_load",
                   help="the checkpoint root the benchmark saves and loads (removed at the end)")
    p.add_argument("--json", required=True, type=node.writable_file)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny state on CPU (CI)")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                   help="loaders to time (default all; torch_dcp runs at one rank only)")
    p.add_argument("--caches", nargs="+", choices=("cold", "warm"), default=["cold", "warm"],
                   help="page-cache states to time (default both)")
    p.add_argument("--chunk-mib", type=node.positive(int), default=None,
                   help="our storage read's piece in MiB (default: the package's, "
                        "backend/direct_read.py DEFAULT_CHUNK); the JSON names it")
    args = p.parse_args(argv)
    args.threads = args.threads or 2 * thread_counts().load_read
    return args


class LoadBench:
    """One saved checkpoint, loaded by every source from a warm and a cold page cache, every
    load started on all ranks at once."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.chunk_mib:
            direct_read.DEFAULT_CHUNK = args.chunk_mib << 20
        want = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
        self.layout = node.init(want, args.ranks_per_device, 10)
        self.device = node.device_of(self.layout)
        self.ctl = node.Ctl()
        gib = 0.002 if args.cpu_smoke else args.gib
        rank = dist.get_rank()
        self.state = build_state(gpt_shape(gib * 2**30), device=self.device, rank=rank)
        self.nbytes = state_bytes(self.state)
        self.root = Path(args.out)
        if rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)
        self.ctl.barrier()
        with Checkpointer(CkptOptions()) as ck:
            ck.save(_shards(self.state), self.root, iteration=1)
        self.device_crc = device_crc_ready(self.device)
        self.checkpoint = self.root / "iter_0000001"
        self.on_disk = sum(f.stat().st_size for f in _files(self.checkpoint))

    def floors(self) -> dict:
        out = read_floors(self.ctl, self.checkpoint, self.args.threads,
                          cold="cold" in self.args.caches)
        h2d = node.h2d_floor(self.ctl, self.device, self.nbytes)
        out["h2d_pinned_gbps"] = h2d["aggregate_gbps"] if h2d else None
        out["h2d"] = h2d
        out.update(self.read_h2d_floor())
        return out

    def read_h2d_floor(self) -> dict:
        """The host's own read-and-copy loop (:func:`read_h2d_s`), every rank its share at once,
        warm, the best of the load's reading threads and the read floor's: what a warm load can
        reach on this host, beside the floors of the read and the copy each alone."""
        share, best = _share(self.checkpoint), None
        for n in sorted({self._read_threads(self.args.load_threads[0]), self.args.threads}):
            seconds = self.ctl.gather(read_h2d_s(share, n, self.device, self.ctl.barrier))
            if best is None or max(seconds) < max(best[0]):
                best = (seconds, n)
        return {"read_h2d_warm_gbps": round(self.on_disk / max(best[0]) / 1e9, 3),
                "read_h2d_warm_threads": best[1], "read_h2d_warm_s": node.spread(best[0])}

    def loaders(self, threads: int | None = None) -> dict[str, Callable[[], tuple]]:
        """The sources asked, ours with ``threads`` reading threads (None: the default)."""
        a, ready, state = self.args, self.ctl.barrier, self.state
        out = {"ours": lambda: load_ours(self.root, state, True, threads, ready, a.build_s),
               "ours_no_verify": lambda: load_ours(self.root, state, False, threads, ready,
                                                   a.build_s),
               "megatron": lambda: load_megatron(self.checkpoint, state, ready)}
        if dist.get_world_size() == 1:  # plain DCP loads whole tensors: sharded needs DTensors
            out["torch_dcp"] = lambda: load_dcp(self.checkpoint, state, ready)
        return {name: load for name, load in out.items() if name in a.sources}

    def one_load(self, source: str, cache: str, rep: int, load: Callable[[], tuple],
                 threads: int | None = None) -> dict:
        if cache == "cold":
            drop_pages(self.checkpoint)
        else:
            parallel_read_s(_share(self.checkpoint), self.args.threads)  # in the page cache
        self.ctl.barrier()
        out = load()
        ranks = self.ctl.gather(out)
        seconds = node.spread([r[0] for r in ranks], 4)
        entry = {"source": "ours" if source.startswith("ours") else source, "variant": source,
                 "cache": cache, "repeat": rep, "state_bytes": self.nbytes,
                 "bytes_on_disk": self.on_disk, "load_s": seconds["max"],
                 "load_threads": self._read_threads(threads) if source.startswith("ours")
                 else None,
                 "per_rank_load_s": seconds["per_rank"],
                 "max_over_median": seconds["max_over_median"],
                 "bit_exact": all(r[1] for r in ranks),
                 "verified": all(bool(r[2]["verified"]) for r in ranks) if len(out) > 2 else False}
        if len(out) > 2:
            entry["phases"] = out[2]["phases"]  # rank 0's
            entry["read_detail"] = out[2].get("read_detail", {})  # rank 0's: the sums' share
            # every rank's own phases and verification steps, [rank 0, rank 1, ...] each:
            # ``phases`` takes each phase from the slowest rank at it, which overstates the sum
            entry["rank_phases"] = _by_rank([r[2].get("rank_phases", {}) for r in ranks])
            entry["verify_detail"] = _by_rank([r[2].get("verify_detail", {}) for r in ranks])
            entry["direct_items"] = sum(r[2]["direct_items"] for r in ranks)
            entry["stock_items"] = sum(r[2]["stock_items"] for r in ranks)
            entry["device_summed_bytes"] = sum(r[2].get("device_summed_bytes", 0) for r in ranks)
        if dist.get_rank() == 0:
            tag = f" t{entry['load_threads']}" if len(self.args.load_threads) > 1 else ""
            print(f"[bench_load] {source + tag:15s} {cache}: {entry['load_s']:.3f} s "
                  f"({self.on_disk / entry['load_s'] / 1e9:.2f} GB/s, slowest rank "
                  f"{entry['max_over_median']}x the median) bit_exact={entry['bit_exact']}",
                  flush=True)
            if len(ranks) > 1 and entry.get("rank_phases", {}).get("read_s"):
                print(f"[bench_load]   {_spread_line(entry)}", flush=True)
        return entry

    def run(self) -> dict:
        measured, runs = [self.floors()], []
        # a process's first load pays what later ones find done (pinning, first CUDA calls: 3-4x
        # a later load at 4 ranks, docs/node/README.md): timed apart, before the repeats
        self.first = None
        values = self.args.load_threads
        if self.args.first_load:
            source, load = next(iter(self.loaders(values[0]).items()))
            cache = "warm" if "warm" in self.args.caches else self.args.caches[0]
            self.first = self.one_load(source, cache, -1, load, values[0])
        for rep in range(self.args.repeats):
            for cache in self.args.caches:
                for i, threads in enumerate(values):  # ours with each; the others once
                    for source, load in self.loaders(threads).items():
                        if i == 0 or source.startswith("ours"):
                            runs.append(self.one_load(source, cache, rep, load, threads))
            measured.append(self.floors())
        return self.result(measured, runs)

    def _read_threads(self, threads: int | None) -> int:
        return thread_counts(load_read=threads or CkptOptions().ckpt_load_threads).load_read

    def result(self, measured: list[dict], runs: list[dict]) -> dict:
        caps = backend.detect()
        first = self._read_threads(self.args.load_threads[0])
        threads = thread_counts(load_read=first)
        out = {
            "schema": "megatron-ckpt-ext/bench_load/1", "argv": sys.argv,
            "command": node.command_line(self.layout),
            "device": node.describe_device(self.device),
            "world_size": self.layout.world_size,
            "ranks_per_device": self.layout.ranks_per_device,
            "layout": node.layout_json(self.layout),
            "read_chunk_mib": direct_read.DEFAULT_CHUNK >> 20,
            "threads_per_rank": {"cores": threads.cores, "load_read": threads.load_read,
                                 "checksum": threads.checksum, "floor_read": self.args.threads},
            "versions": {"torch": torch.__version__, "megatron-core": caps.mcore_version,
                         "nvidia-resiliency-ext": caps.nvrx_version,
                         "crc32": _crc.IMPLEMENTATION},
            "floors": {k: max(m[k] for m in measured) if measured[0][k] is not None else None
                       for k in ("h2d_pinned_gbps", "read_warm_gbps", "read_cold_gbps",
                                 "read_h2d_warm_gbps")},
            "floor_samples": measured, "runs": runs, "first_load": self.first,
            "device_crc": self.device_crc,
        }
        # the targets are the first --load-threads value's; the others' runs stand beside them
        out["targets"] = targets([r for r in runs if r["load_threads"] in (None, first)],
                                 out["floors"])
        both = out["floors"]["read_h2d_warm_gbps"]  # beside the targets, not one of them
        ours = [r["load_s"] for r in runs if r["variant"] == "ours" and r["cache"] == "warm"
                and r["load_threads"] == first]
        out["targets"]["warm_gbps_over_read_h2d"] = (
            round(self.on_disk / statistics.median(ours) / 1e9 / both, 3) if both and ours
            else None)
        if len(self.args.load_threads) > 1:
            out["by_load_threads"] = {
                str(t): targets([r for r in runs if r["load_threads"] in (None, t)],
                                out["floors"])
                for t in dict.fromkeys(self._read_threads(v) for v in self.args.load_threads)}
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    node.out_dir(args.out)  # before any process group or state exists
    bench = LoadBench(args)
    result = bench.run()
    if dist.get_rank() == 0:
        Path(bench.args.json).write_text(json.dumps(result, indent=1))
        print(json.dumps({"floors": result["floors"], "targets": result["targets"]}))
        shutil.rmtree(bench.root, ignore_errors=True)
    dist.barrier(group=bench.ctl.group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
