"""Rank functions of test_integrity.py (spawned: module level)."""

from __future__ import annotations

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointIntegrityError
from tools._dist import sharded


def _state(rank: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.float32) + 100 * rank}


def save_two_ranks(rank: int, world: int, root: str) -> None:
    with Checkpointer(CkptOptions(async_save=True)) as ck:
        ck.save(sharded(rank, world, _state(rank)), root, iteration=1)
        ck.maybe_finalize(blocking=True)


def load_fails_naming(rank: int, world: int, root: str, bad: str) -> None:
    like = {"w": torch.zeros(1024)}
    with Checkpointer(CkptOptions()) as ck:
        try:
            ck.load(sharded(rank, world, like), root)
        except CheckpointIntegrityError as e:
            assert bad in str(e) and "iteration 1" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: a flipped bit in {bad} loaded")
