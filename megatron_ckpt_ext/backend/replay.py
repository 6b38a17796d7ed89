"""A steady save's request replayed from what megatron-core planned for the same structure,
instead of planned again (``--ckpt-assume-constant-structure``).

With its plan cached, megatron-core's torch strategy still rebuilds per save what the plan
already fixes: it regroups every shard under its sharded key, converts each into a torch
sharded tensor, sets up a planner over them and resolves every write item of the cached plan
through it, one by one, into the writer. Only three things change from one steady save to the
next: the directory, the staged tensors' memory (another snapshot set, the same shapes) and the
bytes of the sharded objects (RNG states, the common state). :class:`SaveReplay` keeps, from a
save megatron-core planned in full and found its cache valid for, the plan it wrote, its writer,
its finalization's arguments and, for every tensor item, which of the state's shards it read and
how (shape and stride over the same memory). A later save whose shards and objects carry the
same metadata (:func:`_fingerprint`: keys, shapes, offsets, dtypes, replica ids; not their
memory) builds a fresh writer for its directory and resolves the same plan with its own
tensors and objects' bytes (megatron-core's own conversion of the objects alone), and returns
megatron-core's own request built from them. Anything that does not match, or any step that
fails, plans in full as before (and records again).

Collective safety: the strategy's own steady path plans without collectives once its cache is
valid (after two equal plans), so an entry is recorded only then; a rank that plans in full
while another replays runs no collective the other does not. ``MCX_REPLAY_PLAN=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from ..debug import env_switch
from ._imports import MCORE_DC, _import
from .introspect import _takes

__all__ = ["SaveReplay", "plan_replayed"]

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    fingerprint: tuple
    call: tuple  # async_save's extra arguments (megatron-core 0.19's async_strategy)
    plan: Any  # the finished plan the writer resolved
    slots: dict  # id(write item) -> (shard position, shape, stride) for every tensor item
    writer: Any
    old_dir: str
    ret: Any  # what the finalization takes: (writer, global metadata, dist wrapper)
    callbacks: tuple  # _get_save_and_finalize_callbacks's arguments after (writer, ret)
    planner: Any  # the planner of the recorded save: it resolves this save's objects
    coordinator: bool
    all_cpu: bool  # every tensor item on the host (staged): nvrx's device-tensor cache unused


@dataclass
class SaveReplay:
    """One Checkpointer's recorded plan (one structure); :meth:`clear` when it changes."""

    entry: _Entry | None = None
    last: str = ""  # "replayed" or "planned" (the last save's path), for the save report

    def clear(self) -> None:
        self.entry = None


def _enabled() -> bool:
    return env_switch("MCX_REPLAY_PLAN") != "0"


@contextlib.contextmanager
def plan_replayed(strategy: Any, replay: SaveReplay | None) -> Iterator[None]:
    """Around megatron-core's ``save(..., strategy, async_sharded_save=True)``: the torch
    strategy inside ``strategy`` (itself, or the fully parallel wrapper's base) replays
    ``replay``'s entry where this save matches it, else plans in full and records. None (or a
    strategy of another shape, or the switch off): nothing changes."""
    base = getattr(strategy, "base_strategy", strategy)
    original = getattr(base, "async_save", None)
    if (replay is None or not _enabled() or original is None
            or not hasattr(base, "_get_save_and_finalize_callbacks")
            or "async_save" in vars(base)):
        if replay is not None:
            replay.last = "planned"
        yield
        return
    replay.last = "planned"

    def async_save(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any,
                   **kwargs: Any) -> Any:
        return _replay_or_record(base, original, replay, sharded_state_dict, checkpoint_dir,
                                 args, kwargs)

    base.async_save = async_save
    try:
        yield
    finally:
        vars(base).pop("async_save", None)


def _replay_or_record(base: Any, original: Any, replay: SaveReplay, state: Any,
                      checkpoint_dir: Any, args: tuple, kwargs: dict) -> Any:
    shards, objects = _leaves(state)
    fingerprint = _fingerprint(shards, objects)
    call = (args, tuple(sorted(kwargs.items())))
    entry = replay.entry
    if entry is not None:
        if entry.fingerprint == fingerprint and entry.call == call:
            try:
                request = _replay(base, entry, shards, objects, str(checkpoint_dir))
            except Exception as e:  # noqa: BLE001 - planned in full below, as before
                logger.debug("save request not replayed (%s: %s): planning it", type(e).__name__,
                             e)
            else:
                replay.last = "replayed"
                return request
        replay.entry = None
    recorder = _Recorder(base)
    with recorder.installed():
        request = original(state, checkpoint_dir, *args, **kwargs)
    replay.entry = recorder.entry(shards, fingerprint, call, str(checkpoint_dir))
    return request


