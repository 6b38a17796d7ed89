"""The load's metadata step done ahead: where each item's tensor bytes lie in this rank's files
(:func:`.direct_read.item_layout`, the items' zip headers, read and parsed on one thread: 30-70
ms of an 8 GiB load of 492 items on the H100 host, ``metadata_s`` in the load report), parsed on
a thread of its own while the model is built (``Checkpointer.prepare_restore``). The load's reads take a file's layouts only
where the file is the one parsed (device, inode, size, modification time); anything else they
parse as before. What was parsed ahead serves one load: the load discards it at its end."""

from __future__ import annotations

import logging
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any

from . import direct_read

__all__ = ["LayoutsAhead", "discard", "start", "take"]

logger = logging.getLogger("megatron_ckpt_ext.backend")

_lock = threading.Lock()
_by_dir: dict[str, "LayoutsAhead"] = {}


def _key(directory: Any) -> str:
    return os.path.abspath(os.fspath(directory))


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class LayoutsAhead:
    """Item layouts of one checkpoint directory's files written by ``rank`` (``__{rank}_*``:
    the files a load in the same layout reads most of), parsed by :meth:`run`."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory, self.rank = Path(directory), rank
        self._files: dict[str, tuple[int, int, int, int]] = {}
        self._layouts: dict[tuple[str, int, int], tuple[Any, str]] = {}
        self._done = threading.Event()

    def run(self) -> None:
        try:
            self._parse()
        except Exception as e:  # noqa: BLE001 - the load parses as before
            logger.debug("item layouts not parsed ahead in %s: %s", self.directory, e)
            self._layouts.clear()
        finally:
            self._done.set()

    def _parse(self) -> None:
        with open(self.directory / ".metadata", "rb") as f:
            # not kept: its objects, alive until the load, would be promoted to the collector's
            # oldest generation and bring a full collection nearer
            storage_data = pickle.load(f).storage_data
        mine = re.compile(rf"__{self.rank}_\d+\.distcp$")
        by_file: dict[str, list[Any]] = {}
        for info in storage_data.values():
            if mine.match(str(info.relative_path)):
                by_file.setdefault(str(info.relative_path), []).append(info)
        for name, items in by_file.items():
            fd = os.open(self.directory / name, os.O_RDONLY)
            try:
                for info in items:  # a cold disk reads every header page at once
                    direct_read.prefetch_edges(fd, info.offset, info.length)
                self._files[name] = _identity(os.fstat(fd))
                for info in items:
                    self._layouts[(name, info.offset, info.length)] = direct_read.item_layout(
                        fd, info.offset, info.length)
            finally:
                os.close(fd)

    def wait(self) -> "LayoutsAhead":
        self._done.wait()
        return self

    def layout(self, name: str, fd: int, offset: int, length: int) -> tuple[Any, str] | None:
        """What :func:`.direct_read.item_layout` says of this item, where it was parsed ahead
        from this very file (``fd`` open on it); else None."""
        found = self._layouts.get((name, offset, length))
        if found is None or self._files.get(name) != _identity(os.fstat(fd)):
            return None
        return found

    def has(self, name: str, offset: int, length: int) -> bool:
        return (name, offset, length) in self._layouts

    def __len__(self) -> int:
        return len(self._layouts)


def start(directory: Path, rank: int) -> threading.Thread | None:
    """Parse ``directory``'s (a checkpoint's ``iter_N``) item layouts for ``rank`` on a thread
    (``mcx-layouts-ahead``); None where it has no ``.metadata``."""
    if not (Path(directory) / ".metadata").is_file():
        return None
    ahead = LayoutsAhead(directory, rank)
    with _lock:
        _by_dir[_key(directory)] = ahead
    thread = threading.Thread(target=ahead.run, daemon=True, name="mcx-layouts-ahead")
    thread.start()
    return thread


def take(directory: Any) -> LayoutsAhead | None:
    """What was parsed ahead for ``directory`` (waited for, where it still runs), or None; it
    stays until :func:`discard` (the load's readers may ask more than once)."""
    with _lock:
        ahead = _by_dir.get(_key(directory))
    return ahead.wait() if ahead is not None else None


def discard() -> None:
    """A load is over: what was parsed ahead goes, for its directory and for any other (a load
    of another iteration than the tracker's leaves none behind)."""
    with _lock:
        _by_dir.clear()
