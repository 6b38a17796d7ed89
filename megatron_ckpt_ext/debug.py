"""The ``MCX_*`` diagnostic switches and the writer trace (docs/DEBUGGING.md).

Each switch turns one of our speed-ups off, to rule it out when debugging, or traces the writer.
Every switch is registered once in :data:`ENV_SWITCHES` and read only through :func:`env_switch`,
so a misspelt name fails where it is read and ``doctor`` can list those set. Standard library
only: this module is a leaf that anything in the package may import.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

__all__ = ["ENV_SWITCHES", "EnvSwitch", "TRACE_FILE", "env_switch", "non_default_switches",
           "trace_event", "trace_gc", "traced_request"]

TRACE_FILE = "writer_trace.jsonl"


@dataclass(frozen=True)
class EnvSwitch:
    """An ``MCX_*`` environment variable: its value when unset, and what setting it does."""

    name: str
    default: str
    help: str


ENV_SWITCHES: dict[str, EnvSwitch] = {s.name: s for s in (
    EnvSwitch("MCX_SPAWN_IMPORTS_MAIN", "0", "1: spawned writers re-import __main__"),
    EnvSwitch("MCX_KEEP_WRITER_CLONES", "0",
              "1: let nvrx 0.7's writer clone our staged copies again"),
    EnvSwitch("MCX_KEEP_PRELOAD", "0",
              "1: keep the provider's preload where it runs it (megatron-core's host preload, "
              "nvrx's bucket building, which the trainer waits for) even when every tensor is "
              "already staged in copies the save owns"),
    EnvSwitch("MCX_CONVERT_EVERY_SAVE", "0",
              "1: let megatron-core convert every shard into a torch ShardedTensor at every save "
              "(no reuse of the previous save's conversions under a constant structure)"),
    EnvSwitch("MCX_PLAN_AHEAD", "1",
              "0: the first save plans itself (no planning of it ahead in prepare()'s "
              "background thread under a constant structure)"),
    EnvSwitch("MCX_REPLAY_PLAN", "1",
              "0: megatron-core plans every steady save in full (no replay of the request it "
              "planned for the same structure under a constant structure)"),
    EnvSwitch("MCX_RESEND_EACH_SAVE", "0",
              "1: a persistent writer's request pickles its write items and staged tensors in "
              "full at every save (no writer-side keeping under a constant structure)"),
    EnvSwitch("MCX_GC_IN_SAVE", "0",
              "1: Python's cyclic collector may run inside a save (by default it is paused "
              "while save() blocks and catches up after)"),
    EnvSwitch("MCX_STAGE_AHEAD", "1",
              "0: the launcher issues no copies on entry to Megatron-LM's save_checkpoint; each "
              "save stages once its state dict is built (save/ahead.py)"),
    EnvSwitch("MCX_KEEP_CRC32", "0",
              "1: let torch.save compute the CRC-32 of every record the writer writes"),
    EnvSwitch("MCX_WRITE_CHECKSUMS", "1",
              "0: writers record no CRC-32 of the files they write (the integrity manifest then "
              "lists large data files as unverified): to measure what the checksums cost"),
    EnvSwitch("MCX_KEEP_PAGE_CACHE", "0",
              "1: leave a written checkpoint's pages in the page cache (the writer drops them "
              "once fsync'd)"),
    EnvSwitch("MCX_FREEZE_GC_AT_FORK", "1",
              "0: do not gc.freeze() the trainer's objects when the persistent writer is forked "
              "(its full collections then copy the pages the writer shares)"),
    EnvSwitch("MCX_FORK_SKIPS_TENSORS", "1",
              "0: the persistent writer forked for --async-ckpt-use-cpu-shm inherits the pages of "
              "the trainer's CPU tensors (it then keeps a stale copy of each one the trainer "
              "updates: save/fork_memory.py)"),
    EnvSwitch("MCX_PROFILE_SAVES", "",
              "<dir>: run every save() under cProfile and append its 40 costliest functions "
              "(cumulative) to <dir>/save_profile_rank<R>.txt; through the launcher, Megatron's "
              "whole save_checkpoint instead"),
    EnvSwitch("MCX_PROFILE_LOADS", "",
              "<dir>: through the launcher, run Megatron's load_checkpoint under cProfile and "
              "append its 80 costliest functions (cumulative) to <dir>/load_profile_rank<R>.txt"),
    EnvSwitch("MCX_SYNC_POINTS", "",
              "<dir>: run every save() under torch's CUDA sync debug mode and append where it "
              "waited for the device (each synchronizing call's stack, with the phase it fell "
              "in) to <dir>/sync_points_rank<R>.jsonl"),
    EnvSwitch("MCX_PREPARE_RESTORE", "1",
              "0: the launcher does not prepare a restore ahead of the load (no prepare_restore: "
              "the load maps, sums and pins what it restores itself); build: only at Megatron's "
              "model build, not already in its initialisation"),
    EnvSwitch("MCX_RESTORE_SUMS", "host",
              "device: a restore from memory prepared ahead pins every buffer without summing it, "
              "and the load sums the copies on the device, instead of faulting in and summing "
              "every buffer on the host's copy threads ahead"),
    EnvSwitch("MCX_PREFETCH_BLOCK", "auto",
              "cached: the copy ahead of a restore (--ckpt-restore-prefetch) takes torch's own "
              "device block wherever the free memory is 4x its bytes (managed: a CUDA managed "
              "one there), instead of torch's block only where it fits beside the sealing run's "
              "peak, else (with 'on') a managed one"),
    EnvSwitch("MCX_PREPARE_AT_LOAD", "0",
              "1: through the launcher, the first save's staging is prepared as a resume's load "
              "returns (allocated and pinned beside the first training step), not after the "
              "first training step as in a run that starts fresh"),
    EnvSwitch("MCX_PIN_ADOPTED", "step",
              "load: through the launcher, a snapshot restored from memory is pinned beside the "
              "rest of Megatron-LM's load_checkpoint as the load returns, not by the staging's "
              "preparation after the first training step"),
    EnvSwitch("MCX_PIN_PACE", "0.25",
              "<f>: (a share in (0, 1]; 1: no pauses) the background pinning of a snapshot "
              "restored from memory pins one buffer at a time and pauses after each, holding the "
              "driver's lock at most that share of the time, until a save or close waits for it"),
    EnvSwitch("MCX_DEVICE_CRC_TRITON", "1",
              "0: the device CRC-32 of a load's bytes runs as torch operations (slower) instead "
              "of its Triton kernel"),
    EnvSwitch("MCX_WRITER_TRACE", "",
              "<dir>: append each save's preload, write, results hand-back, schedule and commit "
              f"wall times to <dir>/{TRACE_FILE}; through the launcher also Megatron's whole "
              "save_checkpoint and the trainer's collector passes"),
)}


def env_switch(name: str) -> str:
    """The value of the registered switch ``name`` (its default when unset); KeyError for a name
    not in :data:`ENV_SWITCHES`, so a misspelt switch fails where it is read."""
    return os.environ.get(name, ENV_SWITCHES[name].default)


def non_default_switches() -> dict[str, str]:
    """The registered switches set to something other than their default, with their values:
    what ``doctor`` lists, since any of them changes how a save runs."""
    return {name: os.environ[name] for name, switch in ENV_SWITCHES.items()
            if os.environ.get(name, switch.default) != switch.default}


# -- writer trace (MCX_WRITER_TRACE) -------------------------------------------------------------
def traced_request(request: Any, folder: str, *, rank: int) -> Any:
    """``request`` whose preload and write functions append their wall-clock start and end,
    process id and ``rank`` to ``<folder>/writer_trace.jsonl`` from whichever process runs them
    (the persistent worker, a temporal fork, the trainer)."""
    fields: dict[str, Any] = {}
    if request.async_fn is not None:
        fields["async_fn"] = partial(_traced_call, folder, "write", rank, request.async_fn)
    if getattr(request, "preload_fn", None) is not None:
        fields["preload_fn"] = partial(_traced_call, folder, "preload", rank, request.preload_fn)
    return request._replace(**fields)


def trace_event(folder: str | None, what: str, *, rank: int, **fields: Any) -> None:
    """Append one line to ``<folder>/writer_trace.jsonl``; nothing when ``folder`` is empty
    (the trace is off). ``start`` in ``fields`` adds the duration ``s`` up to now."""
    if not folder:
        return
    now = time.time()
    line = {"what": what, "pid": os.getpid(), "rank": rank, "end": now, **fields}
    if "start" in fields:
        line["s"] = round(now - fields["start"], 4)
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / TRACE_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")


_GC_TRACE: dict[str, Any] = {}


def trace_gc(folder: str | None, *, rank: int, min_s: float = 0.001) -> None:
    """Trace every pass of Python's cyclic collector in this process lasting ``min_s`` or more
    (event ``gc``: generation, seconds, objects collected) to ``<folder>/writer_trace.jsonl``:
    a pass stops every thread, so one that falls inside a timed save shows there. Idempotent;
    nothing when ``folder`` is empty."""
    import gc

    if not folder or _GC_TRACE.get("folder") == folder:
        return
    _GC_TRACE.update(folder=folder, rank=rank, min_s=min_s, t0=None)
    if _gc_traced not in gc.callbacks:
        gc.callbacks.append(_gc_traced)


def _gc_traced(phase: str, info: dict) -> None:
    if phase == "start":
        _GC_TRACE["t0"] = time.time()
        return
    start, _GC_TRACE["t0"] = _GC_TRACE.get("t0"), None
    if start is not None and time.time() - start >= _GC_TRACE["min_s"]:
        trace_event(_GC_TRACE["folder"], "gc", rank=_GC_TRACE["rank"], start=start,
                    generation=info.get("generation"), collected=info.get("collected"))


class _TracedQueue:
    """The write-results queue, with each ``put`` traced (the hand-back to the trainer)."""

    def __init__(self, queue: Any, folder: str, rank: int) -> None:
        self._queue, self._folder, self._rank = queue, folder, rank

    def put(self, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return self._queue.put(*args, **kwargs)
        finally:
            trace_event(self._folder, "results_put", rank=self._rank, start=start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def _traced_call(folder: str, what: str, rank: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Also records this thread's CPU seconds, page faults and context switches over the call:
    CPU close to the wall time means the write is bound by copying, not by the disk."""
    start, before = time.time(), _thread_usage()
    if what == "write" and args and hasattr(args[-1], "put"):
        args = (*args[:-1], _TracedQueue(args[-1], folder, rank))
    try:
        return fn(*args, **kwargs)
    finally:
        after = _thread_usage()
        trace_event(folder, what, rank=rank, start=start,
                    **{k: round(after[k] - before[k], 4) for k in after})


