"""What the writers' CRC-32 costs: the same bench_ckpt.py run (our recommended mode) with
MCX_WRITE_CHECKSUMS=1 and =0, alternating ``--rounds`` times, then durable and blocking per save
side by side and the ratio of the medians (target: durable within ~3%). One JSON out.

    python benchmarks/checksum_cost.py --gib 4 --saves 5 --rounds 2 --json $OUT/checksum_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODE = "ours-async-persistent-cpu-shm"


def _run(gib: float, saves: int, checksums: str, out: Path, launcher: list[str]) -> dict:
    path = out / f"bench_checksums_{checksums}_{len(list(out.glob('bench_*.json')))}.json"
    env = {**os.environ, "MCX_WRITE_CHECKSUMS": checksums}
    cmd = [*launcher, str(Path(__file__).with_name("bench_ckpt.py")), "--gib-per-rank", str(gib),
           "--saves", str(saves), "--modes", MODE, "--out", str(out / "ckpt"), "--json", str(path),
           "--mode-timeout-s", "200", "--deadline-s", "260"]
    subprocess.run(cmd, env=env, check=True)
    runs = [r for r in json.loads(path.read_text())["runs"] if r.get("mode") == MODE]
    return {"checksums": checksums == "1", "json": path.name,
            "durable_s": [r["durable_s"] for r in runs], "blocking_s": [r["blocking_s"] for r in runs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="/tmp/checksum_cost")
    p.add_argument("--json", required=True)
    p.add_argument("--launcher", default="torchrun --nproc-per-node 1")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for _ in range(args.rounds):
        for checksums in ("1", "0"):
            runs.append(_run(args.gib, args.saves, checksums, out, args.launcher.split()))
    steady = {flag: [d for r in runs if r["checksums"] is flag for d in r["durable_s"][2:]]
              for flag in (True, False)}
    result = {"argv": sys.argv, "mode": MODE, "gib_per_rank": args.gib, "runs": runs,
              "durable_steady_median_s": {"checksums": statistics.median(steady[True]),
                                          "no_checksums": statistics.median(steady[False])}}
    result["durable_ratio"] = round(result["durable_steady_median_s"]["checksums"]
                                    / result["durable_steady_median_s"]["no_checksums"], 4)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("durable_steady_median_s", "durable_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
