#!/usr/bin/env python3
"""The restarts of restart_repeat_s28.sh (one JSON line each) as issue 32's results JSON: one
entry per restart in ``runs`` (source, tier, cache, bytes, load_s, model, with Megatron's setup
timer, the mode and the call), medians per (model, mode), the floors (the twenty-eighth
session's first call, or ``--floors``).

    python docs/megatron_lm/steps/restart_repeat_summary.py --out docs/memory/h200_restart_s28.json \\
        docs/megatron_lm/steps/restart_repeat_s28/*.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tarfile
from pathlib import Path

# the same machine kind, the session's first call (restore_sums_ab_s28/h200_134m_sums_*.txt)
FLOORS = {"h2d_pinned_gbps": [54.62, 55.06], "d2h_pinned_gbps": [54.83, 54.88],
          "source": "docs/megatron_lm/steps/restore_sums_ab_s28/h200_134m_sums_*.txt (134M state)"}


def _bytes_by_log(archive: Path) -> dict[str, int]:
    """Each restart log's restored bytes (its load report's ``bytes``), by the log's name."""
    out: dict[str, int] = {}
    if not archive.exists():
        return out
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.name.endswith(".log"):
                continue
            text = tar.extractfile(member).read().decode(errors="replace")
            found = re.findall(r'checkpoint load report: \{"iteration": \d+, "path": "[^"]*", '
                               r'"bytes": (\d+)', text)
            if found:
                out[Path(member.name).stem] = int(found[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lines", nargs="+", type=Path, help="restart_repeat JSON-lines files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--command", default="docs/megatron_lm/steps/restart_repeat_s28/command.txt",
                   help="the file naming the calls and commands that made the lines")
    p.add_argument("--floors", type=Path, action="append", default=[],
                   help="a gpu_real_client.sh floors JSON of the same calls (repeatable; "
                   "default: the twenty-eighth session's floors)")
    args = p.parse_args()
    floors = FLOORS
    if args.floors:
        got = [json.loads(f.read_text()) for f in args.floors]
        floors = {k: [g[k] for g in got] for k in ("h2d_pinned_gbps", "d2h_pinned_gbps")}
        floors["source"] = " ".join(str(f) for f in args.floors)
    runs = []
    for path in args.lines:
        model = path.name.split("_")[1]
        call = path.stem.split("_")[-1]
        archive = path.with_name(path.stem + "_logs.tgz")
        if not archive.exists():
            archive = path.with_name(path.stem + "_logs_partial.tgz")
        sizes = _bytes_by_log(archive)
        for line in path.read_text().splitlines():
            r = json.loads(line)
            runs.append({"source": "ours", "tier": r["tier"],
                         "cache": "warm" if r["tier"] == "storage" else None,
                         "bytes": sizes.get(f"{model}_r{r['round']}_{r['mode']}"),
                         "load_s": r["load_s"], "model": model.upper(), "mode": r["mode"],
                         "call": call, "round": r["round"], "setup_s": r["setup_s"],
                         "our_load_s": r["our_load_s"], "build_s": r.get("build_s"),
                         "init_to_model_s": r.get("init_to_model_s")})
    medians = {}
    for key in dict.fromkeys((r["model"], r["mode"]) for r in runs):
        got = [r for r in runs if (r["model"], r["mode"]) == key and r["setup_s"]]
        medians[f"{key[0]} {key[1]}"] = {
            "n": len(got), **{f: round(statistics.median(r[f] for r in got), 4)
                              for f in ("setup_s", "load_s", "our_load_s")}}
    out = {"device": "NVIDIA H200", "world_size": 1,
           "versions": {"megatron-core": "0.19.2", "nvidia-resiliency-ext": "0.7.0",
                        "Megatron-LM": "core_r0.19.0 pretrain_gpt.py"},
           "command": args.command, "floors": floors, "runs": runs, "medians": medians}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name, m in medians.items():
        print(name, m)


if __name__ == "__main__":
    main()
