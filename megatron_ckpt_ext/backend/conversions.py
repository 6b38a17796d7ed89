"""megatron-core's per-save conversion of its ShardedTensors into torch ShardedTensors, reused
while nothing it depends on changed (``--ckpt-assume-constant-structure``).

Every save, megatron-core's torch strategy converts each sharded key's local shards into a torch
``ShardedTensor`` (``sharded_tensor_to_torch_sharded_tensor``): shard metadata for every
fragment of the global grid, then torch's own validation of the shards. For a stacked-layer GPT
that is the largest part of a steady save's planning. The result depends only on the shards'
metadata and on which memory holds their data; the bytes are read at write time. So while a
save hands megatron-core the same staging buffers (or the same parameters) with the same
metadata, the previous save's result is returned as it is: views of that same memory, so the
writer reads this save's bytes. Anything else (another buffer, shape, stride, offset, key,
fragmentation, rank or world size) converts anew.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Iterator

from ..debug import env_switch
from ..errors import BackendUnavailable
from ._imports import MCORE_STRATEGIES, _import
from .introspect import _takes

__all__ = ["ConversionCache", "convert_ahead", "conversions_cached"]

_FN = "sharded_tensor_to_torch_sharded_tensor"
_PARAMS = ("sh_tens", "rank", "load_legacy_1d_flatten_tensors")


class ConversionCache:
    """The conversions of one Checkpointer's last save, keyed by everything they depend on.
    Only the entries a save used are kept, so a changed structure frees the old ones at the
    next save; :meth:`clear` frees them all (at close, or when the structure changed)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, Any] = {}
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self.entries = {}


def _fingerprint(sh_ten: Any) -> tuple | None:
    """What the conversion of one shard depends on, or None where it must always run (a
    non-contiguous shard: megatron-core copies it into new memory every save)."""
    data = sh_ten.data
    if data is None or not data.is_contiguous():
        return None
    flat = sh_ten.flattened_range
    return (sh_ten.key, data.untyped_storage().data_ptr(), data.storage_offset(),
            tuple(data.shape), data.dtype, data.device, data.requires_grad,
            tuple(sh_ten.local_shape), tuple(sh_ten.global_shape), tuple(sh_ten.global_offset),
            tuple(sh_ten.axis_fragmentations), sh_ten.prepend_axis_num,
            None if flat is None else (flat.start, flat.stop, flat.step),
            sh_ten.replica_id, sh_ten.allow_shape_mismatch)


def _converter(*, load: bool = False) -> Any:
    """megatron-core's conversion function where it can be reused here, else None (``load``:
    import its module if it is not imported yet)."""
    module = sys.modules.get(f"{MCORE_STRATEGIES}.torch")
    if module is None and load:
        try:
            module = _import(f"{MCORE_STRATEGIES}.torch")
        except BackendUnavailable:
            return None
    original = getattr(module, _FN, None)
    if (original is None or getattr(original, "_mcx_cached", False)
            or env_switch("MCX_CONVERT_EVERY_SAVE") == "1"
            or not all(_takes(original, name) for name in _PARAMS)):
        return None
    return original


def convert_ahead(cache: ConversionCache, groups: list[list[Any]]) -> int:
    """Convert ahead of the first save (after ``prepare()`` allocated its staging): each group
    is one key's shards, in megatron-core's order, holding the buffers the first save will
    stage into. Only shards megatron-core converts through this function (a prepended axis or
    a flattened range) are converted; the first save's planning finds them in ``cache`` (any it
    does not use are dropped then). Returns how many were converted; no collective."""
    original = _converter(load=True)
    if original is None:
        return 0
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    done = 0
    for sh_tens in groups:
        if not sh_tens or not (sh_tens[0].prepend_axis_num
                               or sh_tens[0].flattened_range is not None):
            continue
        prints = tuple(_fingerprint(t) for t in sh_tens)
        key = (rank, world, prints)
        if None in prints or key in cache.entries:
            continue
        try:
            cache.entries[key] = original(sh_tens, rank, False)
        except Exception:  # noqa: BLE001 - megatron-core will say it at the save, if at all
            continue
        done += 1
    return done


@contextlib.contextmanager
def conversions_cached(cache: ConversionCache | None) -> Iterator[None]:
    """While megatron-core plans a save: its torch strategy's conversion answers from
    ``cache`` where every input matches the previous save's (module docstring). The module's
    own function is back when the block ends; without a cache, under
    ``MCX_CONVERT_EVERY_SAVE=1``, or where this megatron-core has no such function (or one with
    other parameters), nothing changes."""
    module = sys.modules.get(f"{MCORE_STRATEGIES}.torch")
    original = _converter()
    if cache is None or original is None:
        yield
        return
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    used: dict[tuple, Any] = {}

    @functools.wraps(original)
    def cached(sh_tens: list, rank: int | None = None,
               load_legacy_1d_flatten_tensors: bool = False) -> Any:
        prints = tuple(_fingerprint(t) for t in sh_tens)
        if load_legacy_1d_flatten_tensors or not sh_tens or None in prints:
            return original(sh_tens, rank, load_legacy_1d_flatten_tensors)
        key = (rank if rank is not None else dist.get_rank(), world, prints)
        result = cache.entries.get(key)
        if result is None:
            cache.misses += 1
            result = original(sh_tens, rank, load_legacy_1d_flatten_tensors)
        else:
            cache.hits += 1
        used[key] = result
        return result

    cached._mcx_cached = True  # type: ignore[attr-defined]
    setattr(module, _FN, cached)
    try:
        yield
    finally:
        if getattr(module, _FN, None) is cached:
            setattr(module, _FN, original)
        cache.entries = used
