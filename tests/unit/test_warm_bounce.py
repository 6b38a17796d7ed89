"""The pinned bounce pool a restore from memory copies through is built ahead, while the model
is built (Checkpointer.prepare_restore), where this node holds this rank's sealed snapshot of
the directory to load; the restore takes it, or the load (or close) releases it unused. On CPU
the pool is a stand-in that counts its builds and releases (the real one pins with CUDA)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.staging import retained
from megatron_ckpt_ext.staging.retained import discard, read_seal

from tests._support.seals import save_and_wait_for_the_seal


class _Pool:
    built: list["_Pool"] = []

    def __init__(self, threads: int, chunk: int) -> None:
        self.sizes, self.thread = (threads, chunk), threading.current_thread().name
        self.closed = False
        _Pool.built.append(self)

    def close(self, *, synced: bool) -> None:
        self.closed = True


@pytest.fixture
def pool(monkeypatch):
    """retained's pool replaced by the stand-in, a CUDA device reported to it; no pool left
    after."""
    _Pool.built = []
    monkeypatch.setattr(retained, "_Bounce", _Pool)
    monkeypatch.setattr(retained, "_cuda_device", lambda: 0)
    monkeypatch.setattr(retained, "_use_device", lambda device: None)
    yield _Pool
    retained.drop_warm_bounce()


def test_a_warm_pool_is_built_in_the_background_and_taken_once(pool):
    assert retained.warm_bounce(chunk=8, threads=2)
    assert not retained.warm_bounce(chunk=8, threads=2)  # one at a time
    taken = retained.take_warm_bounce(2, 8)
    assert taken is pool.built[0] and taken.thread == "mcx-warm-bounce" and not taken.closed
    assert retained.take_warm_bounce(2, 8) is None  # taken: gone


def test_a_warm_pool_of_other_sizes_or_left_unused_is_released(pool):
    assert retained.warm_bounce(chunk=8, threads=2)
    assert retained.take_warm_bounce(4, 8) is None and pool.built[0].closed
    assert retained.warm_bounce(chunk=8, threads=2)
    assert retained.drop_warm_bounce() and pool.built[1].closed
    assert not retained.drop_warm_bounce()


OPTIONS = dict(async_save=True, async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True)


@pytest.fixture
def sealed(one_rank_group, tmp_path):
    """``sealed(iterations)``: a directory whose last of ``iterations`` (saved in order) stays
    sealed in this node's memory, as after a job that went down; the seal is removed after."""
    seals: list[str] = []

    def make(iterations: tuple[int, ...] = (1,)) -> Path:
        root = tmp_path / "ckpt"
        with Checkpointer(CkptOptions(**OPTIONS), save_dir=str(root)) as ck:
            for it in iterations[:-1]:
                ck.save(_like(), root, iteration=it)
                ck.maybe_finalize(blocking=True)
            seals.append(save_and_wait_for_the_seal(ck, root, iteration=iterations[-1]))
            ck.close(after_error=True)  # the job went down: its snapshot stays
        return root

    yield make
    for path in seals:
        found = read_seal(path)
        if found is not None:
            discard(found, is_mapped=lambda p: False)


def test_prepare_restore_warms_only_for_a_sealed_snapshot_of_that_directory(pool, sealed,
                                                                             tmp_path):
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert not ck.prepare_restore(tmp_path / "other") and not pool.built  # nothing sealed
        assert ck.prepare_restore(root)
        assert len(pool.built) == 1 and not pool.built[0].closed
        assert ck.load(_like(), str(root)) is not None
        assert pool.built[0].closed  # no device to restore to on CPU: released unused
        assert not retained.drop_warm_bounce()
    with Checkpointer(CkptOptions(**OPTIONS, ckpt_memory_restore=False)) as ck:
        assert not ck.prepare_restore(root)  # the memory tier off: nothing to warm


def test_a_load_the_snapshot_cannot_serve_releases_the_pool(pool, sealed):
    """The snapshot holds iteration 2; a load of iteration 1 reads storage, and releases the
    pool the restore would have taken."""
    root = sealed((1, 2))
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
        assert ck.load(_like(), str(root), iteration=1) is not None
        assert ck.load_reports[-1]["tier"] == "storage"
        assert pool.built[0].closed


def test_close_releases_a_pool_no_load_took(pool, sealed):
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
    assert pool.built[0].closed


def _like() -> dict:
    from megatron_ckpt_ext import backend

    st = backend.sharded_tensor_cls()
    return {"w": st.from_rank_offsets("w", torch.zeros(4096), replica_id=0)}
