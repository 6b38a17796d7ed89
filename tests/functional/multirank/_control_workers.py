"""Rank functions for test_control_group.py (spawned ranks import them from here)."""

from __future__ import annotations

from typing import Any


def _as_nccl(groups: list[Any]) -> list[tuple[Any, str]]:
    """Make ``groups`` report NCCL as their only backend (as Megatron-LM's world does) and
    record each of our collectives' (group, tensor device); the returned list fills as they
    run."""
    import torch.distributed as dist

    real_backend, used = dist.get_backend, []

    def get_backend(group: Any = None) -> str:
        target = dist.group.WORLD if group is None else group
        return "nccl" if any(target is g for g in groups) else real_backend(group)

    def recording(real: Any) -> Any:
        def call(tensor_or_list: Any, *args: Any, group: Any = None, **kw: Any) -> Any:
            t = tensor_or_list[0] if isinstance(tensor_or_list, list) else tensor_or_list
            used.append((group, t.device.type))
            return real(tensor_or_list, *args, group=group, **kw)
        return call

    dist.get_backend = get_backend
    dist.all_reduce = recording(dist.all_reduce)
    dist.all_gather = recording(dist.all_gather)
    return used


def _check(group: Any, members: list[int], rank: int, used: list) -> None:
    import torch.distributed as dist

    from megatron_ckpt_ext.collectives import Group
    from megatron_ckpt_ext.options import CkptOptions

    g = Group(group, CkptOptions())
    assert g.all_max([float(rank), -float(rank)]) == [float(max(members)), -float(min(members))]
    assert g.all_sum([1.0]) == [float(len(members))]
    assert g.all_gather(("rank", rank)) == [("rank", r) for r in members]
    g.barrier()
    control = g.control()
    assert control is not (group or dist.group.WORLD), "our collectives ran on the NCCL group"
    assert dist.get_process_group_ranks(control) == members
    assert used and all(grp is control and dev == "cpu" for grp, dev in used), used


def world_reports_nccl(rank: int, world: int) -> None:
    """The checkpoint's own collectives over an NCCL-only world run on a gloo group of the
    world's ranks, with host tensors."""
    import torch.distributed as dist

    used = _as_nccl([dist.group.WORLD])
    _check(None, list(range(world)), rank, used)


def subgroup_reports_nccl(rank: int, world: int) -> None:
    """Over an NCCL-only group of ranks 0 and 1 of three, only those two make the gloo group
    and use it; rank 2 never reaches our collectives. With TORCH_DIST_INIT_BARRIER=1 (set by
    the test) a group made the default way waits for every rank of the world, so it would hang
    here."""
    import torch.distributed as dist

    members = [0, 1]
    sub = dist.new_group(ranks=members, backend="gloo")  # every rank makes it (global)
    used = _as_nccl([sub])
    if rank in members:
        _check(sub, members, rank, used)
    dist.barrier()  # rank 2 waits at the world's barrier, not inside ours


def planning_collectives_on_the_host(rank: int, world: int, root: str) -> None:
    """Saves through the Checkpointer over an NCCL-only world (patched, as above): every object
    collective megatron-core and torch DCP run on the default group while planning (the first
    save's validation and plan, the next saves' cached plan) and finalizing (the metadata's
    gather) runs on the Checkpointer's gloo group; the checkpoints load back."""
    import functools

    import torch
    import torch.distributed as dist

    from megatron_ckpt_ext import Checkpointer, CkptOptions
    from tests._support.dist import sharded

    real_backend = dist.get_backend
    _as_nccl([dist.group.WORLD])
    seen: list[tuple[str, Any]] = []

    def recording(name: str, real: Any) -> Any:
        @functools.wraps(real)  # the same signature, as the redirect reads it
        def call(*args: Any, **kw: Any) -> Any:
            seen.append((name, kw.get("group")))
            return real(*args, **kw)
        return call

    for name in ("all_gather_object", "gather_object", "broadcast_object_list",
                 "scatter_object_list"):
        setattr(dist, name, recording(name, getattr(dist, name)))
    state = {"w": torch.arange(64, dtype=torch.float32) + rank, "b": torch.ones(16) * rank}
    with Checkpointer(CkptOptions(async_save=True, ckpt_assume_constant_structure=True)) as ck:
        for it in (1, 2, 3):
            ck.save(sharded(rank, world, state), root, iteration=it)
            ck.maybe_finalize(blocking=True)
        control = ck._group.control()
        assert seen, "no object collective recorded: the test no longer sees planning"
        names = {None: "default", control: "ours"}
        assert all(group is not None for _, group in seen), \
            [(n, names.get(g, "a group named by the caller")) for n, g in seen]
        assert any(group is control for _, group in seen)
        dist.get_backend = real_backend  # torch's own logging of the load asks NCCL's version
        back = ck.load(sharded(rank, world, {k: torch.zeros_like(v) for k, v in state.items()}),
                       root, iteration=3)
        assert all(torch.equal(back[k], state[k]) for k in state)


def no_gloo_falls_back_with_one_warning(rank: int, world: int) -> None:
    """Where no gloo group can be made, our collectives stay on the given group (the world
    here), and rank 0 alone says why, once."""
    import logging

    import torch.distributed as dist

    from megatron_ckpt_ext.collectives import Group
    from megatron_ckpt_ext.options import CkptOptions

    _as_nccl([dist.group.WORLD])

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Distributed package doesn't have Gloo built in")

    dist.new_group = refuse
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("megatron_ckpt_ext.collectives").addHandler(handler)
    g = Group(None, CkptOptions())
    assert g.control() is None and g.world_control() is None and g.control() is None
    texts = [r.getMessage() for r in records]
    assert len(texts) == (1 if rank == 0 else 0), texts
    assert rank != 0 or "Gloo built in" in texts[0]


def suspended_inside_a_collective(rank: int, world: int, out: str) -> None:
    """Over an NCCL-only world (the gloo group ours): rank 0 waits in one of our collectives,
    bounded by 3 s, while rank 1 has not reached it; the test stops both longer than the bound
    and continues them, then rank 1 comes. What each saw goes to ``out/rank<r>.json``."""
    import json
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    from megatron_ckpt_ext.collectives import Group
    from megatron_ckpt_ext.errors import CheckpointWriteError
    from megatron_ckpt_ext.options import CkptOptions

    _as_nccl([dist.group.WORLD])
    made, new_group = [], dist.new_group
    dist.new_group = lambda *a, **k: made.append(k.get("timeout")) or new_group(*a, **k)
    group = Group(None, CkptOptions())
    group.barrier()  # our gloo group made, every rank here
    dist.new_group = new_group
    Path(out, f"pid_r{rank}").write_text(str(os.getpid()))
    error, got = None, None
    with group.capped(3.0):
        if rank == 0:
            Path(out, "waiting").write_text("")
        else:
            while not Path(out, "go").exists():  # the test says so while every rank is stopped
                time.sleep(0.01)
        try:
            got = group.all_max([float(rank)])
        except CheckpointWriteError as e:
            error = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "error": error, "got": got, "group_timeout_s": [t and t.total_seconds() for t in made]}))
