"""Rank functions of test_guards.py (spawned: module level)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save.layout import read_tracker
from tests._support.dist import sharded

WARN_PERSISTENT = {"async_save": True, "use_persistent_ckpt_worker": True,
                   "async_ckpt_use_cpu_shm": True, "ckpt_assume_constant_structure": True,
                   "ckpt_failure_policy": "warn"}


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(2048, dtype=torch.float32) + 1000 * rank + step}


def _kill_persistent_worker() -> None:
    """SIGKILL this trainer's persistent writer (its one child that is not multiprocessing's
    resource tracker) and wait until it has exited, unreaped (its parent must see the exit)."""
    import psutil

    writers = [p for p in psutil.Process().children()
               if not any("resource_tracker" in part for part in p.cmdline())]
    assert len(writers) == 1, f"expected one persistent writer, found {writers}"
    os.kill(writers[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if writers[0].status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"writer {writers[0].pid} still alive after SIGKILL")


def dead_worker_under_warn(rank: int, world: int, root: str) -> None:
    """Save 1; the last rank's persistent writer is SIGKILLed between saves; under
    --ckpt-failure-policy warn, save 2 must commit (a new writer serves it) and load back."""
    rootp = Path(root)
    with Checkpointer(CkptOptions(**WARN_PERSISTENT)) as ck:
        ck.save(sharded(rank, world, _state(rank, 1)), rootp, iteration=1)
        ck.maybe_finalize(blocking=True)
        if rank == world - 1:
            _kill_persistent_worker()
        torch.distributed.barrier()  # every rank saves after the death
        ck.save(sharded(rank, world, _state(rank, 2)), rootp, iteration=2)
        ck.maybe_finalize(blocking=True)
        assert read_tracker(rootp) == 2, f"rank {rank}: save 2 did not commit"
        like = {k: torch.zeros_like(v) for k, v in _state(rank, 0).items()}
        got = ck.load(sharded(rank, world, like), rootp, iteration=2)
    assert torch.equal(got["w"], _state(rank, 2)["w"]), rank


def staging_fails_on_the_last_rank(rank: int, world: int, root: str, where: str) -> None:
    """The staging buffers cannot be allocated on the last rank only (as /dev/shm full on one
    node), in prepare()'s background thread (``where`` "prepare") or in the first save's own
    staging ("stage"): no rank may hang; every rank's first save raises CheckpointWriteError
    naming that rank, and nothing is committed."""
    from megatron_ckpt_ext.errors import CheckpointWriteError
    from megatron_ckpt_ext.staging.shm import ShmStager

    options = {**WARN_PERSISTENT, "ckpt_failure_policy": "raise"}
    name = "_prepare_locked" if where == "prepare" else "_acquire"
    real = getattr(ShmStager, name)
    if rank == world - 1:
        def full(self, specs, **kwargs):
            raise OSError(28, "No space left on device (test: /dev/shm full on this node)")

        setattr(ShmStager, name, full)
    rootp = Path(root)
    with Checkpointer(CkptOptions(**options)) as ck:
        if where == "prepare":
            ck.prepare(sharded(rank, world, _state(rank, 1)))
        try:
            ck.save(sharded(rank, world, _state(rank, 1)), rootp, iteration=1)
            ck.maybe_finalize(blocking=True)
        except CheckpointWriteError as e:
            assert f"staging failed on rank {world - 1}" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: the save went on")
        finally:
            setattr(ShmStager, name, real)
        assert read_tracker(rootp) is None
        ck.save(sharded(rank, world, _state(rank, 2)), rootp, iteration=2)  # room again
        ck.maybe_finalize(blocking=True)
        assert read_tracker(rootp) == 2
