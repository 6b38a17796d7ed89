"""Verifying a checkpoint against its integrity manifest before it is loaded: every rank checks
its share of the files (collective), so the whole checkpoint is read once across the group."""

from __future__ import annotations

import re
from pathlib import Path

from ..collectives import Group
from ..manifest import read_manifest, verify_files

__all__ = ["committed_before", "verify_collectively"]

_ITER = re.compile(r"iter_(\d{7})")


def verify_collectively(path: Path, group: Group, *, rank: int,
                        workers: int = 8) -> tuple[bool, list[str]]:
    """Collective: (whether ``path`` has a manifest, every problem found on any rank). Rank
    ``r`` of ``n`` checks every n-th file of the manifest."""
    manifest = read_manifest(path)
    if manifest is None:
        return False, []
    names = sorted(manifest["files"])
    index, size = group.rank(rank), group.size()
    problems = [str(p) for p in verify_files(path, manifest, names[index::size], workers=workers)]
    if group.all_max([float(len(problems))])[0] == 0:
        return True, []
    return True, sorted(p for found in group.all_gather(problems) for p in found)


def committed_before(root: Path, iteration: int) -> list[int]:
    """Committed iterations under ``root`` older than ``iteration``, newest first."""
    found = []
    for entry in root.iterdir() if root.is_dir() else []:
        match = _ITER.fullmatch(entry.name)
        if match and int(match.group(1)) < iteration and (entry / "metadata.json").exists():
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)
