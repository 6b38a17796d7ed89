"""One save's record (what must stay alive until its commit, and its timings) and the report
entry built from it at the commit: appended to ``Checkpointer.reports``, logged and written to
``<root>/ckpt_report.jsonl`` on rank 0."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .. import _clock
from .._runtime import rank
from .layout import REPORT

__all__ = ["PHASES", "Held", "SaveRecord", "gather", "log_report", "report_entry"]

logger = logging.getLogger(__name__)

# The steps of save() timed in every report (max over ranks), in order: waiting for the previous
# save's commit, creating the .incomplete directory (a barrier), staging (device-to-host copies),
# megatron-core's planning (dist_checkpointing.save: metadata exchange, write buckets), and handing
# the request to the writer (async) or writing and committing it (sync).
PHASES = ("wait_previous_s", "wait_prepare_s", "prepare_dir_s", "stage_s", "plan_s", "schedule_s",
          "copy_wait_s", "write_commit_s")


@dataclass
class Held:
    """What one save keeps alive until its write is done: the staging buffers handed to the
    writer (released at the commit, or when the save is abandoned), and what the hand-over and
    the overlapped snapshot track of them. Nothing here is a figure of the report."""

    batch: Any = None  # the StagedBatch whose buffers the writer reads
    snapshots: frozenset = frozenset()  # storage pointers of this save's staged copies
    seq: int = 0  # published in the stager's ready flag when the staged copies are complete
    copies: list = field(default_factory=list)  # device copies in flight (overlapped snapshot)

    def release(self) -> None:
        if self.batch is not None and hasattr(self.batch, "release"):
            self.batch.release()
        self.batch = None


_GC = {"s": 0.0, "n": 0, "t0": None}  # the collector's pauses in this process, summed


def _gc_pause(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["t0"] = time.perf_counter()
    elif _GC["t0"] is not None:
        _GC["s"] += time.perf_counter() - _GC["t0"]
        _GC["n"] += 1
        _GC["t0"] = None


@contextlib.contextmanager
def gc_pauses(record: Any, *, defer: bool = True) -> Iterator[None]:
    """While inside: Python's cyclic collector is paused (``defer``; the collections the save's
    own allocations would trigger run after it, in one pass), and any collection that still
    runs (an explicit ``gc.collect()``; every collection with ``defer=False``) is summed into
    ``record.detail`` (``gc_pause_s``, ``gc_collections``; ``record`` None: not counted): it
    stops every thread of the process (what it cost a save: docs/notes/megatron_lm.md)."""
    if _gc_pause not in gc.callbacks:
        gc.callbacks.append(_gc_pause)
    seconds, count = _GC["s"], _GC["n"]
    paused = defer and gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()
        if record is not None and _GC["n"] > count:
            record.detail.update(gc_pause_s=_GC["s"] - seconds, gc_collections=_GC["n"] - count)


@dataclass
class SaveRecord:
    """One save in flight: its identity, the decisions every rank agreed on, what it holds
    alive (``held``), and the figures its report is built from."""

    iteration: int
    root: Path
    started: float
    held: Held = field(default_factory=Held)
    running_at_start: float = field(default_factory=_clock.running)  # --ckpt-timeout's start
    new_structure: bool = True  # some rank's structure is new: re-plan
    validate: bool = True  # some rank's sharding is not validated yet (prepare() may have)
    # the report's figures
    blocking_s: float = 0.0
    nbytes: int = 0
    staging_s: float = 0.0
    mode: str = ""
    host_bytes: int = 0  # host memory holding this save's staged copies (shm or plain)
    phases: dict = field(default_factory=dict)  # seconds per step of save(), see PHASES
    # this rank's breakdown of stage_s (admission, waiting for prepare(), allocation, pinning),
    # and the collector's pauses inside the blocking part (gc_pause_s, gc_collections)
    detail: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def release(self) -> None:
        """The save is over (committed or abandoned): what it held goes back."""
        self.held.release()

    def phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - since
        return now

    def local_stats(self, now: float) -> list[float]:
        """This rank's figures in the order :func:`report_entry` reads their max over ranks."""
        return [now - self.started, self.blocking_s, self.staging_s, float(self.host_bytes),
                float(self.nbytes), *(self.phases.get(name, 0.0) for name in PHASES)]


