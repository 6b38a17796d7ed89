"""What a save plans from: the state's structure key and the save strategy kept while that
structure holds (``--ckpt-assume-constant-structure``: megatron-core's cached plan and metadata)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import tempfile
import threading
import time
from typing import Any

from .. import backend, strategy
from .._runtime import rank
from ..collectives import Group
from ..debug import env_switch
from ..options import CkptOptions


__all__ = ["SavePlanner", "copy_leaves", "copy_structure", "state_bytes", "structure_digest",
           "structure_key", "structure_objects"]

logger = logging.getLogger(__name__)


class SavePlanner:
    """Keeps the save strategy only while no rank's structure changed, and says when the
    sharding must be validated (the first save included), as Megatron-LM skips validation after
    its first save; without constant structure, a fresh strategy and a validation every save."""

    def __init__(self, options: CkptOptions, *, dp_group: Any = None) -> None:
        self.options = options
        self.dp_group = dp_group
        self._strategy: Any = None
        self._structure: tuple | None = None
        # megatron-core's conversions of the last save, reused while the structure holds
        self.conversions = backend.ConversionCache() if self.constant else None
        # the request megatron-core planned for this structure, replayed by steady saves
        self.replay = backend.SaveReplay() if self.constant else None
        self._validated: tuple | None = None  # the structure prepare() validated
        self._digest: tuple | None = None  # (digest, objects) of _structure, for the seal
        self.planned_ahead_s: float | None = None  # plan_ahead()'s time, until a save reports it
        # the caller's preprocessing of the common state before megatron-core compares it across
        # ranks (Checkpointer.save/prepare's ``preprocess_common``; the latest given is kept)
        self.preprocess_common: Any = None

    def keep_common_check(self, preprocess_common: Any) -> None:
        """``Checkpointer.save``/``prepare``'s ``preprocess_common``: kept until another is
        given (None keeps the one there)."""
        if preprocess_common is not None:
            self.preprocess_common = preprocess_common

    @property
    def constant(self) -> bool:
        return bool(self.options.ckpt_assume_constant_structure)

    def key(self, state: Any) -> tuple | None:
        """This rank's structure key of ``state``, when the strategy may be kept (else None)."""
        return structure_key(state) if self.constant else None

    def is_new(self, key: tuple | None) -> bool:
        """Whether this rank's structure differs from the one the kept strategy was built for."""
        return not self.constant or key != self._structure

    def use(self, key: tuple | None, record: Any) -> None:
        """After every rank agreed on ``record.new_structure``: keep or rebuild the strategy
        (setting ``record.new_structure`` when the sharding must be validated)."""
        if not self.constant:
            record.new_structure = True
            return
        if record.new_structure or self._strategy is None:
            if self._strategy is not None and rank() == 0:
                logger.info("checkpoint structure changed on some rank (%s here): rebuilding "
                            "the cached save plan", describe_change(self._structure, key))
            self._strategy = strategy.save_strategy(self.options, dp_group=self.dp_group)
            record.new_structure = True  # (the conversions' own keys hold their inputs)
            self.replay.clear()  # recorded with the old strategy
            self._digest = None  # (digest(): made again once, for the new structure)
        self._structure = key

    def strategy(self) -> Any:
        """The save strategy: the one kept by :meth:`use`, else a fresh one."""
        if self.constant and self._strategy is not None:
            return self._strategy
        return strategy.save_strategy(self.options, dp_group=self.dp_group)

    def validate_ahead(self, state: Any, group: Group) -> bool:
        """Collective (``prepare()``, every rank): megatron-core's sharding validation of
        ``state`` now, so the first save of the same structure need not run it (the save still
        does where any rank's structure is not the validated one); not again where every rank's
        structure is the one validated already (a second ``prepare()``, or after
        :meth:`validated_by_seal`). Whether it is validated; a failure is left for the save to
        raise."""
        if not self.constant:
            return False
        key = structure_key(state)
        if _all_true(key == self._validated, group):
            return True
        try:
            ok = backend.validate_sharding(copy_structure(state), self.preprocess_common)
        except Exception as e:  # noqa: BLE001 - the first save validates again and raises it
            logger.debug("sharding validation at prepare(): %s: %s", type(e).__name__, e)
            ok = False
        self._validated = key if ok else None
        return ok

    def validated_by_seal(self, key: tuple) -> None:
        """After a restore from memory in which every rank's state had the structure (``key``)
        its sealed snapshot was saved with (``Seal.structure``, checked on every rank and
        agreed): that structure passed megatron-core's validation in the run that saved it, at
        this world size, so ``prepare()`` and the first save do not validate it again."""
        if self.constant:
            self._validated = key

    def digest(self) -> tuple[str, list]:
        """:func:`structure_digest` of the structure the kept strategy is for (after
        :meth:`use`) and its items that are not ShardedTensors (:func:`structure_objects`): a
        save's seal names them, for a restart to match (and to say what differs)."""
        if self._digest is None:  # (a steady save reuses it: no walk of its structure)
            self._digest = (structure_digest(self._structure), structure_objects(self._structure))
        return self._digest

    def validated(self, key: tuple | None) -> bool:
        """Whether prepare() validated this rank's structure ``key`` already."""
        return self.constant and key is not None and key == self._validated

    def convert_ahead(self, state: Any, staged: list) -> int:
        """After ``prepare()`` allocated the staging (``staged``: its buffers, in the order of
        ``state``'s tensors): megatron-core's conversions of the first save, computed now, off
        its critical path (:func:`backend.convert_ahead`). Returns how many; ``state`` is not
        modified."""
        if self.conversions is None:
            return 0
        swap = iter(staged)
        state = copy_structure(state)
        backend.map_sharded_tensors(state, lambda t: backend.with_data(t, next(swap)))
        groups: dict[str, list] = {}
        backend.map_sharded_tensors(state, lambda t: groups.setdefault(t.key, []).append(t) or t)
        return backend.convert_ahead(self.conversions, list(groups.values()))

    def ahead_group(self, group: Group) -> Any:
        """Collective (``prepare()``, every rank): the host groups :meth:`plan_ahead` runs on,
        made once (:meth:`Group.background_control`; with megatron-core's fully parallel save
        over more than one data-parallel rank, a gloo copy of the data-parallel group for its
        exchange of shards); None where nothing is planned ahead (no constant structure,
        ``MCX_PLAN_AHEAD=0``, no such group)."""
        if not self.constant or env_switch("MCX_PLAN_AHEAD") == "0":
            return None
        world = group.background_control()
        if world is None:
            return None
        also, dp = None, self.dp_group
        if strategy.fully_parallel_save(self.options, dp):
            import torch.distributed as dist  # (None: megatron-core names the world's group)

            also = (dist.group.WORLD, world) if dp is None else (dp, group.background_copy(dp))
        return world, also

    def ahead(self, state: Any, staged: list, group: Any) -> Any:
        """In ``prepare()``'s allocation thread: (``group`` given) :meth:`validate_ahead` on
        its host group, off the caller's critical path (a load's or a training step's); then
        :meth:`convert_ahead`; then (``group`` given) :meth:`plan_ahead`, reached by every rank
        whatever the conversions did. Without ``group`` prepare() validated already.
        ``staged`` None: the allocation failed on this rank; the collectives still run (every
        rank must reach them), nothing is converted or planned. Returns the first save's
        request as planned ahead (unwritten; its lists are handed over ahead), or None."""
        request = None
        try:
            if group is not None:
                with backend.object_collectives_on(*group):
                    self.validate_ahead(state, Group(group[0], self.options))
            if staged is not None:
                self.convert_ahead(state, staged)
        finally:
            if group is not None:
                request = self.plan_ahead(state, staged, group)
        return request

    def plan_ahead(self, state: Any, staged: list, groups: Any) -> Any:
        """Collective on ``groups`` (what :meth:`ahead_group` made: host groups that only this
        thread uses; every rank), after ``prepare()`` allocated the staging (``staged``, in the
        order of ``state``'s tensors): megatron-core plans the first save now, off its critical
        path. It plans twice (it trusts its cached plan from the second equal one), into a
        throwaway directory, with the buffers the first save will stage into; the requests are
        dropped unwritten. The strategy is then kept for the structure ``prepare()`` validated,
        as after two saves, so the first save finds its plan cached. A later ``prepare()`` of
        another structure plans again (the launcher's after the first step: the load's lacked
        Megatron's rerun state). Kept only where every rank planned; otherwise the first save's
        own agreement on a new structure has every rank plan. megatron-core's fully parallel
        save exchanges its shards on the data-parallel group: here that exchange runs on the
        gloo copy :meth:`ahead_group` made, or nothing is planned ahead. Returns the first
        save's request as planned ahead (unwritten) where the strategy was kept, else None."""
        group, also = groups
        key, planned, request = self._validated, None, None
        ok = False
        if self.constant and key is not None and staged is not None and (
                self._strategy is None or self._structure != key):
            planned = strategy.save_strategy(self.options, dp_group=self.dp_group)
            ok = also is None or also[1] is not None  # the exchange's stand-in was made
            if self.replay is not None:  # the second plan below records for the first save
                self.replay.clear()
        agree = Group(group, self.options)  # the background group's own collectives
        ok = _all_true(ok, agree)  # every rank reaches this, planning or not
        if ok:
            start = time.perf_counter()
            try:
                request = self._plan_twice(state, staged, planned, group, also)
            except Exception as e:  # noqa: BLE001 - the first save plans (and raises) itself
                logger.debug("rank %d could not plan the first save ahead: %s: %s", rank(),
                             type(e).__name__, e)
                ok = False
            ok = _all_true(ok, agree)
            if not ok and rank() == 0:
                logger.info("megatron-ckpt-ext: the first save could not be planned ahead on "
                            "every rank (each rank's reason at DEBUG); it plans itself")
            self.planned_ahead_s = round(time.perf_counter() - start, 6) if ok else None
        if ok:
            self._strategy, self._structure, self._digest = planned, key, None
            return request
        if planned is not None and self.replay is not None:
            self.replay.clear()  # (what it recorded, if anything, is of a strategy not kept)
        return None

    def _plan_twice(self, state: Any, staged: list, planned: Any, group: Any,
                    also: Any = None) -> Any:
        swap = iter(staged)
        state = copy_structure(state)
        backend.map_sharded_tensors(state, lambda t: backend.with_data(t, next(swap)))
        mine = {t.untyped_storage().data_ptr() for t in staged}
        me = threading.get_ident()  # torch's clone is patched process-wide: this thread's only
        with tempfile.TemporaryDirectory(prefix="mcx-plan-ahead-") as folder, \
                backend.writer_keeps_snapshots(lambda t: threading.get_ident() == me and
                                               t.untyped_storage().data_ptr() in mine), \
                backend.into_fresh_directory(), backend.version_checks_cached(), \
                backend.conversions_cached(self.conversions), \
                backend.object_collectives_on(group, also):
            for replay in (None, self.replay):  # the second, its cache valid, is recorded
                with backend.plan_replayed(planned, replay):
                    request = backend.dist_checkpointing().save(
                        copy_structure(state), folder, planned, async_sharded_save=True,
                        validate_access_integrity=False)
        return request

    def reset(self) -> None:
        self._strategy = self._structure = self._validated = self._digest = None
        if self.conversions is not None:
            self.conversions.clear()
        if self.replay is not None:
            self.replay.clear()


