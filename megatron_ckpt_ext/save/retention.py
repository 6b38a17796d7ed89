"""Retention (``--most-recent-k``, ``--save-retain-interval``): after a commit, rank 0 deletes the
committed checkpoints that fall out of the window, on a background thread.

What may go: a directory named exactly ``iter_NNNNNNN`` (not a symlink) older than the tracker's
iteration, outside the K most recent committed ones and not a multiple of the retain interval.
Never the tracker's target, never anything newer than it, never another name.

A deletion first renames ``iter_N`` to ``iter_N.deleting`` (atomic, the parent fsync'd), so a
crash halfway leaves a directory no load takes for a checkpoint (the tracker, the fallback and
every listing look for ``iter_N`` exactly); the next start or commit finishes those deletions.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from .layout import DELETING, _fsync, leftovers, parse_iteration, read_tracker, suffixed

__all__ = ["DELETING", "Retention", "finish_interrupted", "to_delete"]

logger = logging.getLogger(__name__)

# Megatron-LM rewrites the tracker in place (open "w", then write) right after our commit: a
# pass may read it empty; it reads again for up to this long before giving up on this commit
_TRACKER_SETTLE_S = 2.0


def to_delete(root: Path, *, most_recent_k: int, retain_interval: int | None) -> list[Path]:
    """The committed checkpoints under ``root`` that retention removes now (oldest first)."""
    if most_recent_k < 0 and retain_interval is None:
        return []
    latest = read_tracker(root)
    if latest is None:
        return []
    keep_last = most_recent_k if most_recent_k > 0 else 1  # the interval alone: latest + Nth
    committed = sorted(
        (it, p) for p in root.iterdir()
        if (it := parse_iteration(p.name)) is not None and p.is_dir() and not p.is_symlink()
        and it <= latest)
    recent = {it for it, _ in committed[-keep_last:]} | {latest}
    return [p for it, p in committed
            if it not in recent and not (retain_interval and it % retain_interval == 0)]


def finish_interrupted(root: Path) -> list[Path]:
    """Remove the ``iter_N.deleting`` directories a crash left; the ones removed."""
    done = []
    for path in leftovers(root, DELETING):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            done.append(path)
    return done


def _delete(path: Path) -> None:
    aside = suffixed(path, DELETING)
    os.rename(path, aside)  # from here on no load sees it as committed
    _fsync(path.parent)
    shutil.rmtree(aside)


class Retention:
    """Rank 0's deleter: :meth:`after_commit` starts a background pass; one pass at a time."""

    def __init__(self, most_recent_k: int, retain_interval: int | None) -> None:
        self.most_recent_k, self.retain_interval = most_recent_k, retain_interval
        self._thread: threading.Thread | None = None
        self.deleted: list[Path] = []
        self.errors: list[str] = []

    @property
    def active(self) -> bool:
        return self.most_recent_k > 0 or self.retain_interval is not None

    def after_commit(self, root: Path) -> None:
        """The tracker under ``root`` is durable: delete what falls out of the window, in the
        background (a pass still running from the last commit is waited for first)."""
        if not self.active:
            return
        self.wait()
        self._thread = threading.Thread(target=self._pass, args=(Path(root),),
                                        name="mcx-retention", daemon=True)
        self._thread.start()

    def _pass(self, root: Path) -> None:
        try:
            finish_interrupted(root)
            gone = self._window(root)
            for path in gone:
                _delete(path)
                self.deleted.append(path)
            if gone:
                logger.info("retention (--most-recent-k %d%s): deleted %s", self.most_recent_k,
                            f", --save-retain-interval {self.retain_interval}"
                            if self.retain_interval else "", ", ".join(p.name for p in gone))
        except OSError as e:  # a deletion that fails costs disk, not the training run
            self.errors.append(str(e))
            logger.error("retention could not delete an old checkpoint under %s: %s (it is "
                         "retried after the next commit)", root, e)
        except ValueError as e:  # the tracker did not settle: nothing is deleted this time
            self.errors.append(str(e))
            logger.warning("retention deleted nothing after this commit under %s: %s (it runs "
                           "again after the next commit)", root, e)

    def _window(self, root: Path) -> list[Path]:
        """:func:`to_delete`, read again while the tracker does not parse (being rewritten by
        Megatron-LM's own save) for up to :data:`_TRACKER_SETTLE_S`."""
        deadline = time.monotonic() + _TRACKER_SETTLE_S
        while True:
            try:
                return to_delete(root, most_recent_k=self.most_recent_k,
                                 retain_interval=self.retain_interval)
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
