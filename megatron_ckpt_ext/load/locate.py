"""Which committed checkpoint a load reads: the one the tracker names (or the iteration asked
for), checked to be complete before megatron-core opens it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import backend
from .._runtime import rank, warn_once
from ..errors import CheckpointNotFound
from ..save.layout import (TRACKER, checkpoint_name, has_metadata, parse_iteration, read_tracker,
                           warn_incomplete)
from .verify import committed_before

__all__ = ["another_iteration", "locate", "refuse_plain_targets"]


def locate(checkpoint_dir: str | os.PathLike[str], *, iteration: int | None = None,
           exit_on_missing: bool = False, fallback: bool = False,
           metadata: dict | None = None) -> Path | None:
    """The directory of the checkpoint to load, or None where ``checkpoint_dir`` holds no
    committed checkpoint (no tracker: a missing or empty directory) after a rank-0 warning, as
    Megatron-LM starts from scratch; ``exit_on_missing`` raises FileNotFoundError instead, and
    so does a ``checkpoint_dir`` that is itself a committed checkpoint (``iter_N``: the user
    meant its parent; starting from scratch would throw the training away silently). A
    checkpoint that was never committed (or was deleted) or lacks its common state is an error;
    with ``fallback`` the tracker's missing target gives way to the newest older committed one.
    ``metadata``: the DCP ``.metadata`` this check unpickled (megatron-core 0.19 checkpoints),
    kept under ``str(path)`` for the load, so a rank reads it once."""
    root = Path(checkpoint_dir)
    warn_incomplete(root)
    explicit = iteration is not None
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            _missing(root, exit_on_missing)
            return None
    path = checkpoint_name(root, iteration)
    if not has_metadata(path):
        path = _not_committed(root, path, iteration, explicit=explicit, fallback=fallback)
    if backend.common_state_present(path, keep=metadata) is False:  # None: unreadable, the load says why
        raise CheckpointNotFound(
            f"checkpoint {path} has no common state: neither common.pt (megatron-core "
            "<= 0.16) nor a 'common_state' entry in its .metadata (0.19), both written by "
            "rank 0. The copy is incomplete or damaged. Fix: restore the file, or "
            f"{another_iteration(root, below=parse_iteration(path.name))}")
    return path


def _not_committed(root: Path, path: Path, iteration: int, *, explicit: bool,
                   fallback: bool) -> Path:
    """The tracker's (or the asked) iteration has no committed directory: with ``fallback``
    (tracker only) the newest older committed one, said on rank 0; else an error."""
    what = "does not exist" if not path.exists() else "was never committed (no metadata.json)"
    named = ("the load asked for this iteration" if explicit
             else f"the tracker {root / TRACKER} names it")
    older = committed_before(root, iteration)
    if fallback and not explicit and older:
        warn_once(f"fallback-missing:{path}", f"checkpoint {path} {what}; {named}; "
                  f"--ckpt-load-fallback: loading iteration {older[0]} instead.")
        return checkpoint_name(root, older[0])
    fix = ("pass --ckpt-load-fallback to load the newest older committed checkpoint "
           f"(iteration {older[0]}), or " if older and not explicit else "")
    raise CheckpointNotFound(
        f"checkpoint {path} {what}; {named}. Fix: restore it, or {fix}"
        f"{another_iteration(root, below=iteration)}")


def another_iteration(root: Path, *, below: int | None = None) -> str:
    """How each entry point loads another iteration, and which are committed (a fix sentence)."""
    committed = committed_before(root, below if below is not None else 1 << 62)
    shown = ", ".join(map(str, committed[:6])) + (" ..." if len(committed) > 6 else "")
    return ("load another iteration N: Megatron-LM --ckpt-step N; other scripts: write N into "
            f"the tracker ('echo N > {root / TRACKER}'); Python: load(iteration=N)"
            + (f" (committed here: {shown})." if committed else
               " (no other committed checkpoint here)."))


def _missing(root: Path, exit_on_missing: bool) -> None:
    named = parse_iteration(root.name)
    if named is not None and has_metadata(root):  # a checkpoint, not the root that holds it
        raise CheckpointNotFound(
            f"{root} is a checkpoint directory (iteration {named}), not a save root: a load "
            f"takes the directory that holds the iter_* directories and its {TRACKER}. Fix: "
            f"point --load at {root.parent} (it loads the iteration its tracker names), with "
            f"Megatron-LM's --ckpt-step {named} (Python: load(iteration={named})) for this one.")
    what = f"{root} does not exist" if not root.exists() else f"{root} holds no {TRACKER}"
    if exit_on_missing:
        raise CheckpointNotFound(
            f"no committed checkpoint to load: {what} (--exit-on-missing-checkpoint "
            "is set). Fix: point --load at a directory saved by this plugin or "
            "Megatron, or drop --exit-on-missing-checkpoint to start from scratch.")
    warn_once(f"missing-checkpoint:{root}",
              f"no committed checkpoint to load: {what}; starting from "
              "scratch (--exit-on-missing-checkpoint makes this an error).")


def refuse_plain_targets(sharded_state_dict: Any, group: Any) -> None:
    """Collective: a plain torch tensor of more than one element among a load's targets is
    refused on every rank (naming it where it is), before anything is read: megatron-core fills
    plain entries from the checkpoint's common state only, so such a tensor would keep its
    values without a word. The save refuses the same (a one-element tensor stays common state)."""
    plain = [(k, t) for k, t in backend.plain_tensors(sharded_state_dict) if t.numel() > 1]
    (bad_rank,) = group.all_max([float(rank()) if plain else -1.0])
    if bad_rank < 0:
        return
    if not plain:
        raise ValueError(f"load: rank {int(bad_rank)}'s state dict holds plain torch tensors "
                         "(see that rank's error for their keys). Nothing was loaded.")
    key, t = plain[0]
    more = f" (and {len(plain) - 1} more: {[k for k, _ in plain[1:4]]})" if len(plain) > 1 else ""
    raise ValueError(
        f"load: '{key}' is a plain torch.Tensor of shape {tuple(t.shape)}{more}, not a "
        "megatron-core ShardedTensor: megatron-core fills plain entries from the checkpoint's "
        "common state only, so it would keep its values unchanged. Nothing was loaded. Fix: "
        "wrap it as the save did, e.g. ShardedTensor.from_rank_offsets(key, t, "
        "replica_id=dp_rank), or (axis, rank, world_size) for one split along an axis.")
