"""Staging ahead (save/ahead.py): copies of the last save's tensors issued before the caller
builds the next save's state (the launcher: on entry to Megatron-LM's save_checkpoint). The save
takes them only where its tensors are those very ones, unchanged since; otherwise it stages as
usual, writes its own bytes, and staging ahead stays off. A state built anew at each save stages
nothing ahead; copies no save took go back to the stager."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from tests._support.dist import device, sharded

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_group")]  # tests/conftest.py

OPTIONS = dict(async_save=True, async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True)


class _Model:
    """Tensors that live across saves (parameters, optimizer state), changed in place."""

    def __init__(self, n: int = 64) -> None:  # on MCX_TEST_DEVICE: copies ahead run async
        self.w = torch.zeros(n, device=device())
        self.b = torch.zeros(n, device=device())

    def step(self, value: float) -> None:
        self.w.fill_(value)
        self.b.copy_(torch.arange(self.b.numel(), dtype=torch.float32, device=self.b.device)
                     + value)

    def state(self) -> dict:  # built at every save, as Megatron does: same tensors, new objects
        return sharded(0, 1, {"w": self.w, "b": self.b})


def _expected(value: float, n: int = 64) -> dict:
    return {"w": torch.full((n,), value), "b": torch.arange(n, dtype=torch.float32) + value}


def _check(ck: Checkpointer, root, iteration: int, expected: dict) -> None:
    loaded = ck.load(sharded(0, 1, {k: torch.empty_like(v) for k, v in expected.items()}), root,
                     iteration=iteration)
    for key, want in expected.items():
        assert torch.equal(loaded[key].cpu(), want.cpu()), (iteration, key)


def _ahead_in(ck: Checkpointer) -> list[bool]:
    return ["staged_ahead_s" in r.get("stage_detail", {}) for r in ck.reports]


def _save(ck: Checkpointer, model: _Model, root, iteration: int) -> None:
    ck.save(model.state(), root, iteration=iteration)
    ck.maybe_finalize(blocking=True)


def _saved_twice_then_ahead(ck: Checkpointer, model: _Model, root) -> None:
    """Saves 1 and 2 (the second records what to copy ahead), step 3, its copies issued."""
    for it in (1, 2):
        model.step(float(it))
        _save(ck, model, root, it)
    model.step(3.0)
    assert ck.stage_ahead()


@pytest.mark.parametrize("persistent,sets", [(False, 1), (True, 1), (True, 2)])
def test_steady_saves_take_the_copies_issued_ahead_and_write_the_state_at_the_save(tmp_path,
                                                                                   persistent,
                                                                                   sets):
    """Also with two snapshot sets: the copies ahead go to the set that is not sealed."""
    model, root = _Model(), tmp_path / "ckpt"
    options = CkptOptions(**OPTIONS, use_persistent_ckpt_worker=persistent,
                          ckpt_memory_snapshot_sets=sets)
    with Checkpointer(options) as ck:
        issued, allocated = [], None
        for it in range(1, 7):
            model.step(float(it))
            issued.append(ck.stage_ahead())
            _save(ck, model, root, it)
            if it == 3:  # every buffer set exists by now
                allocated = ck.staging_stats()["allocations"]
        assert ck.staging_stats()["allocations"] == allocated  # staged ahead, not allocated
        for it in range(1, 7):
            _check(ck, root, it, _expected(float(it)))
    # nothing to copy before the first save (it admits the node after it); with two sets the
    # second save's set does not exist yet: not ahead, it would allocate
    first_ahead = [False, sets == 1] + [True] * 4
    assert issued == first_ahead and _ahead_in(ck) == first_ahead


def test_a_change_in_place_after_the_copies_were_issued_is_saved_and_ahead_stops(tmp_path,
                                                                                 caplog):
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        _saved_twice_then_ahead(ck, model, root)
        model.w.add_(1.0)  # between the copies ahead and the save: the save must hold it
        with caplog.at_level("INFO", logger="megatron_ckpt_ext"):
            _save(ck, model, root, 3)
        model.step(4.0)
        assert not ck.stage_ahead()  # off for the rest of the run
        _save(ck, model, root, 4)
        want = _expected(3.0)
        want["w"] += 1.0
        _check(ck, root, 3, want)
        _check(ck, root, 4, _expected(4.0))
    assert _ahead_in(ck) == [False, False, False, False]
    assert any("changed in place" in r.getMessage() for r in caplog.records)


def test_another_tensor_under_the_same_key_is_saved_not_the_copy_ahead(tmp_path):
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        _saved_twice_then_ahead(ck, model, root)
        old_w = model.w  # still alive: its memory cannot be handed to the new one
        model.w = torch.full_like(old_w, 30.0)
        while model.w._version < old_w._version:  # even its version counter agrees
            model.w.add_(0.0)
        assert model.w._version == old_w._version
        _save(ck, model, root, 3)
        want = _expected(3.0)
        want["w"] = torch.full((old_w.numel(),), 30.0)
        _check(ck, root, 3, want)
    assert _ahead_in(ck) == [False, False, False]


def test_a_state_built_anew_at_each_save_stages_nothing_ahead(tmp_path):
    root = tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        issued = []
        for it in (1, 2, 3):
            issued.append(ck.stage_ahead())
            fresh = _Model()
            fresh.step(float(it))
            _save(ck, fresh, root, it)
            del fresh
        _check(ck, root, 3, _expected(3.0))
    assert issued == [False, False, False]


def test_copies_no_save_took_go_back_and_the_next_save_stages_into_them(tmp_path, monkeypatch):
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        for it in (1, 2):
            model.step(float(it))
            _save(ck, model, root, it)
        allocated = ck.staging_stats()["allocations"]
        assert ck.stage_ahead()
        ck.drop_ahead()  # the caller saved nothing (say, Megatron's save raised first)
        model.step(3.0)
        _save(ck, model, root, 3)
        assert ck.staging_stats()["allocations"] == allocated
        _check(ck, root, 3, _expected(3.0))
        monkeypatch.setenv("MCX_STAGE_AHEAD", "0")
        assert not ck.stage_ahead()
        monkeypatch.delenv("MCX_STAGE_AHEAD")
        assert ck.wait_prepared(60)  # (the load in _check prepares its state's staging)
        assert ck.stage_ahead()  # and close() gives these back


def _three_saves(ck: Checkpointer, model: _Model, root) -> list[bool]:
    """Saves 1-3, each after a step and a try at staging ahead (whether copies were issued),
    each then checked."""
    issued = []
    for it in (1, 2, 3):
        model.step(float(it))
        issued.append(ck.stage_ahead())
        _save(ck, model, root, it)
    for it in (1, 2, 3):
        _check(ck, root, it, _expected(float(it)))
    return issued


@pytest.mark.parametrize("sets", [1, 2])
def test_after_prepare_the_first_save_takes_copies_issued_ahead(tmp_path, sets):
    """prepare()'s state is what the first save copies ahead (the launcher prepares after the
    first training step, and again after a load): the first save stages like a steady one."""
    model, root = _Model(), tmp_path / "ckpt"
    options = CkptOptions(**OPTIONS, use_persistent_ckpt_worker=True,
                          ckpt_memory_snapshot_sets=sets)
    with Checkpointer(options) as ck:
        ck.prepare(model.state())
        assert ck.wait_prepared(60)
        issued = _three_saves(ck, model, root)
    assert issued == [True] * 3 and _ahead_in(ck) == [True] * 3


def test_a_prepared_state_that_is_not_the_first_save_only_drops_its_copies(tmp_path):
    """prepare() given other tensors than the first save's (same keys): the first save writes its
    own bytes, and staging ahead goes on from the save's tensors."""
    model, other, root = _Model(), _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck.prepare(other.state())
        assert ck.wait_prepared(60)
        other.step(99.0)
        issued = _three_saves(ck, model, root)
    assert issued == [True, True, True] and _ahead_in(ck) == [False, True, True]


