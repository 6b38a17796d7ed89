#!/usr/bin/env python3
"""Draw the load benchmark's PNG from its JSON (needs matplotlib: pip install '.[bench]').

    python benchmarks/plot_load.py docs/benchmarks/h100_load_8gib.json [--png OUT.png]

One group of bars per cache state (cold, warm): the load throughput (bytes on disk / seconds,
median over repeats) of each loader, with the floors measured in the same run as lines (the
parallel read of that cache state, and the pinned host-to-device copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

__all__ = ["plot", "throughputs"]

_ORDER = ("ours", "ours_no_verify", "megatron", "torch_dcp")


def throughputs(data: dict) -> dict[tuple[str, str], float]:
    """(variant, cache) -> GB/s, the median over repeats."""
    out: dict[tuple[str, str], list[float]] = {}
    for r in data["runs"]:
        out.setdefault((r["variant"], r["cache"]), []).append(r["bytes_on_disk"] / r["load_s"] / 1e9)
    return {k: statistics.median(v) for k, v in out.items()}


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbps = throughputs(data)
    variants = [v for v in _ORDER if any(k[0] == v for k in gbps)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(variants)
    floors = data["floors"]
    for i, cache in enumerate(("cold", "warm")):
        for j, variant in enumerate(variants):
            x = i + (j - (len(variants) - 1) / 2) * width
            value = gbps.get((variant, cache), 0.0)
            ax.bar(x, value, width, label=variant if i == 0 else None, color=f"C{j}")
            ax.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=8)
        read = floors[f"read_{cache}_gbps"]
        ax.hlines(read, i - 0.45, i + 0.45, colors="k", linestyles="--",
                  label="parallel read floor" if i == 0 else None)
    if floors.get("h2d_pinned_gbps"):
        ax.axhline(floors["h2d_pinned_gbps"], color="r", lw=0.8, label="pinned H2D floor")
    per_rank = data["runs"][0]["state_bytes"] / 2**30
    world = data.get("world_size", 1)
    ranks = f" per rank, {world} ranks ({data.get('ranks_per_device', 1)} per device)" \
        if world > 1 else ""
    ax.set(xticks=[0, 1], xticklabels=["cold (pages dropped)", "warm (page cache)"],
           ylabel="GB/s (all ranks' bytes on disk / load seconds)", yscale="log",
           title=f"load of {per_rank:.1f} GiB{ranks}\n{data['device']}, megatron-core "
                 f"{data['versions'].get('megatron-core')}")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path)
    p.add_argument("--png", type=Path, help="default: the JSON's path with .png")
    args = p.parse_args()
    plot(json.loads(args.json.read_text()), args.png or args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
