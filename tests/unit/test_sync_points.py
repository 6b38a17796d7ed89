"""MCX_SYNC_POINTS (save/sync_points.py): every synchronizing call a save makes is kept with its
stack and the phases finished before it, one JSON line per save; other warnings pass through;
unset, nothing is written. On CPU torch cannot turn its sync debug mode on, so a stand-in
staging step raises torch's warning itself."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save import steps
from tests._support.dist import sharded

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _syncing_stage(monkeypatch):
    real = steps.stage

    def stage_that_syncs(*args, **kwargs):
        staged = real(*args, **kwargs)
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("something else", UserWarning)
        return staged

    monkeypatch.setattr(steps, "stage", stage_that_syncs)


def test_a_save_records_where_it_waited_for_the_device(tmp_path, monkeypatch):
    _syncing_stage(monkeypatch)
    monkeypatch.setenv("MCX_SYNC_POINTS", str(tmp_path / "sync"))
    with Checkpointer(CkptOptions()) as ck:
        with pytest.warns(UserWarning, match="something else"):  # passes through
            ck.save(sharded(0, 1, {"w": torch.ones(8)}), tmp_path / "ckpt", iteration=1)
        ck.save(sharded(0, 1, {"w": torch.ones(8)}), tmp_path / "ckpt", iteration=2)
    lines = [json.loads(x) for x in (tmp_path / "sync" / "sync_points_rank0.jsonl")
             .read_text().splitlines()]
    assert [x["label"] for x in lines] == ["save iteration 1", "save iteration 2"]
    for line in lines:
        [point] = line["points"]
        assert point["after_phases"] == ["wait_previous_s", "wait_prepare_s",
                                         "prepare_dir_s"]  # during staging
        assert any("stage_that_syncs" in frame for frame in point["stack"]), point["stack"]


def test_unset_nothing_is_recorded(tmp_path, monkeypatch):
    _syncing_stage(monkeypatch)
    monkeypatch.delenv("MCX_SYNC_POINTS", raising=False)
    with Checkpointer(CkptOptions()) as ck, pytest.warns(UserWarning, match="synchronizing"):
        ck.save(sharded(0, 1, {"w": torch.ones(8)}), tmp_path / "ckpt", iteration=1)
    assert not (tmp_path / "sync").exists()
