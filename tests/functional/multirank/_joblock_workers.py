"""Rank functions and the holder job of test_joblock.py (spawned: module level)."""

from __future__ import annotations

import sys
import time

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import SaveDirectoryInUse
from tests._support.dist import sharded


def second_job_fails(rank: int, world: int, root: str, holder_pid: int) -> None:
    """Every rank of the second job fails at start-up, naming the holder; so does a first save
    into the root without save_dir (the Megatron-LM adapter's way)."""
    try:
        Checkpointer(CkptOptions(), save_dir=root)
    except SaveDirectoryInUse as e:
        assert f"pid {holder_pid}" in str(e) and "holder-job" in str(e), str(e)
        assert "Fix: give this job its own --save directory" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: a second job started on a held --save")
    with Checkpointer(CkptOptions()) as ck:
        try:
            ck.save(sharded(rank, world, {"w": torch.zeros(8)}), root, iteration=1)
        except SaveDirectoryInUse as e:
            assert f"pid {holder_pid}" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: a save into a held --save went through")


if __name__ == "__main__":  # the holder: one rank that holds sys.argv[1] until killed
    sys.argv[0] = "holder-job"
    import os

    ck = Checkpointer(CkptOptions(), save_dir=sys.argv[1])
    child = os.fork()  # as a writer or a data-loader worker: it must not keep the lock
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(f"held {child}", flush=True)
    time.sleep(600)
