"""Rank bodies for test_suspend.py (a module of its own so spawned ranks import it)."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from megatron_ckpt_ext import Checkpointer, CheckpointWriteError, CkptOptions
from megatron_ckpt_ext.hooks import SaveHooks

from tests._support.dist import sharded
from ._ckpt_workers import load_back, step_state

POLL_S, MAX_POLLS = 0.05, 2400  # a training loop's non-blocking polls, for at most ~2 min


def held_write(marker: str, hold_s: float, write: Callable[..., Any], *args: Any,
               **kwargs: Any) -> Any:
    """In the writer: say it is writing (its pid), take ``hold_s`` (a slow disk), then write."""
    Path(marker).write_text(str(os.getpid()))
    time.sleep(hold_s)
    return write(*args, **kwargs)


class _HoldSecondSave(SaveHooks):
    def __init__(self, marker: str, hold_s: float) -> None:
        self.marker, self.hold_s = marker, hold_s

    def wrap_request(self, request: Any, record: Any) -> Any:
        if record.iteration != 2:
            return request
        return request._replace(async_fn=functools.partial(held_write, self.marker, self.hold_s,
                                                           request.async_fn))


def save_across_a_suspend(rank: int, world: int, root: str, options: dict, hold_s: float,
                          out: str) -> None:
    """Save 1 (committed); save 2, whose write takes ``hold_s`` on every rank's writer, is
    polled for its commit (non-blocking, as a training loop does) while the test stops and
    continues every process of the job. What the rank saw goes to ``out/rank<r>.json``."""
    Path(out, f"pid_r{rank}").write_text(str(os.getpid()))
    marker = str(Path(out, f"writing_r{rank}"))
    error, committed, polls = None, False, 0
    live = step_state(1, rank)
    with Checkpointer(CkptOptions(**options), save_dir=root,
                      hooks=_HoldSecondSave(marker, hold_s)) as ck:
        ck.save(sharded(rank, world, live), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        for k, v in step_state(2, rank).items():
            live[k].copy_(v)
        t0 = time.monotonic()
        ck.save(sharded(rank, world, live), root, iteration=2)
        try:
            while not committed and polls < MAX_POLLS:  # as many calls on every rank
                committed = bool(ck.maybe_finalize())
                polls += 1
                time.sleep(POLL_S)
        except CheckpointWriteError as e:
            error = str(e)
        got = load_back(ck, rank, world, root, None)
        exact = all(bool((got[k] == v).all()) for k, v in step_state(2, rank).items())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"error": error, "committed": committed, "loaded_iteration_2": exact,
                   "polls": polls, "save_to_end_s": time.monotonic() - t0}, fh)
