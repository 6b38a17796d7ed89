"""Staging ahead: a steady save's copies issued before its caller builds the state dict.

Megatron-LM's ``save_checkpoint`` builds the state dict it saves (the model's and the optimizer's
sharded state dicts, the RNG state) before it calls our save: host work, while the copy engine
is idle. Under a constant structure that state names the same tensors at every save: the
parameters and the optimizer's state. So the launcher calls
:meth:`Checkpointer.stage_ahead <megatron_ckpt_ext.checkpointer.Checkpointer.stage_ahead>` on
entry to ``save_checkpoint``: the tensors the last save staged are copied again, now, into the
buffer set the save would stage into, while Megatron builds the state.

The save then takes those copies only if they are provably the bytes it would have copied:

* every tensor the last save staged is still alive (a weak reference each: a state built anew
  at every save, such as a distributed optimizer's gathered buffers, dies and stages no copy
  ahead, and its memory is never held);
* the save's tensors are, in order, the same memory (storage pointer and offset), shape,
  stride, dtype and device as those copied: two live tensors at one address share storage;
* no in-place operation on them since the copies were issued (the autograd version counter,
  shared by views; a write through ``.data`` does not count there, and Megatron's state
  building writes none).

Otherwise the copies are waited for, their buffers given back, the save stages as usual, and
staging ahead stays off for the rest of the run (rank 0 says why, once). ``MCX_STAGE_AHEAD=0``
turns it off."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .._runtime import rank

__all__ = ["Ahead", "Sources"]

logger = logging.getLogger(__name__)


def _signature(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t.device)


@dataclass
class Sources:
    """What the last save staged: weak references to its source tensors and their keys."""

    refs: list[weakref.ref]
    keys: list[str]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], keys: Sequence[str]) -> Sources | None:
        """None where a source cannot be referenced weakly (then nothing is staged ahead)."""
        try:
            return cls([weakref.ref(t) for t in tensors], list(keys))
        except TypeError:
            return None

    def alive(self) -> list[torch.Tensor] | None:
        """The source tensors, or None once any of them was freed."""
        tensors = [r() for r in self.refs]
        return None if any(t is None for t in tensors) else tensors  # type: ignore[return-value]


@dataclass
class Ahead:
    """Copies issued ahead of a save (a :class:`~megatron_ckpt_ext.staging.batch.StagedBatch`),
    with what they were copied from; ``before``: the stager's figures before they were issued
    (the save's report counts the staging from there)."""

    batch: Any
    keys: list[str]
    signatures: list[tuple]
    versions: list[int]
    before: dict
    issued: float = field(default_factory=time.perf_counter)

    @classmethod
    def issue(cls, stager: Any, tensors: list[torch.Tensor], keys: list[str],
              before: dict) -> Ahead:
        batch = stager.stage(tensors, keys=keys, wait=False)
        # what was copied, read once the copies are on their way (nothing ran on this thread
        # in between that could change a tensor: the copies start a few ms sooner)
        signatures = [_signature(t) for t in tensors]
        versions = [t._version for t in tensors]
        return cls(batch, keys, signatures, versions, before)

    def mismatch(self, tensors: Sequence[torch.Tensor], keys: Sequence[str]) -> str:
        """Why these (the save's sources) are not what was copied ahead; '' if they are."""
        if list(keys) != self.keys:
            return f"the save's tensors are others ({len(keys)} vs {len(self.keys)} keys)"
        for t, key, signature, version in zip(tensors, keys, self.signatures, self.versions):
            if _signature(t) != signature:
                return f"tensor {key!r} is another tensor than the last save's"
            if t._version != version:
                return f"tensor {key!r} was changed in place after its copy was issued"
        return ""

    def drop(self) -> None:
        """Not taken: the copies land, the buffers go back."""
        self.batch.release()


def say_off(why: str) -> None:
    if rank() == 0:
        logger.info("staging ahead of the state dict is off for this run: %s; each save stages "
                    "once its state is built", why)
