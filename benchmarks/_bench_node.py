"""The node a benchmark runs on: where each rank runs (one device per rank, or N ranks sharing a
device), the process groups, and the floors measured with every rank acting at once.

``--ranks-per-device N`` puts N ranks (each its own process) on one device: on CUDA rank
``local_rank`` uses device ``local_rank // N`` with ``1/N`` of its memory, and the default
process group is gloo (NCCL cannot join two ranks of one device). ``auto`` (the default) takes
as many ranks per device as the host's GPUs require: 8 ranks on one GPU share it, 8 ranks on 8
GPUs get one each (NCCL), with the same command line. On CPU every rank shares the host.

A floor "with all ranks at once" is timed on every rank after a barrier: the per-rank figures are
what each rank got while the others did the same, the aggregate is the bytes of all ranks over
the slowest rank's seconds.
"""

from __future__ import annotations

import math
import os
import platform
import shlex
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Ctl", "Layout", "add_ranks_per_device", "all_at_once", "command_line", "d2h_floor",
           "describe_device", "device_of", "h2d_floor", "init", "layout_json",
           "parse_ranks_per_device", "read_floor", "resolve_layout", "spread", "write_floor"]

# -- layout --------------------------------------------------------------------------------------
def parse_ranks_per_device(text: str) -> int | None:
    """``--ranks-per-device``: a positive integer, or ``auto`` (None)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--ranks-per-device must be 'auto' or an integer >= 1, got {text!r}")
    return value


def positive(kind: type) -> Any:
    """An argparse ``type=``: a number of ``kind`` above 0 (a size, a count), else the usage
    error naming it (a size of -1 GiB or 0 repeats ran, or failed at the end)."""
    import argparse

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a number above 0")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def writable_file(text: str) -> str:
    """An argparse ``type=`` for a result file: its directory must exist and be writable now,
    not at the end of the run."""
    import argparse

    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: {folder} is no writable directory")
    return text


def out_dir(path: str, flag: str = "--out") -> None:
    """Make the run's checkpoint root ``path`` and write a file into it once (removed), before
    any process group or state exists; one line naming ``flag`` and the fix where it cannot
    (a checkpoint root the save could not write failed later as every rank's traceback)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".mcx-probe-"):
            pass
    except OSError as e:
        raise SystemExit(f"{flag} {path}: cannot be written ({e.strerror}): point {flag} at a "
                         "writable directory") from None


def add_ranks_per_device(parser: Any) -> None:
    """``--ranks-per-device N|auto`` on an argparse parser (parsed: an int, or None for auto)."""
    import argparse

    def parse(text: str) -> int | None:
        try:
            return parse_ranks_per_device(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    parser.add_argument("--ranks-per-device", type=parse, default="auto", metavar="N|auto",
                        help="ranks (each its own process) sharing one device, each with 1/N of "
                        "its memory, the default group over gloo; auto: as many as the visible "
                        "GPUs require (one GPU per rank, over NCCL, where there are enough)")


@dataclass(frozen=True)
class Layout:
    """Where this rank runs: ``ranks_per_device`` ranks share each device used."""

    world_size: int
    local_world_size: int
    ranks_per_device: int
    device_type: str  # "cuda" | "cpu"
    device_index: int | None  # this rank's CUDA device
    devices_used: int
    backend: str  # the default process group's

    def describe(self) -> str:
        if self.device_type == "cpu":
            return f"{self.world_size} ranks on the host CPU ({self.backend})"
        if self.ranks_per_device == 1:
            return f"{self.world_size} ranks, one CUDA device each ({self.backend})"
        return (f"{self.world_size} ranks, {self.ranks_per_device} per CUDA device on "
                f"{self.devices_used} device(s), each with 1/{self.ranks_per_device} of its "
                f"memory ({self.backend})")


def resolve_layout(device_type: str, ranks_per_device: int | None, *, local_rank: int,
                   local_world: int, world: int, cuda_count: int) -> Layout:
    """The layout of ``local_world`` ranks on this host; a layout that cannot run raises
    ValueError naming the flag and the value that would."""
    if device_type == "cpu":
        if ranks_per_device not in (None, local_world):
            raise ValueError(f"--ranks-per-device {ranks_per_device}: on CPU the host's "
                             f"{local_world} local rank(s) share it; pass {local_world} or auto")
        return Layout(world, local_world, local_world, "cpu", None, 1, "gloo")
    if cuda_count < 1:
        raise ValueError("--device cuda: no CUDA device is visible; pass --device cpu")
    fit = math.ceil(local_world / cuda_count)
    per = fit if ranks_per_device is None else ranks_per_device
    if math.ceil(local_world / per) > cuda_count:
        raise ValueError(f"--ranks-per-device {per}: {local_world} local ranks need "
                         f"{math.ceil(local_world / per)} CUDA devices, {cuda_count} visible; "
                         f"pass --ranks-per-device {fit} (or auto)")
    sharing = min(per, local_world)  # ranks actually on one device
    return Layout(world, local_world, sharing, "cuda", local_rank // per,
                  math.ceil(local_world / per), "gloo" if sharing > 1 else "nccl")


def layout_json(layout: Layout) -> dict:
    return {"world_size": layout.world_size, "local_world_size": layout.local_world_size,
            "ranks_per_device": layout.ranks_per_device, "devices_used": layout.devices_used,
            "device_type": layout.device_type, "process_group": layout.backend,
            "text": layout.describe()}


def _single_process_env() -> None:
    """A plain ``python bench.py`` is a world of one on localhost (torchrun's variables kept)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def init(device_type: str, ranks_per_device: int | None, timeout_min: float) -> Layout:
    """This rank's device and the default process group, per :func:`resolve_layout`; a CUDA rank
    sharing its device is held to its share of the memory."""
    _single_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda_count = torch.cuda.device_count() if device_type == "cuda" else 0
    try:
        layout = resolve_layout(device_type, ranks_per_device, local_rank=local_rank,
                                local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                world=int(os.environ["WORLD_SIZE"]), cuda_count=cuda_count)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if layout.device_index is not None:
        torch.cuda.set_device(layout.device_index)
        if layout.ranks_per_device > 1:
            torch.cuda.set_per_process_memory_fraction(1 / layout.ranks_per_device,
                                                       layout.device_index)
    dist.init_process_group(layout.backend, timeout=timedelta(minutes=timeout_min))
    return layout


def device_of(layout: Layout) -> torch.device:
    if layout.device_index is None:
        return torch.device("cpu")
    return torch.device("cuda", layout.device_index)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (x{torch.cuda.device_count()} visible)"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def command_line(layout: Layout) -> str:
    """The command that started this run: torchrun's per-node form where it launched it."""
    script = sys.argv[:]  # as typed
    if "TORCHELASTIC_RUN_ID" in os.environ or layout.world_size > 1:
        launcher = ["torchrun", "--nproc-per-node", str(layout.local_world_size)]
        if layout.world_size > layout.local_world_size:
            launcher[1:1] = ["--nnodes", str(layout.world_size // layout.local_world_size)]
    else:
        launcher = ["python"]
    return shlex.join(launcher + script)


# -- agreement outside the timings ---------------------------------------------------------------
class Ctl:
    """A gloo group for the benchmark's own agreement (max over ranks, errors), outside timings."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.group)
        return out


def all_at_once(ctl: Ctl, fn: Callable[[], Any], reps: int = 1) -> list[float]:
    """Seconds of ``fn()`` on every rank (rank order), all ranks started by one barrier; over
    ``reps`` rounds, the round whose slowest rank was fastest."""
    best: list[float] | None = None
    for _ in range(reps):
        ctl.barrier()
        t0 = time.perf_counter()
        fn()
        seconds = ctl.gather(time.perf_counter() - t0)
        if best is None or max(seconds) < max(best):
            best = seconds
    return best or []


def spread(values: list[float], digits: int = 6) -> dict:
    """Per-rank values with their median, max and max/median (the slowest rank against the
    median one: 1.0 when all ranks took the same time)."""
    mid = statistics.median(values)
    return {"per_rank": [round(v, digits) for v in values], "median": round(mid, digits),
            "max": round(max(values), digits),
            "max_over_median": round(max(values) / mid, 3) if mid else None}


# -- floors, all ranks at once -------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_floor(ctl: Ctl, src: torch.Tensor, dst: torch.Tensor, reps: int) -> dict:
    device = src.device if src.is_cuda else dst.device
    nbytes = src.numel()

    def copy() -> None:
        dst.copy_(src, non_blocking=device.type == "cuda")
        _sync(device)

    copy()  # a warm-up (page faults, first-touch) outside the clock
    seconds = all_at_once(ctl, copy, reps)
    return {"per_rank_gbps": [round(nbytes / s / 1e9, 3) for s in seconds],
            "slowest_rank_gbps": round(nbytes / max(seconds) / 1e9, 3),
            "aggregate_gbps": round(nbytes * len(seconds) / max(seconds) / 1e9, 3),
            "seconds": spread(seconds), "bytes_per_rank": nbytes}


def d2h_floor(ctl: Ctl, device: torch.device, nbytes: int, reps: int = 5) -> dict:
    """Device-to-host copy into pinned memory (cuda), or a host memcpy (cpu), every rank
    copying at once."""
    src = torch.randint(1, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out = _copy_floor(ctl, src, dst, reps)
    del src, dst
    release_cached(device)
    return out


def h2d_floor(ctl: Ctl, device: torch.device, nbytes: int, reps: int = 2) -> dict | None:
    """Pinned host-to-device copy, every rank copying at once (None without a device)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = _copy_floor(ctl, src, dst, reps)
    del src, dst
    release_cached(device)
    return out


def release_cached(device: torch.device) -> None:
    """Give a floor's buffers back: torch keeps freed pinned host blocks and device blocks cached
    (a state-sized floor would otherwise hold its bytes through the timed runs)."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    empty = (getattr(torch._C, "_host_emptyCache", None)
             or getattr(torch._C, "_accelerator_emptyHostCache", None))
    if empty is not None:
        empty()


def write_floor(ctl: Ctl, directory: Path, nbytes: int, streams: int) -> dict:
    """Every rank writes ``nbytes`` in ``streams`` threads, fsync'd, all at once; the files are
    left for :func:`read_floor`."""
    directory.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(min(64 << 20, max(1, nbytes // streams)))
    per_stream = nbytes // streams
    rank = dist.get_rank()

    def write(i: int) -> None:
        with open(directory / f"floor_{rank}_{i}.bin", "wb") as fh:
            left = per_stream
            while left > 0:
                left -= fh.write(chunk[:left])
            fh.flush()
            os.fsync(fh.fileno())

    seconds = all_at_once(ctl, lambda: _in_threads(write, streams))
    total = per_stream * streams * len(seconds)
    return {"aggregate_gbps": round(total / max(seconds) / 1e9, 3), "seconds": spread(seconds),
            "bytes_total": total, "streams_per_rank": streams}


def read_floor(ctl: Ctl, directory: Path, streams: int) -> dict:
    """Every rank reads back its own :func:`write_floor` files with their pages dropped first
    (a cold read), all at once."""
    paths = sorted(directory.glob(f"floor_{dist.get_rank()}_*.bin"))
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass

    seconds = all_at_once(ctl, lambda: _in_threads(read, len(paths)))
    total = sum(ctl.gather(sum(p.stat().st_size for p in paths)))
    return {"aggregate_gbps": round(total / max(seconds) / 1e9, 3), "seconds": spread(seconds),
            "bytes_total": total}


def _in_threads(fn: Callable[[int], None], count: int) -> None:
    """``fn(0) .. fn(count - 1)``, each on its own thread; the first error raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
