"""The report of a load, like a save's: bytes, seconds, phases, the slowest rank; one rank-0
line and one JSON line in the log, and an entry in ``Checkpointer.load_reports``."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from .._runtime import rank

__all__ = ["LOAD_PHASES", "LoadRecord", "log_load"]

logger = logging.getLogger(__name__)

# locate: tracker and completeness checks; verify: the manifest check of this rank's share of
# the files; load: megatron-core's load (read and host-to-device).
LOAD_PHASES = ("locate_s", "verify_s", "load_s")


@dataclass
class LoadRecord:
    root: Path
    started: float = field(default_factory=time.perf_counter)
    iteration: int | None = None
    path: Path | None = None
    verified: bool = False
    fell_back_from: int | None = None
    phases: dict = field(default_factory=dict)

    def phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - since
        return now

    def entry(self, group) -> dict:
        """Collective: the report with each figure the slowest rank's."""
        local = [time.perf_counter() - self.started,
                 *(self.phases.get(name, 0.0) for name in LOAD_PHASES)]
        total, *phases = group.all_max(local)
        nbytes = sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
        return {"iteration": self.iteration, "path": str(self.path), "bytes": nbytes,
                "load_s": round(total, 6), "gbps": round(nbytes / max(total, 1e-9) / 1e9, 4),
                "verified": self.verified, "fell_back_from": self.fell_back_from,
                "world": group.size(),
                "phases": {n: round(v, 6) for n, v in zip(LOAD_PHASES, phases)}}


def log_load(entry: dict) -> None:
    if rank() != 0:
        return
    logger.info("checkpoint iter %s loaded from %s: %.1f MB in %.3f s (%.2f GB/s; verify %.3f s, "
                "megatron-core load %.3f s)%s", entry["iteration"], entry["path"],
                entry["bytes"] / 1e6, entry["load_s"], entry["gbps"],
                entry["phases"]["verify_s"], entry["phases"]["load_s"],
                "" if entry["verified"] else ", not verified (no manifest, or verification off)")
    logger.info("checkpoint load report: %s", json.dumps(entry))