# -- what a save's state holds ------------------------------------------------------------------
def _leaves(state: Any) -> tuple[list, list]:
    """The ShardedTensors and ShardedObjects of ``state`` in traversal order (megatron-core's
    own ``nested_values``)."""
    mapping = _import(f"{MCORE_DC}.mapping")
    tensor_cls, object_cls = mapping.ShardedTensor, mapping.ShardedObject
    shards: list = []
    objects: list = []
    for value in _import(f"{MCORE_DC}.dict_utils").nested_values(state):
        if isinstance(value, tensor_cls):
            shards.append(value)
        elif isinstance(value, object_cls):
            objects.append(value)
    return shards, objects


def _fingerprint(shards: list, objects: list) -> tuple:
    """What the recorded plan depends on (not the memory that holds the data). Built per save
    for 400 shards: plain attribute reads, no conversions."""
    out = [(t.key, t.global_shape, t.global_offset, t.axis_fragmentations, t.prepend_axis_num,
            t.replica_id, t.flattened_range, getattr(t, "allow_shape_mismatch", False),
            None if t.data is None else (t.data.shape, t.data.stride(), t.data.dtype,
                                         t.data.device))
           for t in shards]
    out.extend((o.key, o.unique_key, o.global_shape, o.global_offset, o.replica_id)
               for o in objects)
    return tuple(out)


# -- recording a full plan ---------------------------------------------------------------------
class _Recorder:
    """During one full ``async_save``: the planner it made (through the strategy module's
    ``MCoreSavePlanner``, swapped for a recording subclass on this thread), the plan it finished,
    what it resolved for every item, and what its request was built from."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.module = sys.modules.get(type(base).__module__)
        self.thread = threading.get_ident()
        self.planners: list = []
        self.callbacks: tuple | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        cls = getattr(self.module, "MCoreSavePlanner", None)
        if cls is None:
            yield
            return
        recorder = self

        class Recording(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, **k)
                self._mcx_plan = None
                self._mcx_resolved: list = []
                if threading.get_ident() == recorder.thread:
                    recorder.planners.append(self)

            def finish_plan(self, plan: Any) -> Any:
                self._mcx_plan = super().finish_plan(plan)
                return self._mcx_plan

            def resolve_data(self, item: Any) -> Any:
                data = super().resolve_data(item)
                self._mcx_resolved.append((item, data))
                return data

        base = self.base
        build = base._get_save_and_finalize_callbacks

        def capture(writer: Any, ret: Any, *rest: Any) -> Any:
            self.callbacks = (writer, ret, rest)
            return build(writer, ret, *rest)

        self.module.MCoreSavePlanner = Recording
        base._get_save_and_finalize_callbacks = capture
        try:
            yield
        finally:
            self.module.MCoreSavePlanner = cls
            vars(base).pop("_get_save_and_finalize_callbacks", None)

    def entry(self, shards: list, fingerprint: tuple, call: tuple,
              old_dir: str) -> _Entry | None:
        """The entry to replay, or None where this save cannot be replayed: megatron-core's
        cache not yet valid (its next plan may gather), not one planner, not every item
        resolved here, a tensor item not read from one of the state's shards."""
        if len(self.planners) != 1 or self.callbacks is None or not _cache_valid(self.base):
            return None
        planner = self.planners[0]
        plan, resolved = planner._mcx_plan, planner._mcx_resolved
        writer, ret, rest = self.callbacks
        if plan is None or len(resolved) != len(plan.items) or (
                {id(i) for i, _ in resolved} != {id(i) for i in plan.items}):
            return None  # (megatron-core 0.16 resolves bucket by bucket: any order)
        by_memory = {}
        for pos, t in enumerate(shards):
            if t.data is not None:
                by_memory[_where(t.data)] = pos
        import torch

        slots = {}
        for item, data in resolved:
            if _is_bytes(item):
                continue
            if not isinstance(data, torch.Tensor):
                return None
            pos = by_memory.get(_where(data))
            if pos is None:
                return None
            slots[id(item)] = (pos, tuple(data.shape), tuple(data.stride()))
        template = _template(writer)
        entry = _Entry(fingerprint=fingerprint, call=call, plan=plan, slots=slots,
                      writer=template, old_dir=old_dir,
                      ret=type(ret)([template, *list(ret)[1:]]), callbacks=rest, planner=planner,
                      coordinator=bool(getattr(planner, "is_coordinator", False)),
                      all_cpu=all(d.device.type == "cpu" for i, d in resolved
                                  if not _is_bytes(i)))
        planner._mcx_resolved = []  # (the tensors of this save: not held)
        if isinstance(getattr(planner, "state_dict", None), dict):
            planner.state_dict = {}  # (its converted state: replays set up their own)
        return entry


