#!/usr/bin/env python3
"""Draw the checkpoint benchmark's PNG from its JSON (needs matplotlib: pip install '.[bench]').

    python benchmarks/plot_bench.py docs/benchmarks/h100.json [--png OUT.png]

Left: blocking time (training stall) per save, one line per mode, at the largest state size, with
the pinned D2H floor. Right: steady-state blocking (median of save 3 onward) against state size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

__all__ = ["plot"]

GIB = 1 << 30
_STYLE = {"megatron": "--", "torch_dcp": ":", "ours": "-"}


def _by_mode(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(r["mode"], []).append(r)
    return out


def _per_save(ax, runs: list[dict]) -> None:
    largest = max(r["state_bytes"] for r in runs)
    at_size = [r for r in runs if r["state_bytes"] == largest]
    for mode, rs in _by_mode(at_size).items():
        rs = sorted(rs, key=lambda r: r["save_index"])
        ax.plot([r["save_index"] for r in rs], [r["blocking_s"] for r in rs], _STYLE[rs[0]["source"]],
                marker="o", label=mode)
    ax.axhline(at_size[0]["floor_d2h_s"], color="k", lw=0.8, label="D2H floor (bytes / pinned GB/s)")
    ax.set(yscale="log", xlabel="save #", ylabel="blocking (s, log)",
           title=f"stall per save, {at_size[0]['size']} per rank")
    ax.legend(fontsize=6)


def _vs_size(ax, runs: list[dict]) -> None:
    for mode, rs in _by_mode(runs).items():
        points = []
        for nbytes in sorted({r["state_bytes"] for r in rs}):
            steady = [r["blocking_s"] for r in rs if r["state_bytes"] == nbytes and r["save_index"] >= 3]
            if steady:
                points.append((nbytes / GIB, statistics.median(steady)))
        if points:
            ax.plot(*zip(*points), _STYLE[rs[0]["source"]], marker="o", label=mode)
    floors = sorted({(r["state_bytes"] / GIB, r["floor_d2h_s"]) for r in runs})
    ax.plot(*zip(*floors), color="k", lw=0.8, label="D2H floor")
    ax.set(yscale="log", xlabel="state per rank (GiB)", ylabel="steady blocking, saves 3.. (s, log)",
           title="stall vs state size")
    ax.legend(fontsize=6)


def plot(json_path: str | Path, png_path: str | Path | None = None) -> Path:
    """Write the PNG next to the JSON (or to ``png_path``); returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("plotting needs matplotlib: pip install 'megatron-ckpt-ext[bench]' "
                         "(or pip install matplotlib)") from e
    result = json.loads(Path(json_path).read_text())
    if not result["runs"]:
        raise SystemExit(f"{json_path} holds no runs to plot")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    _per_save(left, result["runs"])
    _vs_size(right, result["runs"])
    fig.suptitle(f"{result['device']}; torch {result['versions']['torch']}, megatron-core "
                 f"{result['versions']['megatron-core']}, nvrx {result['versions']['nvrx']}",
                 fontsize=8)
    fig.tight_layout()
    out = Path(png_path) if png_path else Path(json_path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    print(plot(args.json, args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
