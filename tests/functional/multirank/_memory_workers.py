"""Rank functions for test_memory_tier.py: a job that saves and dies without closing (its sealed
snapshot stays in /dev/shm), and the restarted job that loads."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.staging.retained import seal_path

from tests._support.dist import sharded
from ._ckpt_workers import assert_equal, load_back, step_state


def _wait_sealed(root: str, rank: int) -> None:
    """Until this rank's committed save is sealed (in the background), then every rank."""
    deadline = time.monotonic() + 30
    while not os.path.exists(seal_path("/dev/shm", root, rank)):
        assert time.monotonic() < deadline, "the committed save was never sealed"
        time.sleep(0.02)
    torch.distributed.barrier()


def with_rerun_object(rank: int, state: dict) -> dict:
    """``state`` plus a ShardedObject as Megatron-LM's save adds its rerun state machine's (one
    shard, every rank a replica); its load leaves it out unless that machine was running."""
    from megatron.core.dist_checkpointing import ShardedObject

    return {**state, "rerun": ShardedObject("rerun_state_machine_state", {"state": 0}, (1,),
                                            (0,), replica_id=rank)}


def save_and_die(rank: int, world: int, root: str, options: dict, saves: int,
                 in_the_next_save: bool = False, rerun_object: bool = False) -> None:
    """``saves`` saves, every one committed and the last one sealed, then the process ends
    without close() (as a crash would: no cleanup runs); ``in_the_next_save``: after one more
    save staged and handed to the writer but never committed (no maybe_finalize), as a kill in
    the middle of a save leaves it; ``rerun_object``: every save holds :func:`with_rerun_object`."""
    live = step_state(0, rank)
    ck = Checkpointer(CkptOptions(**options))
    state = (lambda: with_rerun_object(rank, sharded(rank, world, live))) if rerun_object else (
        lambda: sharded(rank, world, live))
    ck.prepare(state())
    for step in range(1, saves + 1 + in_the_next_save):
        for k, v in step_state(step, rank).items():
            live[k].copy_(v)
        ck.save(state(), root, iteration=step)
        if step <= saves:  # the one after them is never finalized (so never committed)
            ck.maybe_finalize(blocking=step == saves)
        if step == saves:
            _wait_sealed(root, rank)
    if in_the_next_save:
        time.sleep(0.3)  # the uncommitted save's staging landed in its buffers
    sys.stdout.flush()
    os._exit(0)  # no close(): the staging segments and the seal are left, as after a crash


def die_in_the_next_save(rank: int, world: int, root: str, options: dict, saves: int) -> None:
    save_and_die(rank, world, root, options, saves, in_the_next_save=True)


def restore(rank: int, world: int, root: str, options: dict, iteration: int | None,
            want_step: int, want_tier: str, out: str) -> None:
    """Load (the tracker's, or ``iteration``), check the values bit-exact and the tier, then
    save once more into the adopted buffers and close."""
    with Checkpointer(CkptOptions(**options)) as ck:
        got = load_back(ck, rank, world, root, iteration)
        assert_equal(got, step_state(want_step, rank), f"restored iteration {want_step}")
        report = ck.load_reports[-1]
        assert report["tier"] == want_tier, report
        allocated = getattr(ck._stager, "stats", {}).get("bytes_allocated", -1)
        live = {k: v.clone() for k, v in step_state(9, rank).items()}
        ck.save(sharded(rank, world, live), root, iteration=9)
        ck.maybe_finalize(blocking=True)
        stats = getattr(ck._stager, "stats", {})
        if getattr(ck._stager, "pin", False):  # (CUDA) the adopted buffers, pinned after the
            assert all(b.registered for s in ck._stager._sets  # restore, staged this save
                       for b in s.buffers.values() if b.path)
        with open(os.path.join(out, f"restore{rank}.json"), "w") as fh:
            json.dump({"report": report, "allocated_before_save": allocated,
                       "allocated_after_save": stats.get("bytes_allocated", -1),
                       "admission": ck.admission}, fh)


def fresh_start(rank: int, world: int, root: str, options: dict, prepared: bool = False) -> None:
    """A run that starts from scratch into the same --save (no load): its first save (with
    ``prepared``, after prepare(), as the launcher calls it once the model is built)."""
    with Checkpointer(CkptOptions(**options)) as ck:
        live = {k: v.clone() for k, v in step_state(5, rank).items()}
        if prepared:
            ck.prepare(sharded(rank, world, live))
        ck.save(sharded(rank, world, live), root, iteration=5)
        ck.maybe_finalize(blocking=True)


def restore_prepared(rank: int, world: int, root: str, options: dict, want_step: int,
                     build_s: float, out: str) -> None:
    """As a restarted Megatron-LM job through the launcher: ``prepare_restore`` before the model
    is built (``build_s`` stands in for the build), then the load; values bit-exact, the report
    written for the test. With CUDA every buffer pinned ahead is copied whole."""
    with Checkpointer(CkptOptions(**options)) as ck:
        stager, seen = ck._stager, []
        pin_adopted = stager.pin_adopted

        def noted() -> None:  # what the load's pin_adopted() found (said if a buffer stays
            sealed = stager._sealed  # unregistered)
            seen.append({"sealed": sealed is not None, "unregistered": None if sealed is None
                         else sum(not b.registered for b in sealed[0].buffers.values()
                                  if b.path)})
            pin_adopted()

        stager.pin_adopted = noted
        assert ck.prepare_restore(root)
        time.sleep(build_s)
        got = load_back(ck, rank, world, root, None)
        assert_equal(got, step_state(want_step, rank), f"restored iteration {want_step}")
        report = ck.load_reports[-1]
        live = {k: v.clone() for k, v in step_state(9, rank).items()}
        ck.save(sharded(rank, world, live), root, iteration=9)  # into the adopted buffers
        ck.maybe_finalize(blocking=True)
        if stager.pin:  # pinned ahead, or after the load: no buffer twice
            sets = [(len(s.buffers), sum(not b.registered for b in s.buffers.values() if b.path))
                    for s in stager._sets]
            assert all(unregistered == 0 for _, unregistered in sets), (
                f"(buffers, unregistered) per set {sets}; pin_adopted saw {seen}; "
                f"stats {stager.stats}")
        with open(os.path.join(out, f"restore{rank}.json"), "w") as fh:
            json.dump({"report": report}, fh)


