"""Checks before the first save: enough /dev/shm for staging, enough disk for a checkpoint.

A shared-memory shortfall otherwise surfaces as SIGBUS in the middle of a save (tmpfs pages are
only claimed on first touch), so it fails early, naming the needed and available bytes and the fix.
The free-space probes are injectable so tests can simulate a small /dev/shm or a full disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

from ._runtime import warn_once
from .errors import CkptOptionsError, InsufficientSharedMemory

__all__ = ["DiskUsage", "check_disk", "check_shm", "check_writable", "local_ranks"]


class DiskUsage(NamedTuple):
    total: int
    used: int
    free: int


Probe = Callable[[str], DiskUsage]


def local_ranks() -> int:
    """Ranks sharing this node's /dev/shm (torchrun's LOCAL_WORLD_SIZE; 1 when unknown)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def check_writable(checkpoint_dir: str | os.PathLike[str], *, flag: str = "--save") -> None:
    """Create ``checkpoint_dir`` (with parents) and a probe file in it, so an unwritable save
    directory fails at start-up, naming it, instead of at the first save hours later."""
    root = Path(checkpoint_dir)
    probe = root / f".mcx-write-probe.{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CkptOptionsError(
            f"{flag} {root}: the checkpoint directory is not writable ({type(e).__name__}: "
            f"{e.strerror or e}). Fix: point {flag} at a directory this job can create files "
            "in.") from e


def check_shm(bytes_per_rank: int, ranks_on_node: int | None = None, *, path: str = "/dev/shm",
              probe: Probe | None = None) -> None:
    """Raise :class:`InsufficientSharedMemory` when ``path`` cannot hold every local rank's
    staging buffers.

    ``ranks_on_node`` defaults to :func:`local_ranks`."""
    ranks = ranks_on_node or local_ranks()
    needed = bytes_per_rank * ranks
    free = (probe or shutil.disk_usage)(path).free
    if needed > free:
        raise InsufficientSharedMemory(
            f"--async-ckpt-use-cpu-shm needs {_size(needed)} of shared memory in {path} "
            f"({_size(bytes_per_rank)} per rank x {ranks} ranks on this node) but only "
            f"{_size(free)} is free. Fix: enlarge {path} (containers: docker run --shm-size=..., "
            "Kubernetes: an emptyDir with medium: Memory), or drop --async-ckpt-use-cpu-shm.")


def check_disk(checkpoint_dir: str | os.PathLike[str], last_checkpoint_bytes: int, *,
               probe: Probe | None = None) -> bool:
    """Warn (rank 0, once per directory) when the checkpoint directory has less free space than
    the last checkpoint took. Returns True when there is enough."""
    free = _free_bytes(checkpoint_dir, probe)[1]
    if free >= last_checkpoint_bytes:
        return True
    warn_once(f"disk:{checkpoint_dir}",
              f"{checkpoint_dir}: {_size(free)} free, but the last checkpoint took "
              f"{_size(last_checkpoint_bytes)}; the next save will likely fail. Free "
              "space there, or point --save at a larger file system.")
    return False


def disk_full_hint(checkpoint_dir: str | os.PathLike[str], needed: int, *,
                   probe: Probe | None = None) -> str:
    """For a failed save's error: a sentence when the checkpoint directory's file system has less
    free space than a checkpoint there takes (a full disk shows up in torch's writer only as e.g.
    ``unexpected pos 704 vs 598``), else ''."""
    try:
        where, free = _free_bytes(checkpoint_dir, probe)
    except OSError:
        return ""
    if needed <= 0 or free >= needed:
        return ""
    return (f" {where} has {_size(free)} free and a checkpoint here takes about {_size(needed)}:"
            " the disk is likely full. Fix: free space there, or point --save at a larger file "
            "system.")


def _free_bytes(checkpoint_dir: str | os.PathLike[str], probe: Probe | None) -> tuple[Path, int]:
    """The nearest existing directory at or above ``checkpoint_dir``, and its free bytes."""
    where = Path(checkpoint_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    return where, (probe or shutil.disk_usage)(str(where)).free


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"
