"""Rank bodies for test_fork_start.py (spawned ranks import them by module path)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointWriteError
from tests._support.dist import sharded

_PERSISTENT = {"async_save": True, "use_persistent_ckpt_worker": True,
               "async_ckpt_use_cpu_shm": True}
MODES = {"temporal": {"async_save": True}, "persistent-shm": _PERSISTENT,
         "persistent-shm-abandoned": _PERSISTENT}


def _state(rank: int, iteration: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * iteration + rank)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(64, generator=g)}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _block_a_watched_fork(marker: Path, nth: int = 1) -> None:
    """Registered before the plugin's own after-fork hook, so it runs first in the child: the
    ``nth`` writer fork the plugin watches blocks here, as a child stuck in Python's after-fork
    start does (it never reaches the plugin's start report). Its pid goes into ``marker``."""
    from megatron_ckpt_ext import _runtime

    def hook() -> None:
        if _runtime._FORK_WATCH["starts"] is None:
            return
        n = 1
        while True:  # this fork's number among the watched ones (O_EXCL: one file each)
            try:
                os.close(os.open(f"{marker}.{n}", os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                n += 1
        if n == nth:
            marker.write_text(str(os.getpid()))
            time.sleep(3600)

    os.register_at_fork(after_in_child=hook)


_SLOW = {"on": False}


def _slow_writers_after_their_start() -> None:
    """Registered after the plugin's hook: while armed, a forked child (a writer) sleeps 2.5 s
    after it reported its start, so it is alive well past the (1 s) start timeout while healthy;
    one forked again or stopped for that would be a false alarm."""
    os.register_at_fork(after_in_child=lambda: _SLOW["on"] and time.sleep(2.5))
    _SLOW["on"] = True


def stuck_writer_fork(rank: int, world: int, root: str, mode: str, stuck_rank: int,
                      marker: str) -> None:
    from megatron_ckpt_ext.save import writers

    writers.WRITER_START_TIMEOUT_S = 1.0
    if rank == stuck_rank:  # "abandoned": the worker started after an abandoned save is stuck
        _block_a_watched_fork(Path(marker), nth=2 if mode == "persistent-shm-abandoned" else 1)
    lines = _Lines()
    logging.getLogger("megatron_ckpt_ext").addHandler(lines)
    t0 = time.monotonic()
    with Checkpointer(CkptOptions(**MODES[mode])) as ck:
        _slow_writers_after_their_start()  # the plugin's after-fork hook is registered by now
        if mode in ("temporal", "persistent-shm"):
            # the stuck writer is forked again (temporal) or replaced (a persistent worker with
            # nothing but its start-up request): the save commits
            ck.save(sharded(rank, world, _state(rank, 1)), root, iteration=1)
            ck.maybe_finalize(blocking=True)
            said = "forked the writer again" if mode == "temporal" else "started a new persistent"
            restarted = [m for m in lines.lines if said in m]
            assert len(restarted) == (rank == stuck_rank), lines.lines
            if restarted:
                assert f"rank {rank}: the checkpoint writer forked as pid" in restarted[0]
                assert "did not start within 1 s" in restarted[0], restarted[0]
        else:  # a new worker after an abandoned save is stuck with the save: every rank raises
            ck.save(sharded(rank, world, _state(rank, 0)), root, iteration=1)
            ck.maybe_finalize(blocking=True)
            ck._writers.kill()  # as after an abandoned save: the next save starts a new worker
            try:
                ck.save(sharded(rank, world, _state(rank, 1)), root, iteration=2)
                ck.maybe_finalize(blocking=True)
            except CheckpointWriteError as e:
                text = str(e)
                assert f"writer of rank {stuck_rank} stopped" in text, text
                if rank == stuck_rank:
                    assert "did not start within 1 s" in text, text
            else:
                raise AssertionError(f"rank {rank}: a writer that never started went unnoticed")
            # the writers restart at the next save, which commits
            ck.save(sharded(rank, world, _state(rank, 1)), root, iteration=3)
            ck.maybe_finalize(blocking=True)
        like = {k: torch.zeros_like(v) for k, v in _state(rank, 1).items()}
        got = ck.load(sharded(rank, world, like), root)  # the latest: 1, or 3 after the retry
    assert all(torch.equal(got[k], v) for k, v in _state(rank, 1).items())
    assert time.monotonic() - t0 < 60, "bounded by the start timeout, not --ckpt-timeout"
