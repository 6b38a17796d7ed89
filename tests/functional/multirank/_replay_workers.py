"""Rank bodies for steady saves replaying megatron-core's plan on every rank (a module of its
own so spawned ranks can import them)."""

from __future__ import annotations

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions

from tests._support.dist import sharded
from ._ckpt_workers import assert_equal, load_back, step_state

OPTIONS = {"async_save": True, "use_persistent_ckpt_worker": True,
           "async_ckpt_use_cpu_shm": True, "ckpt_assume_constant_structure": True}


def steady_saves_replay(rank: int, world: int, root: str, fully_parallel: bool,
                        change_rank: int) -> None:
    """Every rank's steady saves replay (the first one too, after prepare()), under megatron-core's
    fully parallel save as well; each checkpoint loads back exactly: this rank's slices, a
    replicated tensor one rank writes, a per-rank object. From save 4 on, ``change_rank``'s
    replicated tensor carries another replica id (the same keys, shapes and offsets): that rank
    plans save 4 in full while the others replay it, with no collective between them (the run
    ends within its timeout), and replays again from save 5. (Under the fully parallel save the
    wrapper sets the replica ids from its cached distribution: no change reaches the replay.)"""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    replicated = torch.arange(96.0)

    def state(step: int) -> dict:
        live = step_state(step, rank)
        replica = (rank, 0) if rank == change_rank and step >= 4 else rank
        return dict(sharded(rank, world, live),
                    r=ShardedTensor.from_rank_offsets("r", replicated + step, replica_id=replica),
                    o=ShardedObject("o", {"rank": rank, "step": step}, (world,), (rank,),
                                    replica_id=0))

    options = CkptOptions(**OPTIONS, ckpt_fully_parallel_save=fully_parallel)
    with Checkpointer(options) as ck:
        ck.prepare(state(0))
        assert ck.wait_prepared(timeout_s=60)
        for step in range(1, 7):
            ck.save(state(step), root, iteration=step)
            ck.maybe_finalize(blocking=True)
        paths = [r["stage_detail"].get("plan") for r in ck.reports]
        want = ["replayed"] * 6
        if rank == change_rank:
            want[3] = "planned"
        assert paths == want, (rank, paths)
        for step in (1, 4, 6):
            assert_equal(load_back(ck, rank, world, root, step), step_state(step, rank),
                         f"iteration {step}")
            like = {"r": ShardedTensor.from_rank_offsets("r", torch.zeros(96), replica_id=rank),
                    "o": ShardedObject("o", None, (world,), (rank,), replica_id=0)}
            got = ck.load(like, root, iteration=step)
            assert torch.equal(got["r"], replicated + step), step
            assert got["o"] == {"rank": rank, "step": step}, (step, got["o"])
    torch.distributed.barrier()
