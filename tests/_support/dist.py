"""Run a function on N gloo ranks on localhost, with a hard timeout (a hang fails, never blocks).

Shared by the tests and by the lab's reliability harness (tools/reliability.py imports it from
here)."""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["FakeWork", "device", "free_port", "run_ranks", "sharded", "world"]


def device() -> str:
    """Where test tensors live: "cpu" (CI) or "cuda" (MCX_TEST_DEVICE=cuda on the GPU machine)."""
    return os.environ.get("MCX_TEST_DEVICE", "cpu")


def sharded(rank: int, world: int, tensors: dict[str, Any]) -> dict:
    """Each tensor as rank's slice of a 1-D split over ``world`` ranks (a ShardedTensor per key)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) for k, t in tensors.items()}


def world() -> int:
    """Ranks per test: 2 by default; MCX_TEST_WORLD=1 on a one-GPU machine."""
    return int(os.environ.get("MCX_TEST_WORLD", "2"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank is a fork of a server that imported these once (each fresh interpreter would import
# megatron-core again: 5-10 s a rank on the 2-core CI machine, most of the multirank tier's time).
# MCX_TEST_START_METHOD=spawn starts each rank as a fresh interpreter instead, and is the default
# with MCX_TEST_DEVICE=cuda: importing megatron-core initializes CUDA in the server, and a process
# forked after that cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess").
_PRELOAD = ["torch", "torch.distributed", "megatron.core.dist_checkpointing"]


def _start_method() -> str:
    cuda = os.environ.get("MCX_TEST_DEVICE") == "cuda"
    method = os.environ.get("MCX_TEST_START_METHOD", "spawn" if cuda else "forkserver")
    if method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts (once)
    return method


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple,
           env: dict[str, str] | None = None) -> None:
    if env is not None:  # the caller's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(env)
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    import faulthandler
    import signal

    # On a timeout, run_ranks sends SIGUSR1 first: every thread's Python stack goes to stderr (the
    # test's captured output), in this rank and in any writer it forked (inherited), so a hang in
    # CI names where it stood.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch

    torch.set_num_threads(1)
    if device() == "cuda":  # the GPU runs of the same tests (see docs/GPU.md)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device() == "cuda" else "gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    # Done and torn down: leave without C++ static destructors. About 1 run in 6 of a 2-rank CPU
    # test, torch 2.13's exit-time teardown aborts ("terminate called without an active exception",
    # SIGABRT with no Python frame, after all our work and the process group's destruction; seen on
    # the committed code before any of this session's changes too), which would fail the test for
    # something outside what it checks.
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def run_ranks(fn: Callable[..., Any], *, world_size: int | None = None, timeout: float = 120.0,
              args: tuple = ()) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; raise if any rank
    fails, or kill them all and raise if they are not done within ``timeout`` seconds."""
    world_size = world_size or world()
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args, dict(os.environ)),
                             nprocs=world_size, join=False, start_method=_start_method())
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            stuck = [pid for p in ctx.processes if p.is_alive() for pid in _tree(p.pid)]
            _signal_all(stuck, signal.SIGUSR1)  # stacks to stderr (see _entry)
            time.sleep(2.0)
            _signal_all(stuck, signal.SIGKILL)
            raise TimeoutError(f"ranks did not finish within {timeout:.0f} s (hang?)")


class FakeWork:
    """An async collective's work handle for tests: records each ``wait(timeout)``; with
    ``fail``, times out as gloo does when its own timeout ends the operation (complete, with
    that error)."""

    def __init__(self, fail: bool = False) -> None:
        self.timeouts: list = []
        self.fail = fail

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if self.fail:
            raise RuntimeError("[Gloo] Timed out waiting 60000ms")
        return True

    def is_completed(self) -> bool:
        return True
