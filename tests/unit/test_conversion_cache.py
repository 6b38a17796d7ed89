"""Under --ckpt-assume-constant-structure a steady save reuses megatron-core's conversion of its
shards (backend/conversions.py) and still writes that save's bytes; a shard in other memory, or
a new structure, converts anew."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend

LAYERS = 3


def _stacked(tensors: dict[str, list[torch.Tensor]]) -> dict:
    """Per key, one shard per layer on a prepended axis, as megatron-core stacks a GPT's layers
    (the shards megatron-core converts into torch ShardedTensors every save)."""
    st = backend.sharded_tensor_cls()
    return {k: [st.from_rank_offsets(k, t, (0, i, LAYERS), replica_id=0, prepend_axis_num=1)
                for i, t in enumerate(layers)] for k, layers in tensors.items()}


def _load(root, iteration: int, shapes: dict[str, tuple]) -> dict[str, list[torch.Tensor]]:
    target = _stacked({k: [torch.zeros(s) for _ in range(LAYERS)] for k, s in shapes.items()})
    with Checkpointer(CkptOptions()) as ck:
        loaded = ck.load(target, root, iteration=iteration)
    return {k: [sh.data if hasattr(sh, "data") else sh for sh in v] for k, v in loaded.items()}


@pytest.mark.parametrize("mode", ["async-cpu-shm", "sync"])
def test_steady_saves_reuse_the_conversions_and_write_their_own_bytes(one_rank_group, tmp_path,
                                                                      mode, monkeypatch):
    # every save planned in full, as where a replay does not apply (backend/replay.py; a
    # replayed save converts only its objects: tests/unit/test_plan_replay.py)
    monkeypatch.setenv("MCX_REPLAY_PLAN", "0")
    model = {"w": [torch.randn(4, 6) for _ in range(LAYERS)], "b": [torch.randn(5) for _ in range(LAYERS)]}
    options = CkptOptions(async_save=mode != "sync", async_ckpt_use_cpu_shm=mode != "sync",
                          ckpt_assume_constant_structure=True)
    expected = {}
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        for it in (1, 2, 3):
            for layers in model.values():
                for t in layers:
                    t.add_(1.0)  # training changes the values in place
            expected[it] = {k: [t.clone() for t in v] for k, v in model.items()}
            ck.save(_stacked(model), tmp_path, iteration=it)
            ck.maybe_finalize(blocking=True)
        cache = ck._planner.conversions
        assert cache.hits >= 2 * len(model), (cache.hits, cache.misses)  # saves 2 and 3 reused
        assert cache.misses == len(model), (cache.hits, cache.misses)  # converted once, at save 1
    shapes = {k: tuple(v[0].shape) for k, v in model.items()}
    for it, want in expected.items():
        got = _load(tmp_path, it, shapes)
        for k in model:
            for g, w in zip(got[k], want[k]):
                assert torch.equal(g, w), (it, k)


def test_a_shard_in_other_memory_converts_anew(one_rank_group, tmp_path):
    """A synchronous save converts the parameters themselves: one replaced by a new tensor of
    the same shape (same structure) must be written from its new memory."""
    model = {"w": [torch.randn(4, 6) for _ in range(LAYERS)]}
    options = CkptOptions(ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.save(_stacked(model), tmp_path, iteration=1)
        model["w"][1] = torch.full((4, 6), 7.0)  # same shape and key, other memory
        ck.save(_stacked(model), tmp_path, iteration=2)
        cache = ck._planner.conversions
        assert cache.misses == 2
        assert len(cache.entries) == 1  # only this save's: the old memory is not kept alive
    got = _load(tmp_path, 2, {"w": (4, 6)})
    assert torch.equal(got["w"][1], torch.full((4, 6), 7.0))
    assert torch.equal(got["w"][0], model["w"][0])
