"""Python's cyclic collector is paused while a save blocks (its collections run after the save)
and any collection that still runs inside a save is in its report (``stage_detail``:
``gc_pause_s``, ``gc_collections``); a save the collector left alone names neither.
``MCX_GC_IN_SAVE=1`` leaves the collector running. A load runs with it paused too."""

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


class _SeesTheCollector(SaveHooks):
    def __init__(self) -> None:
        self.enabled: list[bool] = []

    def at(self, point, record):  # noqa: ANN001
        if point == "staged":
            self.enabled.append(gc.isenabled())


@pytest.mark.parametrize("switch, inside", [(None, False), ("1", True)])
def test_the_collector_is_paused_while_a_save_blocks(tmp_path, monkeypatch, switch, inside):
    if switch is None:
        monkeypatch.delenv("MCX_GC_IN_SAVE", raising=False)
    else:
        monkeypatch.setenv("MCX_GC_IN_SAVE", switch)
    hooks = _SeesTheCollector()
    assert gc.isenabled()
    with Checkpointer(CkptOptions(), hooks=hooks) as ck:
        ck.save(sharded(0, 1, {"w": torch.ones(8)}), tmp_path / "ckpt", iteration=1)
    assert hooks.enabled == [inside]
    assert gc.isenabled()  # on again after the save


def test_a_save_that_fails_turns_the_collector_back_on(tmp_path):
    class Fails(SaveHooks):
        def at(self, point, record):  # noqa: ANN001
            if point == "staged":
                raise RuntimeError("injected")

    with Checkpointer(CkptOptions(), hooks=Fails()) as ck, pytest.raises(RuntimeError):
        ck.save(sharded(0, 1, {"w": torch.ones(8)}), tmp_path / "ckpt", iteration=1)
    assert gc.isenabled()


def test_a_load_runs_without_the_collector_from_its_first_step_to_its_last(tmp_path,
                                                                          monkeypatch):
    """Loads too: the collector is off from the locating of the checkpoint (before megatron-core
    loads) to the end of the load, and on again after it, also when the load raises."""
    from megatron_ckpt_ext import checkpointer

    seen = []
    real = checkpointer.locate
    monkeypatch.setattr(checkpointer, "locate", lambda *a, **k: (seen.append(gc.isenabled()),
                                                                 real(*a, **k))[1])
    with Checkpointer(CkptOptions()) as ck:
        assert ck.load({}, tmp_path / "nothing") is None
        assert seen == [False] and gc.isenabled()
        monkeypatch.setattr(checkpointer, "locate", lambda *a, **k: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            ck.load({}, tmp_path / "nothing")
    assert gc.isenabled()