def _all_true(ok: bool, group: Group) -> bool:
    """Whether ``ok`` on every rank of ``group``."""
    return group.all_max([0.0 if ok else 1.0])[0] == 0.0


def state_bytes(state: Any) -> int:
    sizes: list[int] = []
    backend.map_sharded_tensors(state, lambda t: sizes.append(t.data.numel() * t.data.element_size()) or t)
    return sum(sizes)


def copy_structure(node: Any) -> Any:
    """Copy nested dicts/lists (not their leaves), so the caller's dict is never modified."""
    if isinstance(node, dict):
        return {k: copy_structure(v) for k, v in node.items()}
    if isinstance(node, list):
        return [copy_structure(v) for v in node]
    return node


def copy_leaves(node: Any) -> Any:
    """:func:`copy_structure`, and every ShardedTensor a shallow copy sharing its data tensor:
    megatron-core's load reassigns each one's ``data`` (a view with the prepended axes, a
    detached or contiguous one), which must not reach the caller's objects."""
    state = copy_structure(node)
    backend.map_sharded_tensors(state, copy.copy)
    return state


def structure_key(state: Any) -> tuple:
    """Keys, shapes, dtypes and placement of every sharded item: what cached metadata assumes."""
    items: list[tuple] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif hasattr(node, "key"):
            data = getattr(node, "data", None)
            items.append((type(node).__name__, node.key, tuple(getattr(node, "global_shape", ()) or ()),
                          tuple(getattr(node, "global_offset", ()) or ()),
                          str(getattr(data, "dtype", "")), tuple(getattr(data, "shape", ()) or ())))

    walk(state)
    return tuple(sorted(items))


def structure_digest(key: tuple | None) -> str:
    """A stable digest of a :func:`structure_key` (the same in every process), or '' for
    None (no constant structure: nothing is kept, nothing proven)."""
    return "" if key is None else hashlib.sha1(repr(key).encode()).hexdigest()


def structure_objects(key: tuple | None) -> list[list]:
    """The items of a :func:`structure_key` that are not ShardedTensors (ShardedObjects and the
    like: few), as JSON gives them back (lists): a seal keeps them to say what differs."""
    return [] if key is None else json.loads(json.dumps([i for i in key
                                                          if i[0] != "ShardedTensor"]))


def describe_change(old: tuple | None, new: tuple) -> str:
    if old == new:
        return "unchanged on this rank"
    old_keys, new_keys = {i[1] for i in old or ()}, {i[1] for i in new}
    added, removed = sorted(new_keys - old_keys), sorted(old_keys - new_keys)
    if added or removed:
        return f"added {added[:3]}, removed {removed[:3]}"
    return "shapes, dtypes or placement changed"