def _thread_usage() -> dict[str, float]:
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    u = resource.getrusage(who)
    return {"cpu_s": u.ru_utime + u.ru_stime, "sys_s": u.ru_stime, "minflt": u.ru_minflt,
            "majflt": u.ru_majflt, "nvcsw": u.ru_nvcsw, "nivcsw": u.ru_nivcsw}


# -- save profile (MCX_PROFILE_SAVES) ------------------------------------------------------------
_profiling = threading.local()


def profiled(folder: str, label: str, rank: int, fn: Any, *args: Any, stem: str = "save_profile",
             lines: int = 40, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under cProfile; its ``lines`` costliest functions (cumulative)
    appended to ``<folder>/<stem>_rank<rank>.txt`` under ``label``. Inside another profiled call
    (the launcher profiles Megatron's whole ``save_checkpoint``, which calls our save) ``fn``
    just runs: the outer profile covers it, and Python allows one profiler at a time."""
    import cProfile
    import io
    import pstats

    if getattr(_profiling, "on", False):
        return fn(*args, **kwargs)
    prof = cProfile.Profile()
    _profiling.on = True
    try:
        return prof.runcall(fn, *args, **kwargs)
    finally:
        _profiling.on = False
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(lines)
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"{stem}_rank{rank}.txt", "a", encoding="utf-8") as fh:
            fh.write(f"==== {label}\n{out.getvalue()}\n")
