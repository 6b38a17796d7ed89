"""Reading a backend's callables without calling them: the accepted keywords, the parameters
declared, the names its code looks up. The only user of ``inspect`` in the package."""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
from typing import Any, Callable, Mapping

logger = logging.getLogger("megatron_ckpt_ext.backend")

_POPPED_KWARG = re.compile(r"kwargs\s*\.\s*(?:pop|get)\(\s*['\"](\w+)['\"]")


_FORWARDS_TO_SUPER = re.compile(r"super\(\s*(?:\w+\s*,\s*\w+)?\s*\)\s*\.__init__\([^)]*\*\*kwargs", re.S)


def _owner_and_init(fn: Callable[..., Any]) -> tuple[type | None, Callable[..., Any]]:
    """(class, its __init__) for a class or a class's ``__init__``; (None, fn) otherwise.

    A class is probed through ``__init__``: ``inspect.signature`` of a class whose metaclass
    defines ``__call__(cls, *args, **kwargs)`` (nvrx 0.7 AsyncCallsQueue) shows only that.
    """
    if isinstance(fn, type):
        for klass in fn.__mro__:
            if "__init__" in vars(klass):
                return klass, vars(klass)["__init__"]
        return None, fn
    parts = getattr(fn, "__qualname__", "").split(".")
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if len(parts) >= 2 and parts[-1] == "__init__" and module is not None:
        owner: Any = module
        for part in parts[:-1]:
            owner = getattr(owner, part, None)
        if isinstance(owner, type) and vars(owner).get("__init__") is fn:
            return owner, fn
    return None, fn


def _parent_init_owner(owner: type) -> type | None:
    for klass in owner.__mro__[1:]:
        if "__init__" in vars(klass) and klass is not object:
            return klass
    return None


def _accepted_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    """Keyword names ``fn`` accepts; None when it truly accepts any keyword. A bound method is
    read through its function (minus the parameter its instance fills): the cache below must
    not be keyed by bound methods, which are made anew at each attribute access and hold their
    instance (a replayed save's writer with its write buckets, one per save, was kept alive by
    it: 256 saves' worth in the trainer and in the persistent writer)."""
    func = getattr(fn, "__func__", None)
    if inspect.ismethod(fn) and func is not None:
        names = _accepted_names_cached(func)
        first = next(iter(_parameter_names(func)), None)
        return names if names is None or first is None else names - {first}
    return _accepted_names_cached(fn)


@functools.lru_cache(maxsize=256)
def _parameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


@functools.lru_cache(maxsize=256)
def _accepted_names_cached(fn: Callable[..., Any]) -> frozenset[str] | None:
    """:func:`_accepted_names` of a function or class (what the cache may hold).

    A ``**kwargs`` callee accepts anything only when it does not forward them: an ``__init__``
    that passes ``**kwargs`` to ``super().__init__`` accepts its own names, the names it pops from
    ``kwargs``, and what the parent's ``__init__`` accepts (nvrx 0.4 FileSystemWriterAsync).
    """
    owner, target = _owner_and_init(fn)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return named - {"self"}
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        return None
    parent = _parent_init_owner(owner) if owner is not None else None
    if parent is None or not _FORWARDS_TO_SUPER.search(source):
        return None
    inherited = _accepted_names(parent)
    if inherited is None:
        return None
    return (named | frozenset(_POPPED_KWARG.findall(source)) | inherited) - {"self"}


def accepted_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[dict, dict]:
    """Split ``kwargs`` into (accepted by ``fn``, dropped)."""
    names = _accepted_names(fn)
    if names is None:
        return dict(kwargs), {}
    accepted = {k: v for k, v in kwargs.items() if k in names}
    dropped = {k: v for k, v in kwargs.items() if k not in names}
    return accepted, dropped


def call_with_supported(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **accepted)``; keywords ``fn`` does not take are dropped (debug log).

    Pass every value that matters explicitly: backend defaults changed between releases.
    """
    accepted, dropped = accepted_kwargs(fn, kwargs)
    if dropped:
        logger.debug("%s does not accept %s; dropped", _name(fn), sorted(dropped))
    return fn(*args, **accepted)


def call_arguments(fn: Callable[..., Any]) -> Callable[..., dict[str, Any]] | None:
    """A function mapping a call's ``(*args, **kwargs)`` of ``fn`` to ``{parameter: value}``
    (the parameters the call passed, by name), or None where ``fn`` has no signature. A call
    the signature does not describe (a decorator that takes more than it shows, as torch's
    ``_api_bc_check`` does) maps to its keywords alone."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None

    def arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return dict(signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            return dict(kwargs)

    return arguments


def _takes(fn: Any, name: str) -> bool:
    if fn is None:
        return False
    names = _accepted_names(fn)
    return names is None or name in names


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _source_has(obj: Any, needle: str, *, default: bool) -> bool:
    if obj is None:
        return default
    try:
        return needle in inspect.getsource(obj)
    except (OSError, TypeError):
        return default


def _code_names(fn: Any) -> frozenset[str]:
    """Global and attribute names ``fn``'s own code looks up (empty when it has no code)."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    return frozenset(code.co_names) if code is not None else frozenset()


def _names_param(fn: Any, name: str) -> bool:
    """``fn`` declares a parameter ``name`` (a ``**kwargs`` catch-all does not count)."""
    if fn is None:
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _parameters(fn: Any) -> Mapping[str, Any]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
