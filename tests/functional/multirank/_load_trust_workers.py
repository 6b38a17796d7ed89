"""Rank functions of test_load_trust.py (spawned: module level)."""

from __future__ import annotations

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointIntegrityError
from tests._support.dist import sharded


def _state(rank: int) -> dict:
    # "b" is replicated: both ranks read the file that holds it
    return {"w": sharded(rank, 2, {"w": torch.arange(512, dtype=torch.float32) + rank})["w"],
            "b": torch.arange(64, dtype=torch.float32)}


def save(rank: int, world: int, root: str) -> None:
    from megatron.core.dist_checkpointing import ShardedTensor

    with Checkpointer(CkptOptions()) as ck:
        state = _state(rank)
        state["b"] = ShardedTensor.from_rank_offsets("b", state["b"], replica_id=rank)
        ck.save(state, root, iteration=1)


def load_names_each_bad_file_once(rank: int, world: int, root: str, bad: str) -> None:
    from megatron.core.dist_checkpointing import ShardedTensor

    like = {"w": sharded(rank, 2, {"w": torch.zeros(512)})["w"],
            "b": ShardedTensor.from_rank_offsets("b", torch.zeros(64), replica_id=rank)}
    with Checkpointer(CkptOptions()) as ck:
        try:
            ck.load(like, root)
        except CheckpointIntegrityError as e:
            assert str(e).count(bad) == 1, str(e)
        else:
            raise AssertionError(f"rank {rank}: a flipped bit in {bad} loaded")
