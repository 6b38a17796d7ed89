"""The background work a load leaves (``load/after.py``): started as ``Checkpointer.load()``
returns, or, inside ``deferred()`` (the launcher's Megatron-LM ``load_checkpoint``), once the
caller's whole load is done; the first save after it still stages into prepared buffers."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend
from megatron_ckpt_ext.load.after import after_load, deferred


def _state(tensors: dict[str, torch.Tensor]) -> dict:
    st = backend.sharded_tensor_cls()
    return {k: st.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}


def test_work_runs_at_once_outside_and_in_order_when_the_outermost_block_ends(monkeypatch):
    monkeypatch.delenv("MCX_BACKGROUND_IN_LOAD", raising=False)
    ran: list[str] = []
    after_load(lambda: ran.append("now"))
    assert ran == ["now"]
    with deferred():
        after_load(lambda: ran.append("a"))
        with deferred():  # nested: left to the outermost
            after_load(lambda: ran.append("b"))
        assert ran == ["now"]
    assert ran == ["now", "a", "b"]


def test_after_an_error_only_the_releases_run(monkeypatch):
    monkeypatch.delenv("MCX_BACKGROUND_IN_LOAD", raising=False)
    ran: list[str] = []
    with pytest.raises(RuntimeError, match="load failed"):
        with deferred():
            after_load(lambda: ran.append("prepare"))
            after_load(lambda: ran.append("release"), always=True)
            raise RuntimeError("load failed")
    assert ran == ["release"]
    after_load(lambda: ran.append("later"))  # nothing left held
    assert ran == ["release", "later"]


def test_the_switch_starts_it_inside_the_block(monkeypatch):
    monkeypatch.setenv("MCX_BACKGROUND_IN_LOAD", "1")
    ran: list[str] = []
    with deferred():
        after_load(lambda: ran.append("x"))
        assert ran == ["x"]


def test_a_deferred_load_prepares_after_the_block_and_the_first_save_stages_into_it(
        one_rank_group, tmp_path, monkeypatch):
    """Inside the block the load allocates no staging (the prepare() it ends with waits for the
    block's end); after it the first save copies into the buffers prepared then."""
    monkeypatch.delenv("MCX_BACKGROUND_IN_LOAD", raising=False)
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(4096)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True, ckpt_memory_restore=False)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.save(_state(tensors), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        prepared: list[int] = []
        real_prepare = ck.prepare
        monkeypatch.setattr(ck, "prepare", lambda *a, **k: prepared.append(1) or real_prepare(*a, **k))
        with deferred():
            ck.load(_state({k: torch.zeros_like(t) for k, t in tensors.items()}), tmp_path)
            assert prepared == [] and ck.staging_stats().get("allocations", 0) == 0
        assert prepared == [1]
        assert ck.wait_prepared(timeout_s=60)
        assert ck.staging_stats()["allocations"] > 0
        ck.save(_state(tensors), tmp_path, iteration=2)
        ck.maybe_finalize(blocking=True)
        detail = ck.reports[-1]["stage_detail"]
        assert detail["allocations"] == 0 and detail["sets_built_at_stage"] == 0, detail
