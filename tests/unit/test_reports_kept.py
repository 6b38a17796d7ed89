"""A long run's reports stay bounded: ``Checkpointer.reports`` (and ``load_reports``) keep the
last ``Recent.KEPT`` entries while ``ckpt_report.jsonl`` keeps every save's line."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext._runtime import Recent
from tests._support.dist import sharded

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_group")]  # tests/conftest.py


def test_the_reports_keep_the_last_saves_and_the_log_keeps_them_all(tmp_path, monkeypatch):
    monkeypatch.setattr(Recent, "KEPT", 3)
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with Checkpointer(CkptOptions()) as ck:
        for it in range(1, 6):
            ck.save(sharded(0, 1, state), tmp_path, iteration=it)
        for _ in range(4):
            ck.load(sharded(0, 1, {"w": torch.zeros(64)}), tmp_path)
        assert [r["iteration"] for r in ck.reports] == [3, 4, 5]
        assert ck.reports[-1:] == [ck.reports[2]]  # still a list: slices, indexes
        assert len(ck.load_reports) == 3
    lines = (tmp_path / "ckpt_report.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3, 4, 5]


def test_extending_keeps_the_last_entries_too():
    kept = Recent()
    kept.KEPT = 2
    kept.extend([1, 2, 3])
    kept.append(4)
    assert kept == [3, 4]
