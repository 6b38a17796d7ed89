"""Rank bodies for test_close_after_error.py (a module of its own so spawned ranks import it)."""

from __future__ import annotations

import json
import os
import time

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save import steps

from tests._support.dist import sharded
from ._ckpt_workers import step_state


class Interrupted(Exception):
    """What the training loop raised (a Ctrl-C's KeyboardInterrupt, an error of its own)."""


def error_at_another_point(rank: int, world: int, root: str, options: dict, late_s: float,
                           cap_s: float, out: str) -> None:
    """Save 1 (committed), save 2 handed to the writers, then the loop raises: rank 0 at once,
    the other ranks ``late_s`` later (a signal that reached them inside a long step). What the
    rank saw (how long its close took, what was raised) goes to ``out/rank<r>.json``."""
    steps.AFTER_ERROR_WAIT_S = cap_s
    live = step_state(1, rank)
    raised, t0 = None, 0.0
    try:
        with Checkpointer(CkptOptions(**options), save_dir=root) as ck:
            ck.save(sharded(rank, world, live), root, iteration=1)
            ck.maybe_finalize(blocking=True)
            for k, v in step_state(2, rank).items():
                live[k].copy_(v)
            ck.save(sharded(rank, world, live), root, iteration=2)
            if rank:
                time.sleep(late_s)
            t0 = time.monotonic()
            raise Interrupted(f"rank {rank}")
    except Interrupted as e:
        raised = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"close_s": time.monotonic() - t0, "raised": raised}, fh)
