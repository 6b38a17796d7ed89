"""Verifying a checkpoint against its integrity manifest: every rank checks its share of the
files, so the whole checkpoint is read once across the group. The check runs on threads while
megatron-core loads (:func:`start`; its parallel reads warm the page cache ahead of the loader's
single-threaded ones), and the ranks agree on the verdict once both are done (:func:`agree`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..collectives import Group
from ..manifest import MANIFEST, MARKER, ManifestError, read_manifest, unlisted, verify_files
from ..save.layout import has_metadata, parse_iteration

__all__ = ["ManifestCheck", "Pending", "agree", "check_manifest", "committed_before",
           "missing_manifest", "start", "verify_collectively", "written_by_plugin"]


@dataclass(frozen=True)
class ManifestCheck:
    """What a checkpoint's manifest allows, before any file is read: check the files against
    ``manifest``; nothing to check (a stock checkpoint: ``manifest`` None, no ``kind``); or
    nothing to trust (``kind``: ``"damaged"``, ``"missing"`` (the plugin wrote the checkpoint,
    its manifest is gone) or ``"iteration"`` (written for another), ``why`` says how)."""

    manifest: dict | None
    kind: str = ""
    why: str = ""

    @property
    def problem(self) -> str:
        """``why`` as the load reports it (naming the manifest); empty when there is none."""
        return f"{MANIFEST}: {self.why}" if self.kind == "iteration" else self.why


def check_manifest(path: Path) -> ManifestCheck:
    """Read ``path``'s manifest and judge it as a whole (the load and ``verify`` both start here):
    damaged, missing though the plugin wrote ``path``, or written for an iteration other than
    the one ``path``'s name (``iter_NNNNNNN``) gives."""
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        return ManifestCheck(None, "damaged", str(e))
    if manifest is None:
        missing = missing_manifest(path)
        return ManifestCheck(None, "missing", missing) if missing else ManifestCheck(None)
    named = parse_iteration(Path(path).name)
    if named is not None and manifest.get("iteration") != named:
        return ManifestCheck(manifest, "iteration", f"written for iteration "
                             f"{manifest.get('iteration')}, not {named}")
    return ManifestCheck(manifest)


class Pending:
    """A check of this rank's share of a checkpoint's files, running on threads.

    With ``defer`` the thread first waits: where the load's own reads plan to checksum files as
    they pass (:meth:`skip`), until :meth:`settle` has learnt which files every rank's reads
    summed, so that no file one rank summed is read again by another rank's check (at 8 ranks
    that second read was half of each rank's bytes); where they do not (:meth:`release`), it
    checks its whole share at once. Summed files are judged by :meth:`check_inline`."""

    def __init__(self, path: Path, manifest: dict | None, names: list[str], workers: int,
                 problems: list[str] | None = None, *, defer: bool = False,
                 extra: list[str] | None = None) -> None:
        self.path, self.manifest = path, manifest
        self._problems: list[str] = list(problems or [])
        self._checkable = manifest is not None and not self._problems
        self._extra = list(extra or [])  # found before the check (files it does not list)
        self._inline: list[str] = []
        self._skip: set[str] = set()
        self._planned = False  # the load's reads said what they sum: wait for settle()
        self._go = threading.Event()
        if not defer:
            self._go.set()
        self._workers = workers
        self._thread = None
        self.any_failed: bool | None = None  # whether any rank's load failed (agree's)
        if manifest is not None and not self._problems:
            self._thread = threading.Thread(target=self._run, args=(names, workers),
                                            name="mcx-verify", daemon=True)
            self._thread.start()

    @property
    def checks(self) -> bool:
        """Whether there is anything to check against (a readable manifest)."""
        return self._checkable

    def _run(self, names: list[str], workers: int) -> None:
        self._go.wait()
        try:
            found = verify_files(self.path, self.manifest,
                                 [n for n in names if n not in self._skip], workers=workers)
            self._problems = [str(p) for p in found]
        except OSError as e:  # unreadable: as bad as a mismatch
            self._problems = [f"{self.path}: {type(e).__name__}: {e}"]

    def skip(self, names: set[str]) -> None:
        """The load's reads checksum ``names`` themselves: the thread leaves them out, and waits
        for :meth:`settle` to leave out what the other ranks' reads summed too."""
        self._skip |= set(names)
        self._planned = True

    def release(self) -> None:
        """Let the thread check its share now, unless the reads planned sums (it then waits for
        :meth:`settle`, or :meth:`problems`)."""
        if not self._planned:
            self._go.set()

    def settle(self, group: Group) -> None:
        """Collective, once the load's reads are done: every rank's summed files are left out
        of every rank's share (each was judged by a rank that summed it), then the thread runs."""
        summed = group.all_gather(sorted(self._skip))
        self._skip |= {name for names in summed for name in names}
        self._go.set()

    def check_inline(self, sums: dict[str, tuple[int, int | None]], planned: set[str]) -> None:
        """Judge the files the load's reads summed (``sums``: name -> (bytes, crc32)); a file
        that was to be summed but was not (the load failed part way) is read and checked now."""
        entries = self.manifest["files"] if self.checks else {}
        missing = []
        for name in sorted(planned & set(entries)):
            if name not in sums or sums[name][1] is None:
                missing.append(name)
                continue
            size, crc = sums[name]
            want = entries[name]
            if size != want["bytes"]:
                self._inline.append(f"{name}: {size} bytes, the manifest says {want['bytes']}")
            elif crc != want["crc32"]:
                self._inline.append(f"{name}: CRC-32 {crc:08x}, the manifest says "
                                    f"{want['crc32']:08x}")
        if missing:
            try:
                found = verify_files(self.path, self.manifest, missing, workers=self._workers)
                self._inline += [str(p) for p in found]
            except OSError as e:
                self._inline.append(f"{self.path}: {type(e).__name__}: {e}")

    def problems(self) -> list[str]:
        self._go.set()
        if self._thread is not None:
            self._thread.join()
        return self._extra + self._problems + self._inline


