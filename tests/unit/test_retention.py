"""Retention's choice of what to delete (save/retention.py) and its crash-halfway recovery."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_ckpt_ext.save import retention
from megatron_ckpt_ext.save.layout import TRACKER


def _tree(root: Path, iterations, tracker: int) -> None:
    for it in iterations:
        (root / f"iter_{it:07d}").mkdir(parents=True)
        (root / f"iter_{it:07d}" / "metadata.json").write_text("{}")
    (root / TRACKER).write_text(f"{tracker}\n")


def _names(paths) -> list[int]:
    return [int(p.name[5:12]) for p in paths]


@pytest.mark.parametrize("k,interval,gone", [
    (-1, None, []),                      # keep all (the default)
    (2, None, [1, 2, 3, 4]),             # the 2 most recent: 5, 6
    (1, None, [1, 2, 3, 4, 5]),
    (2, 3, [1, 2, 4]),                   # + every 3rd: 3 and 6 stay
    (-1, 2, [1, 3, 5]),                  # the interval alone: the latest + every 2nd
    (10, None, []),
])
def test_the_window(tmp_path, k, interval, gone):
    _tree(tmp_path, range(1, 7), tracker=6)
    assert _names(retention.to_delete(tmp_path, most_recent_k=k, retain_interval=interval)) == gone


def test_never_the_tracker_target_a_newer_directory_a_symlink_or_another_name(tmp_path):
    _tree(tmp_path, [1, 2, 3, 4, 8], tracker=4)  # 8: a save being committed right now
    (tmp_path / "iter_0000000").symlink_to(tmp_path / "iter_0000001")
    (tmp_path / "iter_0000009.incomplete").mkdir()
    (tmp_path / "iter_00000010").mkdir()  # not the 7-digit name
    (tmp_path / "notes").mkdir()
    gone = retention.to_delete(tmp_path, most_recent_k=1, retain_interval=None)
    assert _names(gone) == [1, 2, 3]
    (tmp_path / TRACKER).unlink()  # no tracker: nothing is known committed, nothing goes
    assert retention.to_delete(tmp_path, most_recent_k=1, retain_interval=None) == []


def test_a_pass_deletes_in_the_background_and_a_crash_halfway_is_finished_later(tmp_path,
                                                                               monkeypatch):
    _tree(tmp_path, range(1, 6), tracker=5)
    crashed = []

    def crash_in_rmtree(path, *a, **kw):  # the process dies after the rename, before the rmtree
        crashed.append(Path(path).name)
        raise OSError("killed")

    monkeypatch.setattr(retention.shutil, "rmtree", crash_in_rmtree)
    r = retention.Retention(2, None)
    r.after_commit(tmp_path)
    r.wait()
    assert crashed == ["iter_0000001.deleting"] and r.errors
    left = sorted(p.name for p in tmp_path.iterdir())
    # what a load would see: iter_1 is no longer a checkpoint, 2..5 are untouched
    assert "iter_0000001" not in left and "iter_0000001.deleting" in left
    monkeypatch.undo()
    assert _names(retention.finish_interrupted(tmp_path)) == [1]
    r.after_commit(tmp_path)
    r.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000004", "iter_0000005", TRACKER]
    assert _names(r.deleted) == [2, 3]


def test_load_never_takes_a_half_deleted_checkpoint(tmp_path):
    """A crash between the rename and the rmtree: the fallback's list of committed checkpoints
    does not include it."""
    from megatron_ckpt_ext.load.verify import committed_before

    _tree(tmp_path, [1, 2, 3], tracker=3)
    os.rename(tmp_path / "iter_0000002", tmp_path / "iter_0000002.deleting")
    assert committed_before(tmp_path, 3) == [1]


def test_a_pass_reads_a_tracker_being_rewritten_again_and_never_dies(tmp_path, monkeypatch):
    """Megatron-LM rewrites the tracker in place right after our commit: the pass that reads it
    empty reads it again and deletes as usual; one that never parses deletes nothing, says so
    and leaves the next commit's pass to run (the thread does not die with a traceback)."""
    import threading

    _tree(tmp_path, range(1, 6), tracker=5)
    (tmp_path / TRACKER).write_text("")  # truncated, the number not written yet
    threading.Timer(0.2, lambda: (tmp_path / TRACKER).write_text("5\n")).start()
    died = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    r = retention.Retention(2, None)
    r.after_commit(tmp_path)
    r.wait()
    assert _names(r.deleted) == [1, 2, 3] and r.errors == [] and died == []
    (tmp_path / TRACKER).write_text("garbage")
    monkeypatch.setattr(retention, "_TRACKER_SETTLE_S", 0.1)
    r.after_commit(tmp_path)
    r.wait()
    assert died == [] and "not an iteration number" in r.errors[-1]
    assert _names(r.deleted) == [1, 2, 3]  # nothing more


@pytest.mark.parametrize("all_of_them", [True, False])
def test_a_killed_jobs_unfinished_saves_are_removed_at_the_take_over(tmp_path, all_of_them):
    """``layout.remove_torn_saves`` (run where a killed job's lock is taken over): its unfinished
    saves go (renamed aside, then removed in the background), as does a removal it was doing.
    Where its host was another (locks may be node-local: it may still be writing), only the
    unfinished saves older than the tracker's iteration go, which no writer can finish."""
    import time

    from megatron_ckpt_ext.save.layout import remove_torn_saves

    (tmp_path / TRACKER).write_text("40")
    (tmp_path / f".{TRACKER}.tmp4242").write_text("4")  # a commit cut short in the tracker write
    names = ["iter_0000037.incomplete", "iter_0000045.incomplete",
             "iter_0000030.incomplete.deleting", "iter_0000040"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x" * 4096)
    removed = remove_torn_saves(tmp_path, all_of_them=all_of_them)
    assert removed == (["iter_0000037.incomplete", "iter_0000045.incomplete"] if all_of_them
                       else ["iter_0000037.incomplete"])
    left = {"iter_0000040", TRACKER} | (set() if all_of_them else
                                        {*names[1:3], f".{TRACKER}.tmp4242"})
    deadline = time.monotonic() + 30
    while {p.name for p in tmp_path.iterdir()} != left and time.monotonic() < deadline:
        time.sleep(0.02)
    assert {p.name for p in tmp_path.iterdir()} == left
