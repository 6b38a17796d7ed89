"""benchmarks/handover_cost.py as a plain script: every save is reported with its blocking time
and what the writer queue's feeder thread pickled for it (the request, with the staged tensors'
handles). No timing is asserted (shared CI cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.functional
def test_handover_cost_reports_each_saves_pickling(tmp_path):
    out = tmp_path / "handover.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "handover_cost.py"), "--saves", "2",
                    "--layers", "2", "--json", str(out)], check=True, cwd=ROOT, timeout=300)
    saves = json.loads(out.read_text())["saves"]
    assert [s["iteration"] for s in saves] == [1, 2]
    for s in saves:
        assert s["blocking_s"] > 0
        feeder = s["pickling"]["QueueFeederThread"]
        assert feeder["calls"] >= 1 and feeder["bytes"] > 10_000, s  # 100 tensors' handles
