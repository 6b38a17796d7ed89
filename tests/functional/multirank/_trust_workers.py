"""Rank bodies for test_trust.py: input that once hung a save or was silently dropped."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save.layout import read_tracker

from tests._support.dist import sharded

from ._ckpt_workers import step_state


def nothing_to_write_commits(rank: int, world: int, root: str, options: dict, bound_s: float) -> None:
    """Saves where a rank (or every rank) has no tensor to write must commit promptly in every
    mode: a state of plain numbers, then one whose only tensor is replicated with rank 0 as the
    main replica (rank 1 writes nothing without the fully-parallel split)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    w = torch.arange(16, dtype=torch.float32) + 100 * 7
    with Checkpointer(CkptOptions(**options)) as ck:
        states = {1: {"iteration": 1, "lr": 0.5, "scalar": torch.tensor([3.0])},
                  2: {"iteration": 2, "w": ShardedTensor.from_rank_offsets("w", w.clone(), replica_id=rank)}}
        for it, state in states.items():
            t0 = time.monotonic()
            ck.save(state, root, iteration=it)
            ck.maybe_finalize(blocking=True)
            took = time.monotonic() - t0
            assert took < bound_s, f"save {it} took {took:.1f} s (waited for the timeout?)"
        assert read_tracker(root) == 2
        back = ck.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(16), replica_id=rank)},
                       root)
        assert torch.equal(back["w"], w) and back["iteration"] == 2
        first = ck.load({}, root, iteration=1)
        assert first["lr"] == 0.5 and torch.equal(first["scalar"], torch.tensor([3.0]))


def plain_tensor_on_one_rank_fails_everywhere(rank: int, world: int, root: str, options: dict,
                                              out: str) -> None:
    """The last rank alone holds a plain multi-element tensor: every rank raises before
    anything is written, the committed iteration 1 stays the latest and no working directory is
    left."""
    with Checkpointer(CkptOptions(**options)) as ck:
        ck.save(sharded(rank, world, step_state(1, rank)), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        state = sharded(rank, world, step_state(2, rank))
        if rank == world - 1:
            state["extra"] = {"bias": torch.ones(3)}
        try:
            ck.save(state, root, iteration=2)
        except ValueError as e:
            Path(out, f"error{rank}").write_text(str(e))
        else:
            raise AssertionError(f"rank {rank}: save with a plain tensor did not raise")
        ck.maybe_finalize(blocking=True)
        assert read_tracker(root) == 1
        ck.save(sharded(rank, world, step_state(3, rank)), root, iteration=3)  # still usable
        ck.maybe_finalize(blocking=True)  # its commit ends with a barrier: rank 0's clean-up is seen
        assert read_tracker(root) == 3
        assert not list(Path(root).glob("iter_*.incomplete")), list(Path(root).iterdir())
