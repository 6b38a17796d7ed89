"""What a Megatron-LM user sees through the launcher: Megatron's own timers, parsed from the logs
of the runs ``scripts/gpu_real_client.sh`` makes, into one JSON and a table.

    python benchmarks/real_client.py --runs RUNS.jsonl --out real_client.json [--floor FLOOR.json]

``RUNS.jsonl``: one line per run the driver made: ``{"name", "source" ("ours"|"stock"), "model",
"kind" ("train"|"resume_cold"|"resume_warm"|"kill"|"restart"), "log", "rc", "save_dir",
"command"}``. From each log: every save's ``save-checkpoint`` timer (Megatron's ``(min, max)``
line after its "saving checkpoint at iteration N"; the max is the stall), the
``load-checkpoint`` timer, the iterations' losses and our Checkpointer's load line (its tier).
Saves are named by position: the run's first save (``first``, or ``first_after_resume`` in a
resumed run), the save Megatron makes after its training loop (``end_of_training``: an
iteration that is not a multiple of the save interval, the run's last), the others ``steady``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

SAVING = re.compile(r"saving checkpoint at iteration\s+(\d+)")
TIMER = re.compile(r"^\s*(save-checkpoint|load-checkpoint) \.+: \(([\d.]+), ([\d.]+)\)")
LOSS = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|.*?\blm loss: ([^ |]+)")
OUR_LOAD = re.compile(r"checkpoint load report: (\{.*\})")
SAVE_INTERVAL = re.compile(r"--save-interval\s+(\d+)")


def parse_log(text: str) -> dict[str, Any]:
    """Saves (iteration, stall_s), load_s, losses {iteration: printed value}, our load tier."""
    saves: list[dict] = []
    current: int | None = None
    load_s = None
    for line in text.splitlines():
        m = SAVING.search(line)
        if m:
            current = int(m.group(1))
            continue
        m = TIMER.match(line)
        if m:
            seconds = float(m.group(3)) / 1000.0
            if m.group(1) == "save-checkpoint" and current is not None:
                saves.append({"iteration": current, "stall_s": round(seconds, 4)})
                current = None
            elif m.group(1) == "load-checkpoint":
                load_s = round(seconds, 4)
    losses = {int(i): v for i, v in LOSS.findall(text)}
    reports = [json.loads(r) for r in OUR_LOAD.findall(text)]
    errors = re.findall(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .*)$", text, re.M)
    return {"saves": saves, "load_s": load_s, "losses": losses,
            "tier": reports[-1].get("tier") if reports else None,
            "load_report": reports[-1] if reports else None,
            "error": errors[0][:300] if errors else None}


def name_saves(saves: list[dict], *, resumed: bool, interval: int | None) -> list[dict]:
    out = []
    for i, s in enumerate(saves):
        if i == 0:
            kind = "first_after_resume" if resumed else "first"  # a kill run starts fresh
        elif i == len(saves) - 1 and interval and s["iteration"] % interval:
            kind = "end_of_training"
        else:
            kind = "steady"
        out.append({**s, "save": kind})
    return out


def summarize(runs: list[dict], floor: dict | None) -> dict[str, Any]:
    rows: list[dict] = []
    loads: list[dict] = []
    per_run: list[dict] = []
    for run in runs:
        text = Path(run["log"]).read_text(errors="replace") if Path(run["log"]).exists() else ""
        parsed = parse_log(text)
        m = SAVE_INTERVAL.search(run.get("command", ""))
        interval = int(m.group(1)) if m else None
        saves = name_saves(parsed["saves"], resumed=run["kind"] not in ("train", "kill"),
                           interval=interval)
        for s in saves:
            rows.append({"source": run["source"], "model": run["model"], "run": run["name"],
                         "save": s["save"], "iteration": s["iteration"], "stall_s": s["stall_s"]})
        if parsed["load_s"] is not None:
            loads.append({"source": run["source"], "model": run["model"], "run": run["name"],
                          "kind": run["kind"], "load_s": parsed["load_s"],
                          "tier": parsed["tier"]})
        per_run.append({**run, "losses": parsed["losses"], "saves": saves,
                        "load_s": parsed["load_s"], "tier": parsed["tier"],
                        "load_report": parsed["load_report"], "error": parsed["error"]})
    return {"runs": rows, "loads": loads, "per_run": per_run, "floors": floor or {},
            "table": table(rows, loads, floor)}


def table(rows: list[dict], loads: list[dict], floors: dict | None = None) -> list[dict]:
    """Per model and save kind: ours and stock (min-max of stall_s), ours / steady ours, and
    the steady row's median over the pinned-copy floor of that model (when measured)."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        steady = [r["stall_s"] for r in rows
                  if r["model"] == model and r["source"] == "ours" and r["save"] == "steady"]
        steady_med = statistics.median(steady) if steady else None
        for kind in ("steady", "first", "first_after_resume", "end_of_training"):
            cell: dict[str, Any] = {"model": model, "save": kind}
            for source in ("ours", "stock"):
                vals = [r["stall_s"] for r in rows
                        if r["model"] == model and r["source"] == source and r["save"] == kind]
                cell[source] = [min(vals), max(vals)] if vals else None
            if cell["ours"] and steady_med:
                cell["ours_over_steady"] = round(cell["ours"][1] / steady_med, 2)
            floor_s = ((floors or {}).get(model) or {}).get("d2h_pinned_s")
            if kind == "steady" and steady_med and floor_s:
                cell["ours_median_over_copy_floor"] = round(steady_med / floor_s, 2)
            out.append(cell)
        for kind in ("resume_cold", "resume_warm", "restart", "resume_other"):
            cell = {"model": model, "load": kind}
            for source in ("ours", "stock"):
                vals = [ld["load_s"] for ld in loads
                        if ld["model"] == model and ld["source"] == source and ld["kind"] == kind]
                cell[source] = [min(vals), max(vals)] if vals else None
            tiers = sorted({ld["tier"] for ld in loads if ld["model"] == model
                            and ld["kind"] == kind and ld["tier"]})
            cell["tiers"] = tiers
            if cell["ours"] or cell["stock"]:
                out.append(cell)
    return out