def gather(record: SaveRecord, group: Any) -> dict:
    """Collective: the max over ranks of this save's times and sizes and the sum of its bytes
    (the commit's first barrier: no extra synchronisation). ``group``: a
    :class:`~megatron_ckpt_ext.collectives.Group`."""
    now = time.perf_counter()
    local = record.local_stats(now)
    if not group.initialized():
        return {"max": local, "bytes_total": record.nbytes, "world": 1, "at": now}
    stats = group.all_max(local)
    total = group.all_sum([float(record.nbytes)])
    return {"max": stats, "bytes_total": int(total[0]), "world": group.size(), "at": now}


def report_entry(record: SaveRecord, ranks: dict, *, is_async: bool) -> dict:
    """The report of ``record``'s committed save from the figures gathered over ranks (``max``:
    :meth:`SaveRecord.local_stats` maxed, ``bytes_total``, ``world``, ``at``)."""
    # Every figure is the slowest rank's: durable is the slowest rank's time from its save()
    # call to the commit's first collective, plus the commit itself (rename, tracker, barrier).
    elapsed, blocking, staging, host, nbytes_max, *phases = ranks["max"]
    durable = elapsed + time.perf_counter() - ranks["at"]
    if not is_async:
        blocking = durable
    write_s = max(durable - blocking, 1e-9) if is_async else max(
        phases[PHASES.index("write_commit_s")], 1e-9)
    entry = {
        "iteration": record.iteration, "mode": record.mode, "world": ranks["world"],
        "bytes": record.nbytes, "bytes_total": ranks["bytes_total"],
        "blocking_s": round(blocking, 6), "staging_s": round(staging, 6),
        "staging_gbps": _sig(nbytes_max / staging / 1e9) if staging > 0 else None,
        "durable_s": round(durable, 6),
        # the writer's time after save() returned until the commit (async: bounded below by
        # how often the trainer calls maybe_finalize), as aggregate GB/s of all ranks
        "write_gbps": _sig(ranks["bytes_total"] / write_s / 1e9),
        "host_extra_bytes": int(host),
        "phases": {name: round(v, 6) for name, v in zip(PHASES, phases)},
        # rank 0's own: what stage_s spent beyond the copies (not maxed over ranks)
        "stage_detail": {k: round(v, 6) if isinstance(v, float) else v
                         for k, v in record.detail.items()},
    }
    return entry


def log_report(record: SaveRecord, entry: dict, ranks: dict) -> None:
    """Rank 0: log ``entry`` in one line and append it to the root's report file."""
    if rank() != 0:
        return
    nbytes_max, host = ranks["max"][4], ranks["max"][3]
    slowest = max(PHASES, key=lambda n: entry["phases"][n])
    logger.info("checkpoint iter %d committed: %s, %.1f MB/rank, blocking %.3f s (most in "
                "%s %.3f s), staging %.3f s, durable %.3f s, write %.2f GB/s, host extra "
                "%.1f MB", record.iteration, record.mode, nbytes_max / 1e6,
                entry["blocking_s"], slowest[:-2], entry["phases"][slowest],
                entry["staging_s"], entry["durable_s"], entry["write_gbps"], host / 1e6)
    try:
        with open(record.root / REPORT, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")
    except OSError as e:  # the checkpoint is committed: a report line is not worth failing it
        logger.warning("checkpoint iter %d is committed, but its line could not be appended to "
                       "%s (%s: %s)", record.iteration, record.root / REPORT, type(e).__name__, e)


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (a tiny test state's GB/s stays non-zero)."""
    return float(f"{x:.{digits}g}")
