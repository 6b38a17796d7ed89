"""Rank functions for test_partner.py: each rank stands for a node of its own (its own
shared-memory directory); a job that saves with partner copies and dies, and the restarted job
that loads after one node's memory is lost."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.staging import ShmStager
from megatron_ckpt_ext.staging.partner import replica_path
from megatron_ckpt_ext.staging.retained import read_seal, seal_path

from tests._support.dist import sharded
from ._ckpt_workers import assert_equal, load_back, step_state


def node_dir(nodes: str, rank: int) -> str:
    return os.path.join(nodes, f"node{rank}")


def _checkpointer(rank: int, nodes: str, options: dict) -> Checkpointer:
    stager = ShmStager(job_id="partnertest", rank=rank, shm_dir=node_dir(nodes, rank),
                       reuse=options.get("ckpt_assume_constant_structure", False))
    return Checkpointer(CkptOptions(**options), stager=stager)


def save_and_die(rank: int, world: int, root: str, nodes: str, options: dict,
                 saves: int) -> None:
    """``saves`` committed saves; once the last one is sealed here and its copy sealed on the
    partner's node (the next rank's directory), the process ends without close()."""
    live = step_state(0, rank)
    ck = _checkpointer(rank, nodes, options)
    ck.prepare(sharded(rank, world, live))
    for step in range(1, saves + 1):
        for k, v in step_state(step, rank).items():
            live[k].copy_(v)
        ck.save(sharded(rank, world, live), root, iteration=step)
        ck.maybe_finalize(blocking=step == saves)
    own = seal_path(node_dir(nodes, rank), root, rank)
    copy = replica_path(node_dir(nodes, (rank + 1) % world), root, rank)
    deadline = time.monotonic() + 30
    while not (os.path.exists(own) and getattr(read_seal(copy), "iteration", None) == saves):
        assert time.monotonic() < deadline, "the last save was not sealed and copied"
        time.sleep(0.02)
    with open(os.path.join(nodes, f"admission{rank}.json"), "w") as fh:
        json.dump(ck.admission, fh)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # no close(): seals, copies and segments stay, as after a crash


def restore(rank: int, world: int, root: str, nodes: str, options: dict, want_step: int,
            out: str) -> None:
    """Load the tracker's checkpoint, check it bit-exact, save once more and close; the load
    report and the stager's counters written for the test."""
    with _checkpointer(rank, nodes, options) as ck:
        got = load_back(ck, rank, world, root, None)
        assert_equal(got, step_state(want_step, rank), f"restored iteration {want_step}")
        report = ck.load_reports[-1]
        live = {k: v.clone() for k, v in step_state(9, rank).items()}
        ck.save(sharded(rank, world, live), root, iteration=9)
        ck.maybe_finalize(blocking=True)
        copy = replica_path(node_dir(nodes, (rank + 1) % world), root, rank)
        deadline = time.monotonic() + 30  # the save after the restore is copied again
        while options.get("ckpt_memory_partner") and \
                getattr(read_seal(copy), "iteration", None) != 9:
            assert time.monotonic() < deadline, "the save after the restore was not copied"
            time.sleep(0.02)
        torch.distributed.barrier()
        with open(os.path.join(out, f"restore{rank}.json"), "w") as fh:
            json.dump({"report": report, "stats": ck.staging_stats()}, fh)
