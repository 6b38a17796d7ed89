"""Verifying a checkpoint against its integrity manifest: every rank checks its share of the
files, so the whole checkpoint is read once across the group. The check runs on threads while
megatron-core loads (:func:`start`; its parallel reads warm the page cache ahead of the loader's
single-threaded ones), and the ranks agree on the verdict once both are done (:func:`agree`)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from ..collectives import Group
from ..manifest import MANIFEST, ManifestError, read_manifest, verify_files

__all__ = ["Pending", "agree", "committed_before", "start", "verify_collectively"]

_ITER = re.compile(r"iter_(\d{7})")


class Pending:
    """A check of this rank's share of a checkpoint's files, running on threads."""

    def __init__(self, path: Path, manifest: dict | None, names: list[str], workers: int,
                 problems: list[str] | None = None) -> None:
        self.path, self.manifest = path, manifest
        self._problems: list[str] = list(problems or [])
        self._thread = None
        if manifest is not None and not self._problems:
            self._thread = threading.Thread(target=self._run, args=(names, workers),
                                            name="mcx-verify", daemon=True)
            self._thread.start()

    def _run(self, names: list[str], workers: int) -> None:
        try:
            found = verify_files(self.path, self.manifest, names, workers=workers)
            self._problems = [str(p) for p in found]
        except OSError as e:  # unreadable: as bad as a mismatch
            self._problems = [f"{self.path}: {type(e).__name__}: {e}"]

    def problems(self) -> list[str]:
        if self._thread is not None:
            self._thread.join()
        return self._problems


def start(path: Path, group: Group, *, rank: int, workers: int = 8) -> Pending:
    """Start checking this rank's share of ``path``'s files (none without a manifest)."""
    try:
        manifest = read_manifest(path)
    except ManifestError as e:  # every rank reads it: every rank reports it
        return Pending(path, {"files": {}}, [], workers, problems=[str(e)])
    names = sorted(manifest["files"]) if manifest is not None else []
    match = _ITER.fullmatch(Path(path).name)
    if manifest is not None and match and manifest.get("iteration") != int(match.group(1)):
        return Pending(path, manifest, [], workers, problems=[
            f"{MANIFEST}: written for iteration {manifest.get('iteration')}, not "
            f"{int(match.group(1))}"])
    return Pending(path, manifest, names[group.rank(rank)::group.size()], workers)


def agree(pending: Pending, group: Group) -> tuple[bool, list[str]]:
    """Collective: (whether there is a manifest, every problem any rank found)."""
    problems = pending.problems()
    if group.all_max([float(len(problems))])[0] == 0:
        return pending.manifest is not None, []
    return True, sorted(p for found in group.all_gather(problems) for p in found)


def verify_collectively(path: Path, group: Group, *, rank: int,
                        workers: int = 8) -> tuple[bool, list[str]]:
    """Collective: (whether ``path`` has a manifest, every problem found on any rank). Rank
    ``r`` of ``n`` checks every n-th file of the manifest."""
    return agree(start(path, group, rank=rank, workers=workers), group)


def committed_before(root: Path, iteration: int) -> list[int]:
    """Committed iterations under ``root`` older than ``iteration``, newest first."""
    found = []
    for entry in root.iterdir() if root.is_dir() else []:
        match = _ITER.fullmatch(entry.name)
        if match and int(match.group(1)) < iteration and (entry / "metadata.json").exists():
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)
