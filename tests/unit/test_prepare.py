"""``Checkpointer.prepare()``: the first save after it stages into the buffers it allocated
(counted by the stager, not timed)."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend


def _state(tensors: dict[str, torch.Tensor]) -> dict:
    st = backend.sharded_tensor_cls()
    return {k: st.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}


@pytest.mark.parametrize("persistent", [False, True], ids=["temporal", "persistent"])
def test_the_first_save_after_prepare_stages_into_the_prepared_buffers(one_rank_group, tmp_path,
                                                                       persistent):
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(4096), "h": torch.arange(300.0)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          use_persistent_ckpt_worker=persistent,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.prepare(_state(tensors))
        assert ck.wait_prepared(timeout_s=60)
        stats = ck.staging_stats()
        prepared = (stats["allocations"], stats["bytes_allocated"])
        assert prepared[1] >= sum(t.numel() * t.element_size() for t in tensors.values())
        ck.save(_state(tensors), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
        stats = ck.staging_stats()
        assert (stats["allocations"], stats["bytes_allocated"]) == prepared
        assert stats["stages"] == 1
        detail = ck.reports[-1]["stage_detail"]
        assert detail["allocations"] == 0 and detail["sets_built_at_stage"] == 0, detail


def test_the_report_says_what_a_first_save_without_prepare_spent_on_staging(one_rank_group,
                                                                           tmp_path):
    """The first save's report names its allocation (rank 0's stage_detail); the next save,
    into the same buffers, allocates nothing."""
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(4096)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        for it in (1, 2):
            ck.save(_state(tensors), tmp_path, iteration=it)
            ck.maybe_finalize(blocking=True)
        first, second = (r["stage_detail"] for r in ck.reports)
        assert first["allocations"] == 2 and first["allocate_s"] > 0, first
        assert "admit_s" in first and "admit_s" not in second, (first, second)
        assert second["allocations"] == 0 and second["allocate_s"] == 0, second
