"""megatron-ckpt-ext: fast, safe asynchronous distributed checkpointing for Megatron-style training.

Importing this package never imports megatron-core or nvidia-resiliency-ext: backends are
detected lazily by ``megatron_ckpt_ext.backend`` when first needed.
"""

from __future__ import annotations

from typing import Any

from .arguments import add_arguments
from .errors import CheckpointWriteError, CkptError, CkptOptionsError
from .options import CkptOptions
from .validation import check, validate

__all__ = ["CheckpointWriteError", "Checkpointer", "CkptError", "CkptOptions", "CkptOptionsError",
           "add_arguments", "check", "validate"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The checkpointer pulls in torch.distributed machinery; load it only when asked for.
    if name == "Checkpointer":
        from .checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
