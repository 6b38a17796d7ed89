"""The files megatron-core's (or nvrx's) async writer opens: seen as they are written, so a
checksum of every byte costs no second read. The writers call the builtin ``open`` by its module
global name, so a module-level ``open`` in their module takes its place for the write's duration
(inherited by any process the writer forks)."""

from __future__ import annotations

import builtins
import contextlib
import os
import queue
import sys
import threading
from functools import partial
from typing import Any, Callable, Iterator

from ._imports import MCORE_STRATEGIES, NVRX_ASYNC
from .._crc import crc32

__all__ = ["checksummed_writes"]

_WRITER_MODULES = (f"{MCORE_STRATEGIES}.filesystem_async", f"{NVRX_ASYNC}.filesystem_async")
_UNSET = object()


class _SummingFile:
    """A binary file opened for writing whose bytes are CRC-32'd as they go through ``write``;
    ``on_close(path, nbytes, crc)`` once it is closed (after the writer's fsync).

    The CRC runs on a thread of its own, in write order, so it overlaps the writer's next writes
    and its fsync instead of adding to them (the CRC releases the GIL). Large buffers are summed in
    place (they are the save's staged tensors, alive until the commit); small ones, which the
    serializer may reuse once ``write`` returns, are copied first."""

    _COPY_BELOW = 1 << 20

    def __init__(self, raw: Any, path: str, on_close: Callable[[str, int, int], None]) -> None:
        self._raw, self._path, self._on_close = raw, path, on_close
        self.crc, self.nbytes = 0, 0
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._sum, name="mcx-crc32", daemon=True)
        self._thread.start()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        written = len(view) if written is None else written
        part = view[:written]
        self._pending.put(bytes(part) if written < self._COPY_BELOW else part)
        self.nbytes += written
        return written

    def _sum(self) -> None:
        while True:
            part = self._pending.get()
            if part is None:
                return
            self.crc = crc32(part, self.crc)

    def _join(self) -> None:
        self._pending.put(None)
        self._thread.join()

    def close(self) -> None:
        if self._raw.closed:
            return
        self._raw.close()
        self._join()
        self._on_close(self._path, self.nbytes, self.crc)

    def __enter__(self) -> _SummingFile:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self._raw.close()  # a failed write records nothing
            self._join()
            return
        self.close()

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, seek, closed, name, ...
        return getattr(self._raw, name)


@contextlib.contextmanager
def checksummed_writes(
        on_close: Callable[[str, int, int], None]) -> Iterator[Callable[[Any], Any]]:
    """While inside: every file the installed writers open with mode ``"wb"`` reports
    ``(path, bytes, crc32)`` to ``on_close`` when closed. Other opens are untouched.

    Yields ``rebind(fn)``: ``fn`` (a write function) with the builtin ``open`` it carries as an
    argument replaced by the summing one. nvrx 0.7's writer binds ``open`` when it is built (its
    ``open_file``, passed to its write function), before any module global could be swapped."""

    def summing_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        raw = builtins.open(file, mode, *args, **kwargs)
        if mode != "wb" or isinstance(file, int):
            return raw
        return _SummingFile(raw, os.fsdecode(file), on_close)

    modules = [sys.modules[name] for name in _WRITER_MODULES if name in sys.modules]
    before = [module.__dict__.get("open", _UNSET) for module in modules]
    for module in modules:
        module.open = summing_open
    try:
        yield partial(_rebind_open, summing_open=summing_open)
    finally:
        for module, previous in zip(modules, before):
            if previous is _UNSET:
                module.__dict__.pop("open", None)
            else:
                module.open = previous


def _rebind_open(fn: Any, *, summing_open: Callable[..., Any]) -> Any:
    """``fn`` with every ``builtins.open`` among its bound arguments (through nested partials)
    replaced by ``summing_open``; anything else unchanged."""
    if not isinstance(fn, partial):
        return fn
    args = tuple(summing_open if a is builtins.open else _rebind_open(a, summing_open=summing_open)
                 for a in fn.args)
    keywords = {k: summing_open if v is builtins.open else v for k, v in fn.keywords.items()}
    inner = _rebind_open(fn.func, summing_open=summing_open)
    return partial(inner, *args, **keywords)