def restore_and_count_validations(rank: int, world: int, root: str, options: dict,
                                  out: str, rerun_object_on: tuple = ()) -> None:
    """As a restarted Megatron-LM job through the launcher: load, prepare() again with the
    state of the first step, then the first save; how many times megatron-core's sharding
    validation ran in the load (``validate_access_integrity``) and in prepare()
    (``backend.validate_sharding``) and whether the first save validated (its report's
    ``validated_sharding``), written for the test. The ranks in ``rerun_object_on`` load
    :func:`with_rerun_object` (the others leave it out)."""
    from megatron.core import dist_checkpointing

    from megatron_ckpt_ext import backend

    calls, loads = [], []
    original, load = backend.validate_sharding, dist_checkpointing.load
    backend.validate_sharding = lambda *a, **k: calls.append(1) or original(*a, **k)
    dist_checkpointing.load = lambda *a, **k: loads.append(
        k.get("validate_access_integrity", True)) or load(*a, **k)
    try:
        with Checkpointer(CkptOptions(**options)) as ck:
            like = sharded(rank, world, {k: torch.zeros_like(v)
                                         for k, v in step_state(0, rank).items()})
            got = ck.load(with_rerun_object(rank, like) if rank in rerun_object_on else like,
                          root)
            assert_equal(got, step_state(2, rank), "restored iteration 2")
            live = {k: v.clone() for k, v in step_state(9, rank).items()}
            state = sharded(rank, world, live)  # the structure each rank loaded
            state = with_rerun_object(rank, state) if rank in rerun_object_on else state
            ck.prepare(state)
            ck.save(state, root, iteration=9)
            ck.maybe_finalize(blocking=True)
            report = ck.load_reports[-1]
            first_save = ck.reports[-1]["stage_detail"]
    finally:
        backend.validate_sharding, dist_checkpointing.load = original, load
    with open(os.path.join(out, f"restore{rank}.json"), "w") as fh:
        json.dump({"report": report, "prepare_validations": len(calls),
                   "load_validated": loads, "first_save_validated":
                   first_save.get("validated_sharding")}, fh)


def save_and_hold(rank: int, world: int, root: str, options: dict, saves: int,
                  flag_dir: str) -> None:
    """A job still running: ``saves`` committed saves into ``root``, the last one sealed, then
    it keeps its Checkpointer (and so its snapshot's segments) open until ``flag_dir/done``
    appears (``flag_dir/ready<rank>`` says it got there), and closes without keeping it."""
    live = step_state(0, rank)
    with Checkpointer(CkptOptions(**options), save_dir=root) as ck:
        for step in range(1, saves + 1):
            for k, v in step_state(step, rank).items():
                live[k].copy_(v)
            ck.save(sharded(rank, world, live), root, iteration=step)
            ck.maybe_finalize(blocking=True)
        _wait_sealed(root, rank)
        open(os.path.join(flag_dir, f"ready{rank}"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(flag_dir, "done")):
            assert time.monotonic() < deadline, "the other job never finished"
            time.sleep(0.02)


def load_anothers_and_save(rank: int, world: int, root: str, options: dict, want_step: int,
                           own_root: str, out: str) -> None:
    """Another job on the node: loads the running job's latest checkpoint from its ``root``
    (values bit-exact), saves twice into its own ``own_root``; its load report written."""
    with Checkpointer(CkptOptions(**options), save_dir=own_root) as ck:
        got = load_back(ck, rank, world, root, None)
        assert_equal(got, step_state(want_step, rank), f"loaded iteration {want_step}")
        report = ck.load_reports[-1]
        for step in (7, 8):
            live = {k: v.clone() for k, v in step_state(step, rank).items()}
            ck.save(sharded(rank, world, live), own_root, iteration=step)
            ck.maybe_finalize(blocking=True)
        with open(os.path.join(out, f"other{rank}.json"), "w") as fh:
            json.dump(report, fh)


def restore_summed_on_the_device(rank: int, world: int, root: str, options: dict,
                                 want_step: int, out: str) -> None:
    """As :func:`restore_prepared` with ``MCX_RESTORE_SUMS=device``, the device stood in for by
    the CPU (tests/_support/device_sums_standin.py): the snapshot pinned ahead unsummed, each
    copy summed on the 'device' and the verdict agreed after the rest's load. Values checked
    whatever the tier; the report written for the test."""
    from tests._support import device_sums_standin

    os.environ["MCX_RESTORE_SUMS"] = "device"
    device_sums_standin.install(setattr)
    with Checkpointer(CkptOptions(**options)) as ck:
        ck._stager.pin = True
        assert ck.prepare_restore(root)
        got = load_back(ck, rank, world, root, None)
        assert_equal(got, step_state(want_step, rank), f"restored iteration {want_step}")
        with open(os.path.join(out, f"restore{rank}.json"), "w") as fh:
            json.dump({"report": ck.load_reports[-1]}, fh)
