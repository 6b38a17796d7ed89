"""The report of a load, like a save's: bytes, seconds, phases, the slowest rank; one rank-0
line and one JSON line in the log, and an entry in ``Checkpointer.load_reports``."""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .._runtime import rank

__all__ = ["LOAD_PHASES", "LoadRecord", "log_load"]

logger = logging.getLogger(__name__)

# locate: tracker and completeness checks; metadata: where each item's bytes are (the items'
# headers); read and h2d: the items' bytes into their targets, file reads and host-to-device
# copies (they overlap chunk by chunk across the reading threads: the step's time is split in
# proportion to the threads' time in each); verify: the part of the manifest check the load did
# not hide; other: the rest of megatron-core's load (its metadata file, planning, collectives).
# memory: a restore from the node's sealed snapshot (or the look for one that failed);
# prepare_save: after the load, the next save's staging and planning started (Checkpointer.prepare:
# the node admission on its first call; the rest in the background).
LOAD_PHASES = ("locate_s", "memory_s", "metadata_s", "read_s", "h2d_s", "verify_s", "other_s",
               "prepare_save_s")


@dataclass
class LoadRecord:
    root: Path
    started: float = field(default_factory=time.perf_counter)
    iteration: int | None = None
    path: Path | None = None
    verified: bool = False
    fell_back_from: int | None = None
    tier: str = "storage"  # or "memory": restored from the node's sealed snapshot
    memory_bytes: int = 0
    memory_steps: dict = field(default_factory=dict)  # this rank's steps of the memory tier
    memory_detail: dict = field(default_factory=dict)  # its copy: threads, pieces, step times
    phases: dict = field(default_factory=dict)
    direct_items: int = 0  # items read straight into their targets
    stock_items: int = 0  # items read the stock way (unpickled, then copied)
    device_summed_bytes: int = 0  # verified by the device's CRC where they landed (not the host)
    # of the read step: waiting for the sums after the last read (sums_wait_s), and the
    # device-sum thread's seconds at work beside the reads (sum_device_busy_s)
    read_detail: dict = field(default_factory=dict)
    # of verify_s: settle_s (learning which files every rank's reads summed: a collective, so
    # it holds this rank until the slowest rank's reads are done), check_s (this rank's share
    # of the files no read summed, and the join of its check), agree_s (the verdict collective)
    verify_detail: dict = field(default_factory=dict)

    def phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - since
        return now

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """The phase ``name`` (in LOAD_PHASES) takes the time of the ``with`` block."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phase(name, t)

    def add_reads(self, metadata_s: float, read_s: float, h2d_s: float, *, direct_items: int,
                  stock_items: int, device_summed_bytes: int = 0, sums_wait_s: float = 0.0,
                  sum_device_busy_s: float = 0.0) -> None:
        """The reader's steps of megatron-core's load, taken out of its ``other_s``, how many
        items it read directly and the stock way, and what the sums held of the read step."""
        for name, seconds in (("metadata_s", metadata_s), ("read_s", read_s), ("h2d_s", h2d_s)):
            self.phases[name] = self.phases.get(name, 0.0) + seconds
            self.phases["other_s"] = self.phases.get("other_s", 0.0) - seconds
        self.direct_items += direct_items
        self.stock_items += stock_items
        self.device_summed_bytes += device_summed_bytes
        for name, seconds in (("sums_wait_s", sums_wait_s),
                              ("sum_device_busy_s", sum_device_busy_s)):
            self.read_detail[name] = round(self.read_detail.get(name, 0.0) + seconds, 6)

    def entry(self, group) -> dict:
        """Collective: the report with each figure the slowest rank's."""
        local = [time.perf_counter() - self.started,
                 *(self.phases.get(name, 0.0) for name in LOAD_PHASES)]
        total, *phases = group.all_max(local)
        nbytes = sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
        return {"iteration": self.iteration, "path": str(self.path), "bytes": nbytes,
                "load_s": round(total, 6), "gbps": round(nbytes / max(total, 1e-9) / 1e9, 4),
                "verified": self.verified, "fell_back_from": self.fell_back_from,
                "tier": self.tier, "memory_bytes": self.memory_bytes,
                "memory_steps": self.memory_steps,
                "memory_detail": self.memory_detail,
                "world": group.size(), "direct_items": self.direct_items,
                "stock_items": self.stock_items,
                "device_summed_bytes": self.device_summed_bytes,
                "read_detail": self.read_detail,
                "verify_detail": self.verify_detail,
                "phases": {n: round(v, 6) for n, v in zip(LOAD_PHASES, phases)},
                # this rank's own (``phases`` takes each from the slowest rank at it, so a rank
                # whose reads ended first shows its wait for the others under verify_s here)
                "rank_phases": {n: round(self.phases.get(n, 0.0), 6) for n in LOAD_PHASES}}


def log_load(entry: dict) -> None:
    if rank() != 0:
        return
    ph = entry["phases"]
    logger.info("checkpoint iter %s loaded from %s: %.1f MB in %.3f s (%.2f GB/s; metadata %.3f s, "
                "read %.3f s, host-to-device %.3f s, verify %.3f s, other %.3f s)%s",
                entry["iteration"], entry["path"], entry["bytes"] / 1e6, entry["load_s"],
                entry["gbps"], ph["metadata_s"], ph["read_s"], ph["h2d_s"], ph["verify_s"],
                ph["other_s"],
                "" if entry["verified"] else ", not verified (no manifest, or verification off)")
    logger.info("checkpoint load report: %s", json.dumps(entry))
