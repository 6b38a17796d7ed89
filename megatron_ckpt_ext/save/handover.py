"""What the persistent writer keeps between saves: the request's long lists that stay the same
at every save of a constant structure (the write items, the staged shared-memory tensors, or
their pairs), so that each save's hand-over pickles them once.

A persistent writer gets each save as one pickled request. Pickling its long lists (one write
item and one staged tensor per tensor of the state) held the GIL in the queue's feeder thread
beside the trainer's own work (what it cost: docs/notes/megatron_lm.md). Under a
constant structure they are equal at every save: the same write items, tensors on the same
staged buffers. :func:`kept_in_writer` wraps each such list in :class:`Kept`, which pickles
(in the feeder thread) as a key and the list's pickle, made once per key and then sent as
bytes; the writer unpickles it once per key and afterwards reuses what it built. The bytes
travel every time, so a fresh writer (a restart) never depends on what an older one kept.

Keys never outlive their contents: the sender holds the write items while their key exists
(so no id is reused), staged tensors are keyed by their data pointer, dtype, shape and stride,
and every key dies when this process frees a staging segment (the segment epoch), on both
sides. ``MCX_RESEND_EACH_SAVE=1`` pickles the lists in full at every save, as before.

The first save of a structure would pickle its lists in full (15-36 ms of the feeder thread's
GIL beside that save's last steps: its copies wait behind it). :func:`made_ahead` makes those
pickles from the request ``prepare()`` planned ahead for the first save, on prepare()'s thread;
the first save then finds them made, as a steady save does.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections import OrderedDict
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem

from ..debug import env_switch
from ..staging import segments

__all__ = ["Kept", "kept_in_writer", "made_ahead", "stats"]

MIN_LENGTH = 16  # shorter lists pickle in well under a millisecond: sent as they are
_MAX_KEYS = 8  # per side: a structure's lists, twice for two snapshot sets, and spare
_MAX_DEPTH = 8

# sender: key -> (serial, segment epoch, the write items named by identity (held), the pickle)
_SENT: OrderedDict[tuple, tuple[int, int, list, bytes]] = OrderedDict()
_sent_lock = threading.Lock()
_serial = 0
# writer: (sender pid, serial) -> the list it built, and the sender's (pid, epoch) it belongs to
_KEPT: OrderedDict[tuple[int, int], list] = OrderedDict()
_kept_epoch: list[tuple[int, int] | None] = [None]
stats = {"sent_whole": 0, "sent_known": 0, "built": 0, "reused": 0, "made_ahead": 0}


class Kept(list):
    """A list of the request that the writer may keep: pickles as (key, the list's pickle).
    Unpickled nowhere (a write run in this process), it is the list itself."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        items = list(self)
        key = _key(items)
        if key is None:  # not a list of ours after all: as it is
            return list, (items,)
        entry, epoch, _ = _entry(items, key, "sent_whole", "sent_known")
        return _rebuilt, (os.getpid(), entry[0], epoch, entry[3])


def _entry(items: list, key: tuple, made: str, known: str) -> tuple[tuple, int, bool]:
    """The sender's entry for ``items`` (its pickle made now where this key has none; ``made``
    or ``known`` counted), the segment epoch it belongs to, and whether it was made now."""
    epoch = segments.current_epoch()
    global _serial
    with _sent_lock:
        for old in [k for k, v in _SENT.items() if v[1] != epoch]:
            del _SENT[old]  # a segment was freed since: its data pointers may be reused
        entry = _SENT.get(key)
        fresh = entry is None
        if fresh:
            from multiprocessing.reduction import ForkingPickler

            _serial += 1
            entry = (_serial, epoch, _identities(items),
                     bytes(ForkingPickler.dumps(items, pickle.HIGHEST_PROTOCOL)))
            stats[made] += 1
        elif known:
            stats[known] += 1
        _SENT[key] = entry
        _SENT.move_to_end(key)
        while len(_SENT) > _MAX_KEYS:
            _SENT.popitem(last=False)
    return entry, epoch, fresh


def made_ahead(request: Any) -> int:
    """Before the first save of a structure (``prepare()``'s thread): the pickles of the lists
    that save's request will have the writer keep, made now from ``request`` (the first save's
    request as planned ahead, the write path's steps applied through :func:`kept_in_writer`:
    the same write items, the same staged buffers), so that save sends them by key. Returns
    how many were made; none where the request wraps no list. Lists the first save does not
    end up sending (another plan after all) stay unused and leave with the oldest keys."""
    lists: list[Kept] = []
    _find_kept((getattr(request, "preload_fn", None), request.async_fn_args), lists)
    made = 0
    for items in lists:
        key = _key(list(items))
        if key is not None:
            made += _entry(list(items), key, "made_ahead", "")[2]
    return made


def _find_kept(o: Any, out: list, depth: int = 0) -> None:
    if depth > _MAX_DEPTH + 1:
        return
    if isinstance(o, Kept):
        out.append(o)
    elif isinstance(o, partial):
        for a in (*o.args, *o.keywords.values()):
            _find_kept(a, out, depth + 1)
    elif isinstance(o, (tuple, list)):
        for a in o:
            _find_kept(a, out, depth + 1)


def _rebuilt(pid: int, serial: int, epoch: int, data: bytes) -> list:
    """The writer's side of :meth:`Kept.__reduce__`: what it built for this key, or built now."""
    if _kept_epoch[0] != (pid, epoch):
        _KEPT.clear()  # the sender freed a segment (or is another process): drop every mapping
        _kept_epoch[0] = (pid, epoch)
    built = _KEPT.get((pid, serial))
    if built is None:
        built = pickle.loads(data)
        _KEPT[(pid, serial)] = built
        stats["built"] += 1
        while len(_KEPT) > _MAX_KEYS:
            _KEPT.popitem(last=False)
    else:
        _KEPT.move_to_end((pid, serial))
        stats["reused"] += 1
    return list(built)  # a list of its own for each save: the writer may change it


def _identities(items: list) -> list:
    """What the sender holds while a key lives: the write items its key names by identity (so
    no id is reused meanwhile), never the staged tensors (held, a freed set's memory would stay
    mapped until the next save)."""
    return [e[0] if isinstance(e, tuple) else e for e in items if not isinstance(e, torch.Tensor)]


def _tensor_key(t: Any) -> tuple | None:
    """A staged tensor on one of our kept segments, by where it lies; None for anything else."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return None
    entry = segments.live_segment(t.untyped_storage().data_ptr())
    if entry is None or not entry[2]:  # not ours, or not kept across saves (no reuse)
        return None
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _key(items: list) -> tuple | None:
    """The list's key: its write items by identity, its staged tensors by place; None when an
    element is neither (or a pair of them)."""
    parts: list = []
    for e in items:
        if isinstance(e, WriteItem):
            parts.append(id(e))
        elif isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], WriteItem):
            place = _tensor_key(e[1])
            if place is None:
                return None
            parts.append((id(e[0]), place))
        else:
            place = _tensor_key(e)
            if place is None:
                return None
            parts.append(place)
    return tuple(parts)


def _worth_keeping(o: Any) -> bool:
    if not isinstance(o, list) or len(o) < MIN_LENGTH:
        return False
    first = o[0]
    return (isinstance(first, (WriteItem, torch.Tensor))
            or (isinstance(first, tuple) and len(first) == 2 and isinstance(first[0], WriteItem)))


def _wrapped(o: Any, depth: int = 0) -> Any:
    """``o`` with each list worth keeping wrapped; containers rebuilt only where one changed."""
    if depth > _MAX_DEPTH:
        return o
    if _worth_keeping(o):
        return Kept(o)
    if isinstance(o, partial):
        args = tuple(_wrapped(a, depth + 1) for a in o.args)
        kw = {k: _wrapped(v, depth + 1) for k, v in o.keywords.items()}
        if all(a is b for a, b in zip(args, o.args)) and all(kw[k] is o.keywords[k] for k in kw):
            return o
        return partial(o.func, *args, **kw)
    if isinstance(o, (tuple, list)):
        new = [_wrapped(a, depth + 1) for a in o]
        if all(a is b for a, b in zip(new, o)):
            return o
        if isinstance(o, list):
            return new
        return type(o)(*new) if hasattr(o, "_fields") else type(o)(new)
    return o


def kept_in_writer(request: Any, ctx: Any) -> Any:
    """Write-path step: a persistent writer's request under a constant structure, its long
    lists wrapped in :class:`Kept` (in the preload's arguments and the write's)."""
    if (not (ctx.is_async and ctx.persistent and ctx.options.ckpt_assume_constant_structure)
            or env_switch("MCX_RESEND_EACH_SAVE") == "1"):
        return request
    fields: dict[str, Any] = {}
    preload = getattr(request, "preload_fn", None)
    if preload is not None and (new := _wrapped(preload)) is not preload:
        fields["preload_fn"] = new
    args = request.async_fn_args
    if args is not None and (new := _wrapped(args)) is not args:
        fields["async_fn_args"] = new
    return request._replace(**fields) if fields else request
