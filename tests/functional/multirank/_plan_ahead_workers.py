"""Rank bodies for the planning ahead of the first save (a module of its own so spawned ranks
can import them)."""

from __future__ import annotations

import logging
import time

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save.planner import SavePlanner

from tests._support.dist import sharded
from ._ckpt_workers import assert_equal, load_back, step_state

OPTIONS = {"async_save": True, "use_persistent_ckpt_worker": True,
           "async_ckpt_use_cpu_shm": True, "ckpt_assume_constant_structure": True,
           "ckpt_fully_parallel_save": False}


def _global_plans() -> list[str]:
    """Counts megatron-core's global plans (a save from its cached plan makes none)."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    made: list[str] = []
    for name in ("create_global_plan", "create_decentralized_global_plan"):
        real = getattr(MCoreSavePlanner, name, None)
        if real is not None:
            def spy(self, *a, _real=real, _name=name, **k):
                made.append(_name)
                return _real(self, *a, **k)
            setattr(MCoreSavePlanner, name, spy)
    return made


def _object_collectives_on_the_world_from(thread: str) -> list[str]:
    """The object collectives the thread named ``thread`` ran on the world's own group (or the
    data-parallel one, here the world): those a background thread must never run."""
    import functools
    import threading

    import torch.distributed as dist

    seen: list[str] = []
    for name in ("all_gather_object", "gather_object", "broadcast_object_list",
                 "scatter_object_list"):
        real = getattr(dist, name)

        @functools.wraps(real)  # its signature stays torch's (the redirect reads it)
        def spy(*a, _real=real, _name=name, **k):
            group = k.get("group")
            if threading.current_thread().name == thread and (
                    group is None or group is dist.group.WORLD):
                seen.append(_name)
            return _real(*a, **k)
        setattr(dist, name, spy)
    return seen


def first_save_planned_ahead(rank: int, world: int, root: str, fail_rank: int,
                             fully_parallel: bool = False) -> None:
    """Every rank plans the first save in prepare()'s thread and the first save plans nothing;
    where ``fail_rank``'s planning ahead raises after its collectives, no rank keeps a plan (the
    ranks agree)
    and the first save plans on every rank. Under megatron-core's fully parallel save its
    exchange of shards runs on the planning's own gloo group. Either way the checkpoint loads
    back exactly."""
    if rank == fail_rank:  # its planning's collectives done, this rank fails (writing, say)
        real = SavePlanner._plan_twice

        def broken(*a, **k):
            real(*a, **k)
            raise RuntimeError("planning ahead broken on purpose")
        SavePlanner._plan_twice = broken
    made = _global_plans()
    on_world = _object_collectives_on_the_world_from("mcx-staging-prepare")
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    planner_log = logging.getLogger("megatron_ckpt_ext.save.planner")
    planner_log.addHandler(handler)
    planner_log.setLevel(logging.INFO)
    live = step_state(1, rank)
    from megatron.core.dist_checkpointing import ShardedTensor

    replicated = torch.arange(96.0).to(live["w"].device)  # every rank holds it: one writes it

    def state() -> dict:
        return dict(sharded(rank, world, live),
                    r=ShardedTensor.from_rank_offsets("r", replicated, replica_id=rank))

    options = dict(OPTIONS, ckpt_fully_parallel_save=fully_parallel)
    planning = fail_rank < 0
    with Checkpointer(CkptOptions(**options)) as ck:
        ck.prepare(state())
        start = time.monotonic()
        assert ck.wait_prepared(timeout_s=60)
        assert time.monotonic() - start < 30  # the failing rank's peers did not wait it out
        ahead = len(made)
        kept = ck._planner._strategy is not None
        assert kept == planning, (rank, kept)
        ck.save(state(), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        at_first_save = len(made) - ahead
        assert not on_world, on_world  # the thread planning ahead used its own groups only
        # rank 0 alone says, once, that the first save plans itself
        told = [m for m in said if "could not be planned ahead" in m]
        assert len(told) == (1 if rank == 0 and fail_rank >= 0 else 0), said
        if planning:
            assert ahead > 0 and at_first_save == 0, (ahead, at_first_save)
        else:
            assert at_first_save > 0, at_first_save
        assert_equal(load_back(ck, rank, world, root, 1), step_state(1, rank), "iteration 1")
        like = {"r": ShardedTensor.from_rank_offsets("r", torch.zeros_like(replicated),
                                                     replica_id=rank)}
        assert torch.equal(ck.load(like, root, iteration=1)["r"], replicated)
    torch.distributed.barrier()


def common_state_compared_after_preprocessing(rank: int, world: int, root: str,
                                              preprocess: bool) -> None:
    """Megatron-LM's common state holds ``args`` with this rank's ``rank``: compared as is,
    megatron-core warns on every rank but 0 that its common state differs from rank 0's (at
    prepare()'s validation and at a save that validates); after Megatron-LM's preprocessing
    (``args.rank`` dropped), which the Checkpointer is given, nothing is said."""
    import argparse

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("megatron.core.dist_checkpointing").addHandler(handler)
    live = step_state(1, rank)

    def state() -> dict:
        return dict(sharded(rank, world, live), args=argparse.Namespace(rank=rank, lr=3e-4))

    def megatrons(common: dict) -> dict:  # what Megatron-LM's preprocess_common_state_dict does
        common = dict(common, args=dict(vars(common["args"])))
        common["args"].pop("rank", None)
        return common

    given = megatrons if preprocess else None
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck.prepare(state(), preprocess_common=given)  # validates the sharding now
        assert ck.wait_prepared(timeout_s=60)
    at_prepare = [m for m in said if "common state dict differs" in m]
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:  # unprepared: its first save validates
        ck.save(state(), root, iteration=1, preprocess_common=given)
        ck.maybe_finalize(blocking=True)
        ck.save(state(), root, iteration=2)  # a later save keeps what it was given
        ck.maybe_finalize(blocking=True)
        assert ck._planner.preprocess_common is given
    differs = [m for m in said if "common state dict differs" in m]
    if preprocess or rank == 0:
        assert differs == [], differs
    else:  # the control: megatron-core's comparison runs at both points
        assert len(at_prepare) == 1 and len(differs) == 2, said
    torch.distributed.barrier()