def _template(writer: Any) -> Any:
    """A copy of the recorded writer without that save's data: every attribute holding a tensor
    (at any depth of lists and tuples) is None in it, so the entry keeps no staged memory mapped
    after its buffers are freed; ``prepare_write_data`` sets each of them anew at a replay."""
    import torch

    def holds(value: Any, depth: int = 0) -> bool:
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, (list, tuple)) and depth < 6:
            return any(holds(v, depth + 1) for v in value)
        return False

    template = copy.copy(writer)
    for name, value in list(vars(template).items()):
        if holds(value):
            setattr(template, name, None)
    return template


def _where(t: Any) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)


def _is_bytes(item: Any) -> bool:
    return getattr(item.type, "name", "") == "BYTE_IO"


def _cache_valid(base: Any) -> bool:
    """Whether the strategy's cached plan is trusted (its next save plans with no collective):
    megatron-core 0.16's ``validated_cache_reuse``, or that of nvrx's metadata cache (0.19)."""
    holder = getattr(base, "_metadata_cache", None) or base
    return bool(getattr(holder, "validated_cache_reuse", False)) and bool(
        getattr(holder, "cached_central_plan", None) is not None)


# -- replaying it -------------------------------------------------------------------------------
class _Resolver:
    """The planner the replayed writer resolves the recorded plan through: tensor items from
    this save's shards, the objects' bytes from megatron-core's planner set up over them."""

    def __init__(self, slots: dict, shards: list, objects: Any) -> None:
        self._slots, self._shards, self._objects = slots, shards, objects

    def resolve_data(self, item: Any) -> Any:
        slot = self._slots.get(id(item))
        if slot is None:
            return self._objects.resolve_data(item)
        pos, shape, stride = slot
        data = self._shards[pos].data.detach()
        return data if tuple(data.shape) == shape else data.as_strided(shape, stride)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._objects, name)


def _replay(base: Any, entry: _Entry, shards: list, objects: list, new_dir: str) -> Any:
    writer = _fresh_writer(entry.writer, entry.old_dir, new_dir)
    if entry.all_cpu and getattr(writer, "use_cached_data_structure", False):
        # nvrx caches only device tensors, and keys them by a hash of every item per save: with
        # every tensor on the host the outcome is "nothing cached" either way, without the hash
        writer.use_cached_data_structure = False
    _set_up_writer(writer, entry.coordinator)
    writer.prepare_local_plan(entry.plan)
    resolver = _Resolver(entry.slots, shards, _objects_planner(base, entry, objects))
    writer.prepare_write_data(entry.plan, resolver)
    ret = type(entry.ret)([writer, *list(entry.ret)[1:]])
    return base._get_save_and_finalize_callbacks(writer, ret, *entry.callbacks)


def _fresh_writer(old: Any, old_dir: str, new_dir: str) -> Any:
    """A copy of the recorded writer naming ``new_dir`` wherever it named the old directory;
    refused (raises) where any attribute still names it."""
    writer = copy.copy(old)
    for name, value in list(vars(writer).items()):
        if isinstance(value, (str, os.PathLike)) and os.fspath(value) == old_dir:
            setattr(writer, name, type(value)(new_dir))
    stale = [n for n, v in vars(writer).items()
             if isinstance(v, (str, os.PathLike)) and old_dir in os.fspath(v)]
    if stale:
        raise ValueError(f"the writer still names the old directory in {stale}")
    return writer


def _set_up_writer(writer: Any, coordinator: bool) -> None:
    set_up = writer.set_up_storage_writer
    if _takes(set_up, "is_coordinator"):
        set_up(is_coordinator=coordinator)
    else:
        set_up(coordinator)


def _objects_planner(base: Any, entry: _Entry, objects: list) -> Any:
    """megatron-core's planner (a copy of the recorded one) set up over this save's sharded
    objects alone, converted by megatron-core's own functions."""
    module = sys.modules[type(base).__module__]
    keep_main = bool(getattr(base, "keep_only_main_replica", False))
    grouped, _flat, _rename = module._replace_state_dict_keys_with_sharded_keys(
        {str(i): o for i, o in enumerate(objects)}, keep_main)
    pyt = module.mcore_to_pyt_state_dict(grouped, False)
    planner = copy.copy(entry.planner)
    planner.__class__ = type(entry.planner).__mro__[1]  # megatron-core's own class
    set_up = planner.set_up_planner
    if _takes(set_up, "is_coordinator"):
        set_up(pyt, is_coordinator=entry.coordinator)
    else:
        set_up(pyt, entry.coordinator)
    return planner
