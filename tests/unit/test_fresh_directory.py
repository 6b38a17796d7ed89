"""megatron-core warns "Overwriting old incomplete / corrupted checkpoint..." when the directory
it saves into is not empty; ours is created empty by rank 0 for each save, so that warning only
means another rank's writer got there first: dropped while we plan, and nowhere else."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_ckpt_ext import backend


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    from megatron_ckpt_ext import _cpu_shim

    _cpu_shim.install()  # stock megatron-core's save calls torch.cuda.* (a no-op on CPU then)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _save_into_non_empty(directory):
    from megatron.core.dist_checkpointing import ShardedTensor

    directory.mkdir()
    (directory / "__1_0.distcp").write_bytes(b"another rank's file")
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0), replica_id=0)}
    backend.dist_checkpointing().save(state, str(directory))


def test_the_overwrite_warning_is_dropped_only_while_we_plan(world_of_one, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        with backend.into_fresh_directory():
            _save_into_non_empty(tmp_path / "ours")
        assert not [r for r in caplog.records if "Overwriting" in r.getMessage()]
        _save_into_non_empty(tmp_path / "stock")  # outside: megatron-core's warning stands
    assert [r for r in caplog.records if "Overwriting" in r.getMessage()]
