"""The writer's side of the ready flag: a write waits until the trainer publishes that its
staged copies are complete (the flag itself is a segment of the stager,
:meth:`~megatron_ckpt_ext.staging.shm.ShmStager.ready_flag`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from .. import _clock
from ..errors import StagingFailed

__all__ = ["run_when_staged"]


def run_when_staged(flag: torch.Tensor, seq: int, timeout_s: float, fn: Any, *args: Any,
                    **kwargs: Any) -> Any:
    """In the writer process: wait until the trainer publishes ``seq`` in ``flag`` (its staged
    copies for save ``seq`` are complete), then run ``fn``. Raises :class:`StagingFailed` if it
    publishes ``-seq`` and :class:`TimeoutError` after ``timeout_s`` (the save's own
    --ckpt-timeout; the trainer reports either at its next finalize). Polls every 0.5 ms: the
    copies it waits for take tens of milliseconds or more; a job stopped whole meanwhile
    (suspended) does not count against the timeout (:mod:`.._clock`). Module-level: it
    pickles."""
    deadline = _clock.running() + timeout_s
    while True:
        value = int(flag[0])
        if value >= seq:
            return fn(*args, **kwargs)
        if value == -seq:
            raise StagingFailed(f"save {seq}: the trainer's staging copies failed; nothing "
                                "was written (the trainer's log has the error)")
        if _clock.running() > deadline:
            raise TimeoutError(f"save {seq}: the trainer did not finish staging within "
                               f"{timeout_s:.0f} s (--ckpt-timeout); nothing was written")
        time.sleep(0.0005)
