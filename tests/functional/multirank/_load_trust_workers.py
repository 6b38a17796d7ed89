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


def _plan_locally_as_megatron_core_0_19() -> None:
    """torch DCP's loads called with ``no_dist=True``, as megatron-core 0.19 calls them: each
    rank plans alone, so no DCP collective tells the others that one rank's planning failed."""
    import functools

    import torch.distributed.checkpoint as dcp

    for name in ("load_state_dict", "load"):
        fn = getattr(dcp, name)

        @functools.wraps(fn)
        def alone(*args, _fn=fn, **kwargs):
            kwargs["no_dist"] = True
            return _fn(*args, **kwargs)

        setattr(dcp, name, alone)


def load_where_one_rank_does_not_fit(rank: int, world: int, root: str, verify: bool,
                                     local: bool) -> None:
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_ckpt_ext.errors import CheckpointLoadError

    if local:
        _plan_locally_as_megatron_core_0_19()
    like = {"w": sharded(rank, 2, {"w": torch.zeros(512)})["w"],
            "b": ShardedTensor.from_rank_offsets("b", torch.zeros(64), replica_id=rank)}
    if rank == 1:  # a tensor the checkpoint lacks, on this rank only (a pipeline stage's)
        like["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(8), replica_id=0)
    with Checkpointer(CkptOptions(ckpt_verify_load=verify)) as ck:
        try:
            ck.load(like, root)
        except CheckpointLoadError as e:
            message = str(e)
        else:
            raise AssertionError(f"rank {rank}: loaded although rank 1's state does not fit")
    assert "does not fit the state this job builds" in message, message
    assert "extra from model not in state dict" in message, message
    if local:  # the rank whose own state fits says which rank's does not
        assert ("on rank 1" in message) == (rank == 0), message


def load_plans_on_each_rank(rank: int, world: int, root: str) -> None:
    """Every torch DCP load of a storage load at two ranks runs without DCP's collectives
    (``use_dist`` False: megatron-core 0.16 asked for them), and the values are right."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint import utils

    real, use_dist = utils._DistWrapper.__init__, []

    def init(self, group, use, *args, **kwargs):
        use_dist.append(use)
        real(self, group, use, *args, **kwargs)

    utils._DistWrapper.__init__ = init
    like = {"w": sharded(rank, 2, {"w": torch.zeros(512)})["w"],
            "b": ShardedTensor.from_rank_offsets("b", torch.zeros(64), replica_id=rank)}
    try:
        with Checkpointer(CkptOptions()) as ck:
            got = ck.load(like, root)
            assert ck.load_reports[-1]["verified"] is True
    finally:
        utils._DistWrapper.__init__ = real
    assert use_dist and not any(use_dist), use_dist
    want = _state(rank)
    assert torch.equal(got["w"], want["w"].data) and torch.equal(got["b"], want["b"]), got
