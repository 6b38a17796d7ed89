"""What the tests of a restore from memory prepared ahead share (test_warm_bounce.py,
test_device_ahead.py): the bounce pool's stand-in and the ``pool`` fixture that installs it, a
directory whose last save stays sealed in this node's memory (the ``sealed`` fixture; both
fixtures reach tests/unit through its conftest.py), and the one-tensor state they load."""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import threading
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.staging import restore_copy
from megatron_ckpt_ext.staging.retained import discard, read_seal
from megatron_ckpt_ext.staging.segments import SEGMENT_PREFIX, SHM_DIR, is_mapped

from tests._support.seals import save_and_wait_for_the_seal

__all__ = ["OPTIONS", "_Pool", "_join_release", "_like", "_loaded_w", "_memory_detail", "pool",
           "sealed"]


class _Pool:
    built: list["_Pool"] = []

    def __init__(self, threads: int, chunk: int) -> None:
        self.sizes, self.thread = (threads, chunk), threading.current_thread().name
        self.closed = False
        _Pool.built.append(self)

    def close(self, *, synced: bool) -> None:
        self.closed, self.closed_by = True, threading.current_thread().name


def _join_release() -> None:
    """The load unpins an unused pool on a thread of its own: wait for it."""
    for thread in threading.enumerate():
        if thread.name == "mcx-warm-bounce-release":
            thread.join(10)


@pytest.fixture
def pool(monkeypatch):
    """restore_copy's pool replaced by the stand-in, a CUDA device reported to it; no pool left
    after."""
    _Pool.built = []
    monkeypatch.setattr(restore_copy, "_Bounce", _Pool)
    monkeypatch.setattr(restore_copy, "cuda_device", lambda: 0)
    monkeypatch.setattr(restore_copy, "use_device", lambda device: None)
    yield _Pool
    restore_copy.drop_warm_bounce()



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
    # the staging a "went down" job left unsealed (close(after_error=True)): the start-up sweep
    # of a later run would remove it, but this process is alive, so it is removed here
    gc.collect()  # (mappings no object holds any more)
    for path in glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}*_{os.getpid()}_*")):
        if not is_mapped(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)



def _like() -> dict:
    from megatron_ckpt_ext import backend

    st = backend.sharded_tensor_cls()
    return {"w": st.from_rank_offsets("w", torch.zeros(4096), replica_id=0)}


def _memory_detail(ck) -> dict:
    report = ck.load_reports[-1]
    return dict(report["memory_detail"], tier=report["tier"])


def _loaded_w(state: dict) -> torch.Tensor:
    w = state["w"]
    return getattr(w, "data", w)