def losses_match(a: dict[int, str], b: dict[int, str], first: int) -> dict[str, Any]:
    """``b`` (a restarted run from ``first - 1``) against ``a`` on the iterations both logged:
    equal as printed, except that Megatron logs the restarted run's second iteration as the mean
    of its first two (its loss accumulator is not reset after a run's first iteration)."""
    common = sorted(set(a) & set(b))
    differ = []
    for i in common:
        if a[i] == b[i]:
            continue
        if i == first + 1 and first in a:
            mean = (float(a[first]) + float(a[i])) / 2
            if abs(mean - float(b[i])) <= abs(mean) * 1e-6:
                continue
        differ.append(i)
    rel = [abs(float(a[i]) - float(b[i])) / max(abs(float(a[i])), 1e-30) for i in common
           if i != first + 1]
    return {"compared": len(common), "differ": differ, "identical": bool(common) and not differ,
            "max_rel_diff": max(rel) if rel else None}


def merge(paths: list[str], out: str) -> int:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = {k: v for part in parts for k, v in part.items()
              if k not in ("runs", "loads", "per_run", "loss_checks", "table", "floors")}
    for key in ("runs", "loads", "per_run", "loss_checks"):
        merged[key] = [x for part in parts for x in part.get(key, [])]
    merged["floors"] = {m: f for part in parts for m, f in (part.get("floors") or {}).items()
                        if f.get("state_bytes_per_rank")}
    merged["merged_from"] = paths
    merged["table"] = table(merged["runs"], merged["loads"], merged["floors"])
    Path(out).write_text(json.dumps(merged, indent=1))
    for row in merged["table"]:
        print(json.dumps(row))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", help="the driver's runs.jsonl (required unless --merge)")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--floor", default=None, help="JSON of floors measured in the same run")
    p.add_argument("--meta", default=None, help="JSON merged at the top (device, versions, ...)")
    p.add_argument("--compare", nargs=3, action="append", default=[],
                   metavar=("RUN_A", "RUN_B", "FIRST"),
                   help="compare RUN_B's losses from FIRST on with RUN_A's (repeatable)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="only merge result JSONs of runs made on the same machine into --out "
                        "(rows and loads concatenated, the table recomputed)")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    runs = [json.loads(line) for line in Path(args.runs).read_text().splitlines() if line.strip()]
    floor = json.loads(Path(args.floor).read_text()) if args.floor else None
    result = summarize(runs, floor)
    if args.meta:
        result = {**json.loads(Path(args.meta).read_text()), **result}
    by_name = {r["name"]: r for r in result["per_run"]}
    result["loss_checks"] = []
    for a, b, first in args.compare:
        if a in by_name and b in by_name:
            result["loss_checks"].append({"a": a, "b": b, "from": int(first),
                                          **losses_match(by_name[a]["losses"],
                                                         by_name[b]["losses"], int(first))})
    Path(args.out).write_text(json.dumps(result, indent=1))
    for row in result["table"]:
        print(json.dumps(row))
    for check in result["loss_checks"]:
        print(json.dumps(check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
