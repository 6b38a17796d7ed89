"""Which committed checkpoint a load reads: the one the tracker names (or the iteration asked
for), checked to be complete before megatron-core opens it."""

from __future__ import annotations

import os
from pathlib import Path

from .. import backend
from .._runtime import warn_once
from ..save.layout import TRACKER, checkpoint_name, read_tracker, warn_incomplete

__all__ = ["locate"]


def locate(checkpoint_dir: str | os.PathLike[str], *, iteration: int | None = None,
           exit_on_missing: bool = False) -> Path | None:
    """The directory of the checkpoint to load, or None where ``checkpoint_dir`` holds no
    committed checkpoint (no tracker: a missing or empty directory) after a rank-0 warning, as
    Megatron-LM starts from scratch; ``exit_on_missing`` raises FileNotFoundError instead. A
    checkpoint that was never committed or lacks its common state is an error."""
    root = Path(checkpoint_dir)
    warn_incomplete(root)
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            _missing(root, exit_on_missing)
            return None
    path = checkpoint_name(root, iteration)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"checkpoint {path} is missing or was never committed")
    if backend.common_state_present(path) is False:  # None: unreadable, the load says why
        raise FileNotFoundError(
            f"checkpoint {path} has no common state: neither common.pt (megatron-core "
            "<= 0.16) nor a 'common_state' entry in its .metadata (0.19), both written by "
            "rank 0. The copy is incomplete or damaged: load another iteration "
            "(load(iteration=N)) or restore the file.")
    return path


def _missing(root: Path, exit_on_missing: bool) -> None:
    what = f"{root} does not exist" if not root.exists() else f"{root} holds no {TRACKER}"
    if exit_on_missing:
        raise FileNotFoundError(
            f"no committed checkpoint to load: {what} (--exit-on-missing-checkpoint "
            "is set). Fix: point --load at a directory saved by this plugin or "
            "Megatron, or drop --exit-on-missing-checkpoint to start from scratch.")
    warn_once(f"missing-checkpoint:{root}",
              f"no committed checkpoint to load: {what}; starting from "
              "scratch (--exit-on-missing-checkpoint makes this an error).")
