"""Run a function on N gloo ranks on localhost, with a hard timeout (a hang fails, never blocks)."""

from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *, world_size: int = 2, timeout: float = 120.0,
              args: tuple = ()) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; raise if any rank
    fails, or kill them all and raise if they are not done within ``timeout`` seconds."""
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout:.0f} s (hang?)")
