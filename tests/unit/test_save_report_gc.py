"""A save's report says how long Python's cyclic collector paused it (``stage_detail``:
``gc_pause_s``, ``gc_collections``), so a slow save can be told from one the collector took;
a save the collector left alone names neither."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.hooks import SaveHooks
from tests._support.dist import sharded

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_group")]  # tests/conftest.py


class _CollectsAt(SaveHooks):
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def at(self, point, record):  # noqa: ANN001
        if point == "staged" and record.iteration == self.iteration:
            gc.collect()  # as an automatic collection inside the save would


@pytest.fixture
def no_automatic_collections():
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def test_the_collectors_pause_inside_a_save_is_in_its_report(tmp_path, no_automatic_collections):
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, hooks=_CollectsAt(2)) as ck:
        for it in (1, 2, 3):
            ck.save(sharded(0, 1, {"w": torch.ones(64) * it}), tmp_path / "ckpt", iteration=it)
            ck.maybe_finalize(blocking=True)
        details = {r["iteration"]: r["stage_detail"] for r in ck.reports}
    assert details[2]["gc_collections"] == 1 and details[2]["gc_pause_s"] > 0
    assert "gc_pause_s" not in details[1] and "gc_pause_s" not in details[3]
