"""The load benchmark's CPU smoke run (benchmarks/bench_load.py --cpu-smoke): the JSON has the
documented fields, every source loads the saved state bit-exact, ours verifies. No timing is
asserted (shared CI cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.functional
def test_load_benchmark_smoke(tmp_path):
    out = tmp_path / "load.json"
    # as a plain script (a world of one), as the README shows it; torchrun works alike
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_load.py"),
                    "--cpu-smoke", "--repeats", "1", "--out", str(tmp_path / "ckpt"),
                    "--json", str(out)], check=True, cwd=ROOT, timeout=300)
    data = json.loads(out.read_text())
    assert {"device", "versions", "floors", "runs"} <= set(data)
    assert set(data["floors"]) == {"h2d_pinned_gbps", "read_warm_gbps", "read_cold_gbps"}
    assert data["floors"]["read_warm_gbps"] > 0 and data["floors"]["read_cold_gbps"] > 0
    runs = data["runs"]
    assert {(r["source"], r["cache"]) for r in runs} == {
        (s, c) for s in ("ours", "megatron", "torch_dcp") for c in ("warm", "cold")}
    assert all(r["bit_exact"] and r["state_bytes"] > 0 and r["load_s"] > 0 for r in runs), runs
    assert all(r["verified"] for r in runs if r["variant"] == "ours")
    assert not any(r["verified"] for r in runs if r["source"] != "ours")
    # ours reads every item directly (no item fell back to the stock unpickling)
    assert all(r["direct_items"] > 0 and r["stock_items"] == 0 for r in runs
               if r["source"] == "ours"), runs
    assert set(data["targets"]["met"]) == {"warm >= 0.8 x floor", "warm >= 4x megatron",
                                           "cold >= 0.8 x floor", "verify <= 10% of warm"}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plot_load import throughputs

    assert set(throughputs(data)) == {(r["variant"], r["cache"]) for r in runs}


@pytest.mark.functional
def test_memory_restore_benchmark_smoke(tmp_path):
    """bench_memory_restore.py --cpu-smoke: a killed child's snapshot is restored from memory,
    every load is bit-exact and takes the tier it should; the JSON has the documented fields."""
    out = tmp_path / "restore.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_memory_restore.py"),
                    "--cpu-smoke", "--repeats", "1", "--out", str(tmp_path / "ckpt"),
                    "--json", str(out)], check=True, cwd=ROOT, timeout=300)
    data = json.loads(out.read_text())
    assert {"device", "versions", "world_size", "command", "floors", "runs"} <= set(data)
    assert set(data["floors"]) == {"h2d_pinned_gbps"}
    assert {(r["source"], r["tier"], r["cache"]) for r in data["runs"]} == {
        ("ours", "memory", None), ("ours", "storage", "warm"), ("ours", "storage", "cold"),
        ("stock", "storage", "warm"), ("stock", "storage", "cold")}
    assert all(r["bit_exact"] and r["bytes"] > 0 for r in data["runs"])
    assert data["summary"]["tiers_as_expected"] and data["summary"]["all_bit_exact"]
