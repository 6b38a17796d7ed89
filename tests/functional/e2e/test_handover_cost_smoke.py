"""benchmarks/handover_cost.py as a plain script: every save is reported with its blocking time
and what the writer queue's feeder thread pickled for it (the request, with the staged tensors'
handles). No timing is asserted (shared CI cores)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests._support.jobs import run_job

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path, **env: str) -> dict:
    out = tmp_path / "handover.json"
    run_job([sys.executable, str(ROOT / "benchmarks" / "handover_cost.py"), "--saves", "3",
             "--layers", "2", "--json", str(out)], cwd=ROOT, env={**os.environ, **env})
    return json.loads(out.read_text())


def _saves(tmp_path, **env: str) -> list[dict]:
    saves = _run(tmp_path, **env)["saves"]
    assert [s["iteration"] for s in saves] == [1, 2, 3]
    for s in saves:
        assert s["blocking_s"] > 0
        feeder = s["pickling"]["QueueFeederThread"]
        assert feeder["calls"] >= 1 and feeder["bytes"] > 10_000, s  # 100 tensors' handles
    return saves


@pytest.mark.functional
def test_handover_cost_reports_each_saves_pickling_and_what_the_writer_keeps(tmp_path):
    saves = _saves(tmp_path)
    # the benchmark calls prepare() first: the first save's lists were pickled there, so every
    # save, the first included, sends them by key and the writer builds them once
    for s in saves:
        assert s["kept"]["sent_whole"] == 0 and s["kept"]["sent_known"] >= 1, s


@pytest.mark.functional
def test_without_prepare_made_ahead_the_first_save_pickles_its_lists_in_full(tmp_path):
    run = _run(tmp_path)
    assert run["made_ahead"] >= 1, run
    saves = _saves(tmp_path, MCX_PLAN_AHEAD="0")  # nothing planned ahead: nothing made ahead
    assert saves[0]["kept"]["sent_whole"] >= 1, saves[0]
    for s in saves[1:]:
        assert s["kept"]["sent_whole"] == 0 and s["kept"]["sent_known"] >= 1, s


@pytest.mark.functional
def test_resend_each_save_pickles_every_list_in_full(tmp_path):
    for s in _saves(tmp_path, MCX_RESEND_EACH_SAVE="1"):
        assert s["kept"] == {"sent_whole": 0, "sent_known": 0}, s
