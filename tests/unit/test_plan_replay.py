"""Steady saves replay the request megatron-core planned for the same structure
(backend/replay.py): each replayed save writes its own tensors, its own objects' bytes and its
own common state into its own directory, and loads back exactly; a change in the shards'
metadata plans in full (and records again); MCX_REPLAY_PLAN=0 plans every save in full."""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save.layout import checkpoint_name

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_group")]  # tests/conftest.py

OPTIONS = dict(async_save=True, async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True,
               use_persistent_ckpt_worker=True)


class _Model:
    """A plain tensor, two stacked layers (a prepended axis, as Megatron-LM's layers) and an
    RNG-like object, all changed at every step."""

    def __init__(self) -> None:
        self.w = torch.zeros(32)
        self.layers = [torch.zeros(4, 8) for _ in range(2)]
        self.rng = [0]

    def step(self, value: float) -> None:
        self.w.fill_(value)
        for i, t in enumerate(self.layers):
            t.copy_(torch.arange(32, dtype=torch.float32).view(4, 8) + 10 * i + value)
        self.rng = [int(value)] * 5

    def state(self, iteration: int, *, replica: int = 0) -> dict:
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

        layers = [ShardedTensor.from_rank_offsets("layers", t, (0, i, 2), replica_id=0,
                                                  prepend_axis_num=1)
                  for i, t in enumerate(self.layers)]
        return {"w": ShardedTensor.from_rank_offsets("w", self.w, replica_id=replica),
                "layers": layers,
                "rng": ShardedObject("rng", list(self.rng), (1,), (0,), replica_id=0),
                "iteration": iteration}


def _template() -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", torch.empty(32), replica_id=0),
            "layers": [ShardedTensor.from_rank_offsets("layers", torch.empty(4, 8), (0, i, 2),
                                                       replica_id=0, prepend_axis_num=1)
                       for i in range(2)],
            "rng": ShardedObject("rng", None, (1,), (0,), replica_id=0)}


def _check(ck: Checkpointer, root, iteration: int) -> None:
    loaded = ck.load(_template(), root, iteration=iteration)
    value = float(iteration)
    assert torch.equal(loaded["w"], torch.full((32,), value)), iteration
    for i, t in enumerate(loaded["layers"]):
        assert torch.equal(t, torch.arange(32, dtype=torch.float32).view(4, 8) + 10 * i + value)
    assert loaded["rng"] == [iteration] * 5, iteration
    assert loaded["iteration"] == iteration


def _tensors_in(value, depth: int = 0) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)) and depth < 8:
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    return []


def _paths(ck: Checkpointer) -> list:
    return [r["stage_detail"].get("plan") for r in ck.reports]


def _save(ck: Checkpointer, model: _Model, root, iteration: int, **kw) -> None:
    model.step(float(iteration))
    ck.save(model.state(iteration, **kw), root, iteration=iteration)
    ck.maybe_finalize(blocking=True)


@pytest.mark.parametrize("sets", [1, 2])
def test_replayed_saves_write_their_own_bytes_into_their_own_directory(tmp_path, sets):
    """Also with two snapshot sets (the staged tensors alternate between two memories); the
    directory the plan was recorded in is gone before a replayed save."""
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS, ckpt_memory_snapshot_sets=sets)) as ck:
        for it in range(1, 8):
            _save(ck, model, root, it)
            if it == 3:  # (the plan was recorded by save 1 or 2)
                shutil.rmtree(checkpoint_name(root, 1))
                shutil.rmtree(checkpoint_name(root, 2))
        paths = _paths(ck)
        assert paths[0] == "planned" and paths[3:] == ["replayed"] * 4, paths
        assert not _tensors_in(vars(ck._planner.replay.entry.writer))  # no staged memory held
        for it in range(3, 8):
            _check(ck, root, it)


def test_a_change_in_the_shards_metadata_plans_in_full_and_records_again(tmp_path):
    """Same keys, shapes and dtypes (the structure key holds), another replica id: planned."""
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        for it in range(1, 5):
            _save(ck, model, root, it)
        _save(ck, model, root, 5, replica=(0,))
        for it in range(6, 9):
            _save(ck, model, root, it, replica=(0,))
        paths = _paths(ck)
        assert paths[3] == "replayed" and paths[4] == "planned", paths
        assert paths[6:] == ["replayed"] * 2, paths
        for it in (4, 5, 8):
            _check(ck, root, it)


def test_switch_off_plans_every_save(tmp_path, monkeypatch):
    monkeypatch.setenv("MCX_REPLAY_PLAN", "0")
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        for it in range(1, 5):
            _save(ck, model, root, it)
        assert _paths(ck) == ["planned"] * 4
        _check(ck, root, 4)


def test_without_constant_structure_nothing_is_replayed_or_reported(tmp_path):
    model, root = _Model(), tmp_path / "ckpt"
    options = CkptOptions(**{**OPTIONS, "ckpt_assume_constant_structure": False})
    with Checkpointer(options) as ck:
        for it in range(1, 4):
            _save(ck, model, root, it)
        assert _paths(ck) == [None] * 3
        _check(ck, root, 3)


def test_the_first_save_after_prepare_replays_what_prepare_planned(tmp_path):
    """prepare() plans the first save ahead (twice, into a throwaway directory, with the buffers
    that save stages into): its second plan is recorded, so the first save replays it and writes
    its own bytes into its own directory."""
    model, root = _Model(), tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck.prepare(model.state(0))
        ck.wait_prepared(120)
        for it in (1, 2):
            _save(ck, model, root, it)
        assert _paths(ck) == ["replayed", "replayed"], _paths(ck)
        assert "planned_ahead_s" in ck.reports[0]["stage_detail"]
        for it in (1, 2):
            _check(ck, root, it)