def start(path: Path, group: Group, *, rank: int, workers: int = 8,
          defer: bool = False) -> Pending:
    """Start checking this rank's share of ``path``'s files (none without a manifest); with
    ``defer`` it waits for :meth:`Pending.skip` or :meth:`Pending.release` first."""
    check = check_manifest(path)
    if check.kind:  # every rank reads the manifest: every rank reports it
        return Pending(path, check.manifest or {"files": {}}, [], workers,
                       problems=[check.problem])
    manifest = check.manifest
    names = sorted(manifest["files"]) if manifest is not None else []
    extra = ([str(p) for p in unlisted(path, manifest)]
             if manifest is not None and group.rank(rank) == 0 else [])
    return Pending(path, manifest, names[group.rank(rank)::group.size()], workers,
                   defer=defer, extra=extra)


def agree(pending: Pending, group: Group, timings: dict | None = None, *,
          failed: bool = False) -> tuple[bool, list[str]]:
    """Collective: (whether there is a manifest, every problem any rank found); first the
    files no rank's reads summed are checked (:meth:`Pending.settle`). ``timings``, where
    given, gets this rank's seconds in each step (``settle_s``, ``check_s``, ``agree_s``).
    ``failed``: this rank's load failed; the same collective tells whether any rank's did
    (``pending.any_failed``), so the load needs no round trip of its own for it."""
    t0 = time.perf_counter()
    pending.settle(group)
    t1 = time.perf_counter()
    problems = pending.problems()
    t2 = time.perf_counter()
    most = group.all_max([float(len(problems)), float(failed)])
    pending.any_failed = most[1] > 0
    agreed = most[0] == 0
    if timings is not None:
        timings.update(settle_s=round(t1 - t0, 6), check_s=round(t2 - t1, 6),
                       agree_s=round(time.perf_counter() - t2, 6))
    if agreed:
        return pending.manifest is not None, []
    # a file two ranks judged (both read it) is one problem
    return True, sorted({p for found in group.all_gather(problems) for p in found})


def verify_collectively(path: Path, group: Group, *, rank: int,
                        workers: int = 8) -> tuple[bool, list[str]]:
    """Collective: (whether ``path`` has a manifest, every problem found on any rank). Rank
    ``r`` of ``n`` checks every n-th file of the manifest."""
    return agree(start(path, group, rank=rank, workers=workers), group)


def committed_before(root: Path, iteration: int) -> list[int]:
    """Committed iterations under ``root`` older than ``iteration``, newest first."""
    found = []
    for entry in root.iterdir() if root.is_dir() else []:
        it = parse_iteration(entry.name)
        if it is not None and it < iteration and has_metadata(entry):
            found.append(it)
    return sorted(found, reverse=True)


def written_by_plugin(path: Path) -> str | None:
    """How we know the plugin wrote the checkpoint ``path`` (the mark its commit leaves), or
    None: a stock checkpoint (or one of ours from before the mark)."""
    if (Path(path) / MARKER).is_file():
        return f"it holds {MARKER}, which the plugin writes at the commit"
    return None


def missing_manifest(path: Path) -> str | None:
    """The problem to report when the plugin wrote ``path`` but its manifest is gone, else None
    (a checkpoint with a manifest, or a stock one)."""
    if (Path(path) / MANIFEST).exists():
        return None
    evidence = written_by_plugin(path)
    if evidence is None:
        return None
    return (f"{MANIFEST}: missing, but megatron-ckpt-ext wrote this checkpoint ({evidence}): "
            "its files cannot be verified")
