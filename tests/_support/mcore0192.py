"""Megatron-core 0.19.2's Megatron-FSDP sources (the experimental fully_shard with
``use_symm_mem``), unpacked from its wheel: its top-level package does not import on a CPU machine
(triton), its ``megatron_fsdp`` package does, on its own. Tests that need the real code run it in
a subprocess with ``FSDP_SRC`` on PYTHONPATH, and are skipped where the wheel is not unpacked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from . import ROOT

__all__ = ["EXPERIMENTAL", "FSDP_SRC", "WHEEL_0192", "needs_0192", "subprocess_env"]

WHEEL_0192 = Path(os.environ.get("MCORE0192_DIR") or ROOT / ".ext" / "mcore-0.19.2")
FSDP_SRC = WHEEL_0192 / "megatron/core/distributed/fsdp/src"
EXPERIMENTAL = FSDP_SRC / "megatron_fsdp/experimental"
needs_0192 = pytest.mark.skipif(not EXPERIMENTAL.is_dir(),
                                reason=f"megatron-core 0.19.2 sources not unpacked at {WHEEL_0192} "
                                "(scripts/unpack_wheel.sh megatron-core 0.19.2 DIR; MCORE0192_DIR)")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child process: no launcher rank variables (unless given in
    ``extra``), one OpenMP thread, then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", *extra)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}
