"""The on-disk layout (Megatron's): ``<root>/iter_{iteration:07d}/`` per checkpoint, written
under ``iter_XXXXXXX.incomplete`` until rank 0 commits it, and the tracker
``<root>/latest_checkpointed_iteration.txt`` naming the newest committed one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .._runtime import warn_once

__all__ = ["INCOMPLETE", "REPORT", "TRACKER", "checkpoint_name", "commit_on_disk",
           "incomplete_name", "read_tracker", "tracker_text", "warn_incomplete"]

TRACKER = "latest_checkpointed_iteration.txt"
INCOMPLETE = ".incomplete"
REPORT = "ckpt_report.jsonl"


def checkpoint_name(root: str | os.PathLike[str], iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_tracker(root: str | os.PathLike[str]) -> int | None:
    """The newest committed iteration under ``root``, or None when there is no tracker file.
    A tracker that does not hold one ASCII decimal number is an error naming the file."""
    path = Path(root) / TRACKER
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    text = raw.strip()
    if not (0 < len(text) <= 12 and all(48 <= c <= 57 for c in text)):
        shown = raw[:40].decode("ascii", "backslashreplace")
        raise ValueError(
            f"{path} holds {shown!r}{'...' if len(raw) > 40 else ''}, not an iteration number "
            f"(ASCII digits). The tracker is damaged: write the iteration to load into it (e.g. "
            f"'echo N > {path}' for an existing {root}/iter_{{N:07d}}) or pass load(iteration=N).")
    return int(text)


def incomplete_name(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}{INCOMPLETE}"


def tracker_text(root: Path) -> str:
    """What a failed save's message says about the checkpoint that is still the latest."""
    try:
        latest = read_tracker(root)
    except (OSError, ValueError):
        return ""
    if latest is None:
        return f" (no committed checkpoint under {root} yet)"
    return f"; the latest committed checkpoint is still iteration {latest} ({root / TRACKER})"


def commit_on_disk(root: Path, iteration: int) -> None:
    """Rank 0's part of the commit, in the order that keeps the previous checkpoint loadable
    after a crash at any point: fsync every file of ``iter_N.incomplete`` and the directory,
    rename it to ``iter_N``, fsync ``root``, then rewrite the tracker (temporary file, fsync,
    rename) and fsync ``root`` again. The tracker never names a directory that is not durable."""
    src, dst = incomplete_name(root, iteration), checkpoint_name(root, iteration)
    for path in sorted(src.rglob("*")):  # megatron-core writes metadata and common.pt unsynced
        if path.is_file():
            _fsync(path)
    _fsync(src)
    _replace_dir(src, dst)
    _atomic_write(root / TRACKER, f"{iteration}\n")
    old = _aside(dst)
    if old.exists():  # a re-save of a committed iteration: its old copy goes once replaced
        shutil.rmtree(old)


def _aside(dst: Path) -> Path:
    return dst.with_name(dst.name + ".old")


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` (an existing ``dst`` moves aside to :func:`_aside`) and fsync
    their parent."""
    old = _aside(dst)
    if dst.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync(dst.parent)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    """fsync a file or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def warn_incomplete(root: Path) -> None:
    """Once per root, on rank 0: name the uncommitted directories load skips."""
    if not root.is_dir():
        return
    leftovers = sorted(p.name for p in root.glob(f"iter_*{INCOMPLETE}"))
    if leftovers:
        warn_once(f"incomplete:{root}",
                  f"{root}: ignoring uncommitted checkpoint directories {leftovers} "
                  "(a save was interrupted before its commit)")
