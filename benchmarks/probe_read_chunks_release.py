"""Whether the storage read's kept host chunks (``backend/direct_read.py: PinnedChunks``) go
back to the system when released (``release_shared``, called at a job's first commit after its
load): this process's Rss (MiB) before the chunks are made, once made (pinned) and after the
release, and which torch call handed the cached pinned blocks back (None: torch keeps them).

    python3 benchmarks/probe_read_chunks_release.py --count 24
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ckpt_ext.backend import direct_read  # noqa: E402


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=24)
    a = p.parse_args()
    torch.zeros(1, device="cuda")
    out = {"count": a.count, "chunk_mib": direct_read.DEFAULT_CHUNK >> 20, "before": rss_mib()}
    pool = direct_read.PinnedChunks.shared(a.count, pin=True)
    pool.make_ahead()
    out["made"] = rss_mib()
    out["released"] = direct_read.PinnedChunks.release_shared()
    del pool
    out["after_release"] = rss_mib()
    out["empty_cache_call"] = next((n for n in ("_host_emptyCache", "_accelerator_emptyHostCache")
                                    if hasattr(torch._C, n)), None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
