"""``python -m megatron_ckpt_ext shm list|clean``: the sealed memory snapshots this node holds
(whose, which iteration, how old, how many bytes, whether a running job maps it) and our other
/dev/shm segments; ``clean`` removes the snapshots of runs that have ended and the segments no
live process maps (a running job's snapshot is left to it: a prolog or epilog may run it)."""

from __future__ import annotations

import os
import sys
import time

from .staging import SHM_DIR, sweep_orphans
from .staging.retained import any_mapped, clean, list_seals
from .staging.segments import SEGMENT_PREFIX, is_mapped

__all__ = ["run"]


def run(action: str, *, shm_dir: str = SHM_DIR) -> int:
    if not os.path.isdir(shm_dir):
        print(f"{shm_dir}: no such directory (--dir names the shared-memory directory; the "
              f"default is {SHM_DIR})", file=sys.stderr)
        return 2
    if action == "clean":
        seals, segments, in_use = clean(shm_dir, is_mapped=is_mapped)
        orphans = sweep_orphans(shm_dir=shm_dir)
        print(f"removed {len(seals)} sealed snapshot(s), {len(segments)} of their segments and "
              f"{len(orphans)} orphaned segment(s) from {shm_dir}"
              + (f"; left {len(in_use)} sealed snapshot(s) of running jobs (their segments are "
                 f"mapped: {', '.join(sorted({s.root for s in in_use}))})" if in_use else ""))
        return 0
    seals = list_seals(shm_dir)
    now = time.time()
    for seal in seals:
        present = sum(1 for e in seal.entries if e.path is None or os.path.exists(e.path))
        print(f"{seal.root}  iteration {seal.iteration}  rank {seal.rank}/{seal.world}  "
              f"{seal.nbytes / 1e6:.1f} MB  age {now - seal.created:.0f} s  "
              f"sealed by pid {seal.pid} on {seal.host}  segments {present}/{len(seal.entries)}"
              + (f"  partner copy from {seal.replica_of}" if seal.replica_of else "")
              + ("  in use (a running job maps it)" if any_mapped(seal, is_mapped) else ""))
    sealed = {e.path for s in seals for e in s.entries if e.path}
    others = _other_segments(shm_dir, sealed)
    print(f"{len(seals)} sealed snapshot(s), {sum(s.nbytes for s in seals) / 1e6:.1f} MB; "
          f"{len(others)} other segment(s) of ours, {sum(others.values()) / 1e6:.1f} MB "
          f"(staging of live runs, or leftovers the next start sweeps) in {shm_dir}")
    return 0


def _other_segments(shm_dir: str, sealed: set[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return out
    for name in names:
        path = os.path.join(shm_dir, name)
        if name.startswith(SEGMENT_PREFIX) and path not in sealed:
            try:
                out[path] = os.stat(path).st_size
            except OSError:
                pass
    return out
