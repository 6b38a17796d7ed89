"""A job suspended the way SLURM's cgroup plugin and container runtimes (``docker pause``) do it:
its processes moved into a cgroup that is then frozen, every thread stopped in the kernel with no
signal sent, and thawed later. cgroup v1's freezer where it is mounted, else cgroup v2's
``cgroup.freeze``; tests that need it skip where neither is writable (not root, no cgroup
file system)."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

__all__ = ["frozen", "unavailable"]

V1 = "/sys/fs/cgroup/freezer"


def _v2_root() -> str | None:
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return fields[1]
    return None


def _root() -> tuple[str, int] | None:
    if os.path.isfile(os.path.join(V1, "cgroup.procs")):
        return V1, 1
    v2 = _v2_root()
    return (v2, 2) if v2 else None


def unavailable() -> str | None:
    """Why no cgroup can be frozen here (None: one can)."""
    root = _root()
    if root is None:
        return "no cgroup freezer mounted (cgroup v1 freezer or cgroup v2)"
    if not os.access(root[0], os.W_OK):
        return f"{root[0]} is not writable (freezing a job's cgroup needs root)"
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _set_frozen(group: str, version: int, on: bool) -> None:
    if version == 1:
        _write(os.path.join(group, "freezer.state"), "FROZEN" if on else "THAWED")
    else:
        _write(os.path.join(group, "cgroup.freeze"), "1" if on else "0")


def _is_frozen(group: str, version: int) -> bool:
    if version == 1:
        return _read(os.path.join(group, "freezer.state")).strip() == "FROZEN"
    return "frozen 1" in _read(os.path.join(group, "cgroup.events"))


@contextlib.contextmanager
def frozen(pids: list[int], *, settle_s: float = 10.0) -> Iterator[int]:
    """Move ``pids`` (those still alive) into a new cgroup and freeze it; yields how many were
    moved. On exit: thaw, move every process still in it (their children forked meanwhile
    too) back to the root cgroup, remove it."""
    root, version = _root()  # type: ignore[misc]
    group = os.path.join(root, f"mcx_test_{os.getpid()}_{time.monotonic_ns()}")
    os.mkdir(group)
    try:
        moved = 0
        for pid in pids:
            try:
                _write(os.path.join(group, "cgroup.procs"), str(pid))
                moved += 1
            except (ProcessLookupError, OSError):
                pass  # exited meanwhile
        _set_frozen(group, version, True)
        deadline = time.monotonic() + settle_s
        while not _is_frozen(group, version) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            yield moved
        finally:
            _set_frozen(group, version, False)
    finally:
        for pid in _read(os.path.join(group, "cgroup.procs")).split():
            with contextlib.suppress(OSError):
                _write(os.path.join(root, "cgroup.procs"), pid)
        deadline = time.monotonic() + settle_s
        while True:
            try:
                os.rmdir(group)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