def test_after_a_load_the_prepare_of_the_live_state_is_what_the_first_save_copies(tmp_path):
    """A load prepares the staging from the state it loaded into (Megatron-LM then copies the
    optimizer's part elsewhere and frees it); the launcher prepares again from the live state
    after the first step: that one is what the first save after the resume copies ahead."""
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        model.step(1.0)
        _save(ck, model, root, 1)
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        loaded = ck.load(sharded(0, 1, {"w": torch.empty_like(model.w),
                                        "b": torch.empty_like(model.b)}), root, iteration=1)
        model.w.copy_(loaded["w"])
        model.b.copy_(loaded["b"])
        del loaded  # the tensors loaded into are gone
        ck.prepare(model.state())
        assert ck.wait_prepared(60)
        model.step(2.0)
        assert ck.stage_ahead()
        _save(ck, model, root, 2)
        _check(ck, root, 2, _expected(2.0))
        assert _ahead_in(ck) == [True]


def test_no_wait_for_a_prepare_at_work_before_the_save_whose_report_then_counts_it(tmp_path,
                                                                                  monkeypatch):
    """Megatron-LM's save_checkpoint entered while prepare() still allocates (on one H200 a 1B
    state's 12 GB took longer than the 20 steps to the first save after a resume): staging
    ahead issues nothing and returns at once, and the save waits inside, where its report's
    blocking_s and its phase wait_prepare_s count the wait (waiting on entry hid 4.8 s from the
    report), and what the preparation allocated meanwhile is not counted as the save's."""
    import threading
    import time

    from megatron_ckpt_ext.staging.shm import ShmStager

    real, real_save, started = ShmStager._prepare_locked, Checkpointer.save, threading.Event()

    def slow(self, specs):  # the allocation ends 0.3 s after the save started
        started.wait(timeout=5)  # (5 s where staging ahead waits for it, as it did)
        time.sleep(0.3)
        return real(self, specs)

    def save(self, *args, **kwargs):
        started.set()
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(ShmStager, "_prepare_locked", slow)
    monkeypatch.setattr(Checkpointer, "save", save)
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck.prepare(model.state())
        model.step(1.0)
        start = time.perf_counter()
        issued = ck.stage_ahead()
        entry_s = time.perf_counter() - start
        _save(ck, model, root, 1)
        _check(ck, root, 1, _expected(1.0))
        report = ck.reports[0]
    assert not issued and entry_s < 2, entry_s
    assert report["phases"]["wait_prepare_s"] >= 0.25, report["phases"]
    assert report["stage_detail"]["allocations"] == 0, report["stage_detail"]
    assert report["blocking_s"] >= 0.25, report
