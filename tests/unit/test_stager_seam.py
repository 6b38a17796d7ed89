"""``Checkpointer(stager=...)``: the seam through which a caller (a test injecting a fault) hands
in its own stager instead of patching the one the options choose. A stager of the wrong kind for
the options is refused before anything is taken, naming the flag; one that fits is the one every
save stages through, and the Checkpointer closes it."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, CkptOptionsError
from megatron_ckpt_ext.staging import HostCopyStager, InPlaceStager, ShmStager
from tests._support.dist import sharded

SHM = {"async_save": True, "async_ckpt_use_cpu_shm": True}


def _shm(reuse: bool) -> ShmStager:
    return ShmStager(job_id="seam-test", rank=0, reuse=reuse, sweep=False)


@pytest.mark.parametrize("options, make, flag", [
    (SHM, HostCopyStager, "--async-ckpt-use-cpu-shm"),
    ({}, lambda: _shm(False), "--async-ckpt-use-cpu-shm"),
    ({"async_save": True}, lambda: _shm(False), "--async-ckpt-use-cpu-shm"),
    ({"async_save": True}, InPlaceStager, "--async-save"),
    ({}, HostCopyStager, "--async-save"),
    ({**SHM, "ckpt_assume_constant_structure": True}, lambda: _shm(False),
     "--ckpt-assume-constant-structure"),
    (SHM, lambda: _shm(True), "--ckpt-assume-constant-structure"),
])
def test_a_stager_of_the_wrong_kind_is_refused_naming_the_flag_before_the_job_lock(
        options, make, flag, tmp_path):
    stager = make()
    try:
        with pytest.raises(CkptOptionsError, match=flag) as e:
            Checkpointer(CkptOptions(**options), stager=stager, save_dir=tmp_path)
        assert isinstance(e.value, ValueError)
        assert type(stager).__name__ in str(e.value)
        assert not list(tmp_path.iterdir()), "the job lock was taken before the stager's check"
    finally:
        stager.close()


class _Counting(InPlaceStager):
    """A sync stager that counts what it is asked (a test's own stager, passed in)."""

    def __init__(self) -> None:
        self.staged: list[int] = []
        self.closed = 0

    def stage(self, tensors, **kwargs):  # type: ignore[no-untyped-def]
        self.staged.append(len(tensors))
        return super().stage(tensors, **kwargs)

    def close(self) -> None:
        self.closed += 1


def test_a_stager_that_fits_stages_every_save_and_is_closed_with_the_checkpointer(
        tmp_path, one_rank_group):
    stager = _Counting()
    with Checkpointer(CkptOptions(), stager=stager) as ck:
        for step in (1, 2):
            ck.save(sharded(0, 1, {"w": torch.full((8,), float(step)), "b": torch.ones(3)}),
                    tmp_path, iteration=step)
        assert stager.staged == [2, 2] and stager.closed == 0
        got = ck.load(sharded(0, 1, {"w": torch.zeros(8), "b": torch.zeros(3)}), tmp_path)
        assert torch.equal(got["w"], torch.full((8,), 2.0))
    assert stager.closed == 1


def test_a_passed_shared_memory_stager_is_freed_by_close(tmp_path):
    stager = _shm(True)
    stager.prepare([torch.ones(4)], keys=["w"])
    assert stager.segments()  # it holds /dev/shm now
    Checkpointer(CkptOptions(**SHM, ckpt_assume_constant_structure=True), stager=stager).close()
    assert stager.segments() == []
    with pytest.raises(RuntimeError, match="closed"):
        stager.stage([torch.ones(4)], keys=["w"])
