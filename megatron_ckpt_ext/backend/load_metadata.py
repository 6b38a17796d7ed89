"""A checkpoint's DCP ``.metadata`` unpickled once per load on each rank: every reader
megatron-core builds during the load (its sharded load's; on 0.19 its common-state load's too)
answers ``read_metadata`` from one memo, which a caller that has read the file already fills.
Only megatron-core's reader factories are wrapped, and only for the load: torch's classes stay
as they are (each reader is swapped to a subclass, as :mod:`.load_reader` does). Also here:
torch DCP's load planned without a collective (:func:`planned_on_each_rank`: at one rank, or
at any number for a load that agrees on failures itself)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import threading
import warnings
from typing import Any, Callable, Iterator, Mapping

from .introspect import call_arguments

__all__: list[str] = []

_FACTORY = "_get_filesystem_reader"


class MetadataMemo:
    """One load's DCP ``Metadata`` by checkpoint directory: read by the first reader that asks
    (or handed in, ``known``), the same object for every later one."""

    def __init__(self, known: Mapping[str, Any] | None = None) -> None:
        self._by_dir = {_key(path): md for path, md in (known or {}).items()}
        self._lock = threading.Lock()

    def read(self, reader: Any, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``reader``'s metadata: the memo's, else ``read(*args, **kwargs)`` (its class's own
        read), kept. A per-rank metadata file (``rank=``) is read as asked."""
        if kwargs.get("rank") is not None:
            return read(*args, **kwargs)
        key = _key(reader.path)
        with self._lock:  # two readers at once: still one read
            metadata = self._by_dir.get(key)
            if metadata is None:
                metadata = self._by_dir[key] = read(*args, **kwargs)
                return metadata
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:  # as a fresh read says: loaded by this reader
            storage_meta.load_id = getattr(reader, "load_id", storage_meta.load_id)
        return metadata


def _key(path: Any) -> str:
    return os.path.abspath(os.fspath(path))


def memo_read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``read_metadata`` of a swapped reader: through its memo (``_mcx_memo``)."""
    return self._mcx_memo.read(self, super(type(self), self).read_metadata, *args, **kwargs)


_CLASSES: dict[type, type] = {}


def share(reader: Any, memo: MetadataMemo) -> Any:
    """``reader`` answering ``read_metadata`` from ``memo`` (a torch ``FileSystemReader`` with
    a local ``path``); any other reader as it is."""
    from torch.distributed.checkpoint import FileSystemReader

    if not isinstance(reader, FileSystemReader) or not hasattr(reader, "path"):
        return reader
    base = type(reader)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"SharedMetadata{base.__name__}", (base,),
                              {"read_metadata": memo_read_metadata})
    reader.__class__ = _CLASSES[base]
    reader._mcx_memo = memo
    return reader


@contextlib.contextmanager
def factory_wrapped(module_name: str, wrap: Callable[[Any], Any]) -> Iterator[str | None]:
    """While inside, the readers ``module_name``'s ``_get_filesystem_reader`` builds pass
    through ``wrap``; yields None, or why nothing is wrapped (no such module or factory)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        yield f"{module_name} does not import ({e})"
        return
    original = getattr(module, _FACTORY, None)
    if original is None:
        yield f"this megatron-core builds its reader without {_FACTORY}"
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrap(original(*args, **kwargs))

    setattr(module, _FACTORY, wrapped)
    try:
        yield None
    finally:
        setattr(module, _FACTORY, original)


_DCP_LOADS = ("load_state_dict", "load")


@contextlib.contextmanager
def planned_on_each_rank(*, every_size: bool = False) -> Iterator[bool]:
    """While inside, where torch.distributed's default group has one rank (with ``every_size``:
    any number, for the calls of this thread): torch DCP's ``load_state_dict`` / ``load``,
    called without ``no_dist``, plan the load on each rank alone (``no_dist=True``, as
    megatron-core 0.19 asks itself at every world size). megatron-core <= 0.16 lets DCP gather
    every rank's plan to one rank and scatter it back, although the default global load plan is
    the identity (at one rank it pickles every read item twice to exchange it with itself; at 4
    ranks ~80 ms a load on CPU), then gather every rank's read result. Those collectives also
    told every rank that one rank's load failed: ``every_size`` is for a caller that agrees on
    that itself (load/loader.py: ``_failed_ranks``). A call that says ``no_dist`` itself (with
    ``every_size``: or that another thread makes) is left as it is. Yields whether it applies."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or (
            not every_size and dist.get_world_size() != 1):
        yield False
        return
    import torch.distributed.checkpoint as dcp

    originals = {name: getattr(dcp, name, None) for name in _DCP_LOADS}
    for name, fn in originals.items():
        if fn is not None and "no_dist" in inspect.signature(fn).parameters:
            setattr(dcp, name, _planned_locally(fn, dist, every_size=every_size))
    try:
        yield True
    finally:
        for name, fn in originals.items():
            if fn is not None:
                setattr(dcp, name, fn)


def _planned_locally(fn: Callable[..., Any], dist: Any, *,
                     every_size: bool = False) -> Callable[..., Any]:
    # a call its signature does not describe is judged by its keywords (call_arguments): torch's
    # ``load`` takes its storage reader positionally (``_api_bc_check``, megatron-core 0.19's
    # form) although it is keyword-only in the signature; such a call is passed on unchanged
    arguments = call_arguments(fn) or (lambda *args, **kwargs: kwargs)
    installer = threading.get_ident()
    undecorated, deprecation = _deprecated(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = arguments(*args, **kwargs)
        # asked at each call (the group it loads on, None: the default one), so a wrapper a
        # concurrent load left installed never skips a collective a larger group needs; with
        # every_size only the installing thread's calls (the load that agrees on failures)
        if "no_dist" not in bound and dist.is_initialized() and (
                threading.get_ident() == installer if every_size
                else dist.get_world_size(bound.get("process_group")) == 1):
            kwargs["no_dist"] = True
        if deprecation is not None:  # said where the caller calls it, as without this wrapper
            warnings.warn(deprecation[0], deprecation[1], stacklevel=2)
        return undecorated(*args, **kwargs)

    return call


def _deprecated(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[str, type] | None]:
    """(the function under ``fn``'s ``@deprecated``, (its message, its warning category)), or
    (``fn``, None) for anything else. torch's ``load_state_dict`` is one (megatron-core <= 0.16
    calls it): its warning, raised inside the wrapper above, would name this module's line as
    the place that calls a deprecated function; the wrapper says it in the caller's name."""
    inner, message = getattr(fn, "__wrapped__", None), getattr(fn, "__deprecated__", None)
    cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()),
                     getattr(fn, "__closure__", None) or ()))
    try:
        category = cells["category"].cell_contents
    except (KeyError, ValueError):  # not typing_extensions' (or warnings') decorator
        return fn, None
    if not (callable(inner) and isinstance(message, str) and isinstance(category, type)
            and issubclass(category, Warning)):
        return fn, None
    return inner, (message, category)
