"""The commit is the Checkpointer's own step after the writers report a save written (not a
callback inside the backend's finalization): a failed commit is said as a commit failure, async
and sync alike, and under --ckpt-failure-policy warn the next save commits."""

from __future__ import annotations

import errno

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend
from megatron_ckpt_ext.errors import CheckpointWriteError
from megatron_ckpt_ext.save import steps
from megatron_ckpt_ext.save.layout import read_tracker


def _state() -> dict:
    st = backend.sharded_tensor_cls()
    return {"w": st.from_rank_offsets("w", torch.randn(64), replica_id=0)}


@pytest.fixture
def full_disk_at_first_commit(monkeypatch):
    real, calls = steps.commit_on_disk, []

    def commit(root, iteration, **kwargs):
        calls.append(iteration)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(root, iteration, **kwargs)

    monkeypatch.setattr(steps, "commit_on_disk", commit)
    return calls


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_a_failed_commit_is_said_as_a_commit_failure(one_rank_group, tmp_path, is_async,
                                                     full_disk_at_first_commit):
    options = CkptOptions(async_save=is_async, async_ckpt_use_cpu_shm=is_async)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        with pytest.raises(CheckpointWriteError, match="its commit failed") as raised:
            ck.save(_state(), tmp_path, iteration=1)
            ck.maybe_finalize(blocking=True)
        assert "write failed" not in str(raised.value)
    assert full_disk_at_first_commit == [1]


def test_under_warn_a_failed_commit_is_logged_and_the_next_save_commits(
        one_rank_group, tmp_path, full_disk_at_first_commit):
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          use_persistent_ckpt_worker=True, ckpt_failure_policy="warn")
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        ck.save(_state(), tmp_path, iteration=1)
        assert ck.maybe_finalize(blocking=True) == []
        assert "its commit failed" in ck.failed_saves[0]["error"]
        ck.save(_state(), tmp_path, iteration=2)
        assert ck.maybe_finalize(blocking=True) == [2]
    assert read_tracker(tmp_path) == 2 and full_disk_at_first_commit == [1, 2]
