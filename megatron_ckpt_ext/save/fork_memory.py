"""The trainer's CPU tensors kept out of the persistent writer's fork.

A forked writer shares the trainer's pages copy-on-write. Every page the trainer writes after
the fork is copied, and the writer keeps the old one: a CPU tensor the trainer updates in place
(a model trained on the CPU, an optimizer state offloaded to the host, a CPU buffer) ends up held
twice, once by the trainer and once, stale, by a writer that never reads it (with
``--async-ckpt-use-cpu-shm`` the writer takes every byte it writes from the staging segments, by
name). Figures: docs/notes/save_path.md.

So, only for that fork, the pages inside the storages of the live CPU tensors of 1 MiB and more
are marked ``MADV_DONTFORK``: the writer's address space has no pages there. The first and last
(partial) page of each storage stay, so the allocator's own bookkeeping around the block is
inherited as before. Right after the fork the marks are taken off (``MADV_DOFORK``), so every
later fork (a data loader's workers) inherits those tensors as usual. Shared-memory and pinned
storages are left alone. ``MCX_FORK_SKIPS_TENSORS=0`` turns this off.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import sys
import time
from typing import Iterator

from .._runtime import madvise
from ..debug import env_switch

__all__ = ["kept_from_fork", "tensor_regions"]

logger = logging.getLogger(__name__)

MIN_BYTES = 1 << 20
_MADV_DONTFORK, _MADV_DOFORK = 10, 11  # linux/mman.h


def _private_anonymous() -> list[tuple[int, int]]:
    """This process's private anonymous writable mappings (start, end), from /proc/self/maps."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            if parts[1] == "rw-p" and (len(parts) < 6 or parts[5] == "[heap]"):
                lo, hi = parts[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def tensor_regions(min_bytes: int = MIN_BYTES) -> list[tuple[int, int]]:
    """(start, length) of the whole pages inside the storage of every live plain CPU tensor
    (not shared, not pinned, in private anonymous memory) of ``min_bytes`` or more, one per
    storage."""
    import bisect

    import torch

    page = mmap.PAGESIZE
    anonymous = _private_anonymous()
    starts = [lo for lo, _ in anonymous]
    regions: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # (no __class__ lookups: no warnings)
            continue
        try:
            if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes < min_bytes or storage.is_shared() or storage.is_pinned():
                continue
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses, fakes
            continue
        start = -(-ptr // page) * page
        end = (ptr + nbytes) // page * page
        at = bisect.bisect_right(starts, start) - 1
        if end > start and at >= 0 and anonymous[at][1] >= end:  # inside one such mapping
            regions[start] = max(regions.get(start, 0), end - start)
    return sorted(regions.items())


@contextlib.contextmanager
def kept_from_fork(enabled: bool = True) -> Iterator[dict]:
    """While inside (around the writer's fork), the live CPU tensors' pages are not inherited by
    a forked child. Yields ``{"regions", "bytes", "mark_s"}`` (filled in on entry)."""
    info = {"regions": 0, "bytes": 0, "mark_s": 0.0}
    if not enabled or not sys.platform.startswith("linux") or \
            env_switch("MCX_FORK_SKIPS_TENSORS") == "0" or "torch" not in sys.modules:
        yield info
        return
    t0 = time.perf_counter()
    marked = [(s, n) for s, n in tensor_regions() if madvise(s, n, _MADV_DONTFORK)]
    info.update(regions=len(marked), bytes=sum(n for _, n in marked),
                mark_s=round(time.perf_counter() - t0, 6))
    if marked:
        logger.debug("%d CPU tensor regions (%d bytes) kept out of the writer's fork",
                     len(marked), info["bytes"])
    try:
        yield info
    finally:
        for start, length in marked:
            madvise(start, length, _MADV_DOFORK)
