"""The plugin's own small collectives over the checkpoint process group.

Each is bounded by ``--distributed-timeout-minutes`` when set, and each caller reads its result
on the host right after, so the bound adds no synchronisation. Without an initialised process
group (one process) every call is local.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointWriteError
from .options import CkptOptions

__all__ = ["Group"]


class Group:
    """``process_group`` (None: the world) as the checkpoint's collectives use it."""

    def __init__(self, process_group: Any, options: CkptOptions) -> None:
        self.process_group = process_group
        self.options = options

    @staticmethod
    def initialized() -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def size(self) -> int:
        return torch.distributed.get_world_size(self.process_group) if self.initialized() else 1

    def rank(self, global_rank: int) -> int:
        """This process's rank within the group (``global_rank`` without a process group)."""
        if not self.initialized():
            return global_rank
        return torch.distributed.get_rank(self.process_group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, picklable), in group rank order (collective)."""
        if not self.initialized():
            return [obj]
        out: list[Any] = [None] * self.size()
        torch.distributed.all_gather_object(out, obj, group=self.process_group)
        return out

    def all_max(self, values: list[float]) -> list[float]:
        """Element-wise max of ``values`` over the group (collective)."""
        return self._all_reduce(values, torch.distributed.ReduceOp.MAX if self.initialized()
                                else None)

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over the group (collective)."""
        return self._all_reduce(values, torch.distributed.ReduceOp.SUM if self.initialized()
                                else None)

    def barrier(self) -> None:
        if self.initialized():
            self.wait(torch.distributed.barrier(group=self.process_group, async_op=True))

    def wait(self, work: Any) -> None:
        """Wait for one of our collectives, at most ``--distributed-timeout-minutes`` when set
        (else the process group's own timeout)."""
        timeout = self.options.distributed_timeout()
        if timeout is None:
            work.wait()
            return
        try:
            work.wait(timeout=timeout)
        except RuntimeError as e:
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise  # a peer that crashed: the backend's own message says so
            raise CheckpointWriteError(
                "a checkpoint collective did not complete within --distributed-timeout-minutes "
                f"{self.options.distributed_timeout_minutes} (config key "
                "'distributed_timeout_minutes'): some rank did not reach it, either because "
                "it is still inside an earlier step of a checkpoint (its stack shows where: "
                "py-spy dump --pid <pid>; please report it) or because the training loop does "
                "not call save() and maybe_finalize() on every rank alike "
                f"({e}).") from e

    def _all_reduce(self, values: list[float], op: Any) -> list[float]:
        if op is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        self.wait(torch.distributed.all_reduce(t, op=op, group=self.process_group,
                                               async_op=True))
        return t.tolist()

    def _device(self) -> torch.device:
        """The current CUDA device for an NCCL group (only then is CUDA needed), else the CPU."""
        if torch.distributed.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
