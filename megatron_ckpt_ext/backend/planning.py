"""torch's object collectives while megatron-core plans a save: sent to a host (gloo) group of the
same ranks instead of the default group (:func:`object_collectives_on`)."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

from .introspect import _parameters

__all__ = ["object_collectives_on"]

_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list",
                       "scatter_object_list")


@functools.lru_cache(maxsize=16)
def _group_position(fn: Callable[..., Any]) -> int | None:
    """Where ``fn`` takes ``group`` positionally (read once per function: this runs per save)."""
    names = list(_parameters(fn))
    return names.index("group") if "group" in names else None


@contextlib.contextmanager
def object_collectives_on(group: Any, also: Any = None) -> Iterator[None]:
    """While megatron-core plans a save on this thread: torch's object collectives asked for the
    default group (``group=None``: megatron-core's validation of a new structure, its common
    state's check, the save plan's gather and scatter, which torch DCP and nvrx run on the
    default group) run on ``group``, a gloo group of the same ranks (None: nothing changes).
    Over NCCL each pickles onto the device and reads back, and that read waits behind the save's
    device-to-host copies in flight. Same ranks, same results; calls that name a group (by
    keyword or by position) and other threads' calls are left alone, except a call naming by
    keyword a group ``also`` = (that group, its stand-in) maps: it runs on the stand-in (the
    planning ahead's own gloo copy of the data-parallel group, for the fully parallel save)."""
    import torch.distributed as dist

    if group is None:
        yield
        return
    named, stand_in = also if also is not None else (object(), None)
    me = threading.get_ident()
    originals = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES if hasattr(dist, name)}

    def redirected(original: Any) -> Any:
        at = _group_position(original)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if (threading.get_ident() == me and at is not None and len(args) <= at
                    and kwargs.get("group") is None):
                kwargs["group"] = group
            elif threading.get_ident() == me and kwargs.get("group") is named:
                kwargs["group"] = stand_in
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist, name, redirected(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
