"""Page-cache residency of a file (mincore of a read-only mapping), for the tests of the writer's
page-cache drop (``save.write_path.page_cache_free``)."""

from __future__ import annotations

import ctypes
import mmap
import os

_PAGE = mmap.PAGESIZE


def resident_pages(path: str) -> int:
    """How many of ``path``'s pages are in the page cache now."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def fs_type(path: str) -> str:
    """The file-system type of the mount holding ``path`` (longest mount-point prefix)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            mnt = parts[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def can_drop_pages(path: str) -> bool:
    """Whether clean pages of files under ``path`` can be dropped (not tmpfs/ramfs memory)."""
    return fs_type(path) not in ("tmpfs", "ramfs", "")
