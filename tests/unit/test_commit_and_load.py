"""The on-disk commit order, the load path's errors on odd directories, and the knobs the
Checkpointer itself reads (--logging-level, --distributed-timeout-minutes, the save directory)."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.collectives import Group
from megatron_ckpt_ext.save import layout
from megatron_ckpt_ext.save.layout import TRACKER, read_tracker
from megatron_ckpt_ext.save.report import SaveRecord
from megatron_ckpt_ext.errors import CheckpointWriteError, CkptOptionsError
from tests._support.dist import FakeWork


# -- commit order ---------------------------------------------------------------------------------
def _record_disk_ops(monkeypatch, root: Path) -> list[tuple[str, str]]:
    """Every fsync / rename / file write the commit makes, as (op, path relative to root)."""
    events: list[tuple[str, str]] = []
    names: dict[int, str] = {}
    rel = lambda p: os.path.relpath(os.fspath(p), root)  # noqa: E731
    real_open, real_fsync = os.open, os.fsync
    real_rename, real_replace = os.rename, os.replace
    import builtins

    real_builtin_open = builtins.open

    def fake_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        names[fd] = rel(path)
        return fd

    class Tracked:
        def __init__(self, fh, path):
            self._fh, self._path = fh, rel(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._fh.__exit__(*exc)

        def fileno(self):
            fd = self._fh.fileno()
            names[fd] = self._path
            return fd

        def write(self, text):
            events.append(("write", self._path))
            return self._fh.write(text)

        def __getattr__(self, name):
            return getattr(self._fh, name)

    def fake_builtin_open(path, mode="r", *a, **k):
        fh = real_builtin_open(path, mode, *a, **k)
        return Tracked(fh, path) if "w" in mode else fh

    def fake_fsync(fd):
        events.append(("fsync", names.get(fd, "?")))
        return real_fsync(fd)

    def fake_rename(src, dst):
        events.append(("rename", f"{rel(src)}->{rel(dst)}"))
        return real_rename(src, dst)

    def fake_replace(src, dst):
        events.append(("rename", f"{rel(src)}->{rel(dst)}"))
        return real_replace(src, dst)

    monkeypatch.setattr(layout.os, "open", fake_open)
    monkeypatch.setattr(layout.os, "fsync", fake_fsync)
    monkeypatch.setattr(layout.os, "rename", fake_rename)
    monkeypatch.setattr(layout.os, "replace", fake_replace)
    monkeypatch.setattr(layout, "open", fake_builtin_open, raising=False)
    return events


def _incomplete_checkpoint(root: Path, iteration: int) -> None:
    work = root / f"iter_{iteration:07d}.incomplete"
    work.mkdir(parents=True)
    for name in ("__0_0.distcp", "common.pt", "metadata.json"):
        (work / name).write_bytes(b"x")


def test_commit_order_fsyncs_files_then_renames_then_writes_the_tracker(tmp_path, monkeypatch):
    """The integrity manifest inside the directory, then fsync every file and the directory,
    rename, fsync the root, tracker through a fsync'd temporary file and a rename, fsync the
    root: a crash at any point keeps the old latest, and the manifest commits with the files."""
    _incomplete_checkpoint(tmp_path, 5)
    events = _record_disk_ops(monkeypatch, tmp_path)
    layout.commit_on_disk(tmp_path, 5)

    work, final = "iter_0000005.incomplete", "iter_0000005"
    assert events[0] == ("rename", f"{work}/.mcx_manifest.json.tmp->{work}/mcx_manifest.json")
    files = {("fsync", f"{work}/{n}") for n in ("__0_0.distcp", "common.pt", "metadata.json",
                                                "mcx_manifest.json", ".mcx_checkpoint")}
    assert set(events[1:6]) == files, events
    tmp = next(path for op, path in events if op == "write")
    assert tmp.startswith(f".{TRACKER}.tmp"), events
    assert events[6:] == [
        ("fsync", work),
        ("rename", f"{work}->{final}"),
        ("fsync", "."),
        ("write", tmp),
        ("fsync", tmp),
        ("rename", f"{tmp}->{TRACKER}"),
        ("fsync", "."),
    ], events
    assert read_tracker(tmp_path) == 5 and (tmp_path / final / "common.pt").exists()


def test_recommit_of_an_iteration_keeps_the_tracker_valid(tmp_path):
    _incomplete_checkpoint(tmp_path, 5)
    layout.commit_on_disk(tmp_path, 5)
    _incomplete_checkpoint(tmp_path, 5)
    (tmp_path / "iter_0000005.incomplete" / "new").write_bytes(b"y")
    layout.commit_on_disk(tmp_path, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", TRACKER]
    assert (tmp_path / "iter_0000005" / "new").exists()
    assert "new" in json.loads((tmp_path / "iter_0000005" / "mcx_manifest.json").read_text())["files"]


def test_a_recommit_after_one_cut_short_before_its_cleanup_replaces_the_leftover(tmp_path):
    """A re-save of iteration 5 killed between its rename and the removal of the copy it moved
    aside leaves iter_0000005 and iter_0000005.old: the next re-save of 5 still commits (the
    leftover is removed first, not renamed onto) and leaves neither copy behind."""
    _incomplete_checkpoint(tmp_path, 5)
    layout.commit_on_disk(tmp_path, 5)
    leftover = tmp_path / "iter_0000005.old"
    leftover.mkdir()
    (leftover / "stale").write_bytes(b"x")
    _incomplete_checkpoint(tmp_path, 5)
    (tmp_path / "iter_0000005.incomplete" / "new").write_bytes(b"y")
    layout.commit_on_disk(tmp_path, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", TRACKER]
    assert (tmp_path / "iter_0000005" / "new").exists()


# -- load on odd directories ------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"\x00\x01\xff\xfe", "\u0661\u0662".encode(), "\u00b2".encode(),
                                     b"", b"12a", b"-3", b"release"])
def test_a_damaged_tracker_is_an_error_naming_the_file(tmp_path, content):
    (tmp_path / TRACKER).write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_tracker(tmp_path)
    assert str(tmp_path / TRACKER) in str(e.value) and "load(iteration=N)" in str(e.value)


def test_tracker_with_newline_and_spaces_reads(tmp_path):
    (tmp_path / TRACKER).write_bytes(b" 42\n")
    assert read_tracker(tmp_path) == 42


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_load_from_a_directory_without_checkpoint_starts_from_scratch(tmp_path, make, caplog):
    root = tmp_path / "ckpt"
    if make == "empty":
        root.mkdir()
    with Checkpointer(CkptOptions()) as ck, caplog.at_level(logging.WARNING):
        assert ck.load({}, root) is None
    assert "starting from scratch" in caplog.text and str(root) in caplog.text


def test_exit_on_missing_checkpoint_makes_it_an_error(tmp_path):
    with Checkpointer(CkptOptions(exit_on_missing_checkpoint=True)) as ck:
        with pytest.raises(FileNotFoundError, match="--exit-on-missing-checkpoint"):
            ck.load({}, tmp_path / "nothing")


def test_missing_common_pt_is_named(tmp_path):
    it = tmp_path / "iter_0000003"
    it.mkdir()
    (it / "metadata.json").write_text("{}")
    (tmp_path / TRACKER).write_text("3\n")
    with Checkpointer(CkptOptions()) as ck:
        with pytest.raises(FileNotFoundError) as e:
            ck.load({}, tmp_path)
    assert "common.pt" in str(e.value) and str(it) in str(e.value)
    assert "Fix: restore the file" in str(e.value), str(e.value)  # and how to load another


@pytest.mark.parametrize("key", ["common_state", "model.weight"])
def test_common_state_inside_the_torch_dist_files_counts(tmp_path, key):
    """megatron-core 0.19 writes no common.pt: its common state is a 'common_state' entry of the
    torch_dist files. Such a checkpoint is whole; one with neither is not."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_ckpt_ext import backend

    dcp.save({key: torch.zeros(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert backend.common_state_present(tmp_path) is (key == "common_state")
    (tmp_path / "common.pt").write_bytes(b"")
    assert backend.common_state_present(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "pickle-header", "cut"])
def test_a_damaged_torch_dist_metadata_is_left_to_the_load_to_name(tmp_path, damage):
    """On megatron-core 0.19 the common-state check unpickles .metadata before the load: damaged
    bytes raise anything there (ModuleNotFoundError, TypeError, ...). The check says 'cannot
    tell' (None) and locate lets the load go on, whose integrity check names the file."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_ckpt_ext import backend
    from megatron_ckpt_ext.load.locate import locate

    dcp.save({"common_state": torch.zeros(2)}, checkpoint_id=str(tmp_path / "iter_0000001"),
             no_dist=True)
    raw = (tmp_path / "iter_0000001" / ".metadata").read_bytes()
    damaged = {"garbage": b"garbage" + raw[7:], "pickle-header": b"\x80\x04\x95\x10" + raw[20:],
               "cut": raw[:len(raw) // 2]}[damage]
    (tmp_path / "iter_0000001" / ".metadata").write_bytes(damaged)
    (tmp_path / "iter_0000001" / "metadata.json").write_text("{}")
    assert backend.common_state_present(tmp_path / "iter_0000001") is None
    assert locate(tmp_path, iteration=1) == tmp_path / "iter_0000001"
    (tmp_path / "iter_0000001" / ".metadata").unlink()
    assert backend.common_state_present(tmp_path / "iter_0000001") is False


# -- knobs the Checkpointer reads --------------------------------------------------------------------
def test_logging_level_sets_the_plugin_and_megatron_loggers():
    names = ("megatron_ckpt_ext", "megatron")
    before = {n: logging.getLogger(n).level for n in names}
    try:
        with Checkpointer(CkptOptions(logging_level=logging.DEBUG)):
            assert all(logging.getLogger(n).level == logging.DEBUG for n in names)
        with Checkpointer(CkptOptions()):  # unset: left as the host configured it
            assert all(logging.getLogger(n).level == logging.DEBUG for n in names)
    finally:
        for n, level in before.items():
            logging.getLogger(n).setLevel(level)


def test_plugin_collectives_wait_at_most_distributed_timeout_minutes(monkeypatch):
    """The bound is running time (``_clock``): a wait is re-armed in slices while the peer has
    not come, until the bound has run; slices the process spent stopped do not count; an
    operation the backend itself ended (its own timeout, a peer gone) raises at once."""
    from megatron_ckpt_ext import collectives

    group = Group(None, CkptOptions(distributed_timeout_minutes=3))
    work = FakeWork()
    group.wait(work)
    assert work.timeouts == [timedelta(seconds=collectives._SLICE_S)]
    with pytest.raises(CheckpointWriteError, match="--distributed-timeout-minutes 3"):
        group.wait(FakeWork(fail=True))

    class Pending(FakeWork):  # the peer never comes: each slice runs out, the work pending
        def wait(self, timeout=None):
            self.timeouts.append(timeout)
            clock[0] += 0.0 if len(self.timeouts) in stopped else timeout.total_seconds()
            raise RuntimeError("Operation timed out!")

        def is_completed(self) -> bool:
            return False

    for stopped in (set(), {2, 3, 4}):  # slices 2-4 the job stood still (the clock left them)
        clock = [0.0]
        monkeypatch.setattr(collectives._clock, "running", lambda: clock[0])
        pending = Pending()
        with pytest.raises(CheckpointWriteError, match="--distributed-timeout-minutes 3"):
            group.wait(pending)
        assert len(pending.timeouts) == 180 / collectives._SLICE_S + len(stopped)
        assert clock[0] == 180.0

    class CameRightAfter(FakeWork):  # the slice ran out, the peer came before the check
        def wait(self, timeout=None):
            self.timeouts.append(timeout)
            if len(self.timeouts) == 1:
                raise RuntimeError("Operation timed out!")
            return True

    came = CameRightAfter()
    group.wait(came)  # its own outcome, not a timeout
    assert len(came.timeouts) == 2
    work = FakeWork()
    Group(None, CkptOptions(distributed_timeout_minutes=None)).wait(work)
    assert work.timeouts == [None]  # the process group's own timeout


def test_an_unwritable_save_directory_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CkptOptionsError) as e:
        Checkpointer(CkptOptions(), save_dir=blocker / "ckpt")
    assert "--save" in str(e.value) and str(blocker / "ckpt") in str(e.value)
    with Checkpointer(CkptOptions(), save_dir=tmp_path / "new" / "ckpt"):
        assert (tmp_path / "new" / "ckpt").is_dir()
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []  # the probe file is gone


def test_a_save_that_replaces_a_committed_iteration_says_so(tmp_path, caplog):
    """A run restarted from scratch into a --save that holds committed checkpoints replaces
    them: rank 0 warns, naming the iteration (the replacement itself is atomic)."""
    import time

    _incomplete_checkpoint(tmp_path, 2)
    layout.commit_on_disk(tmp_path, 2)
    group = Group(None, CkptOptions())
    with caplog.at_level(logging.WARNING):
        for it in (3, 2):
            record = SaveRecord(iteration=it, root=tmp_path, started=time.perf_counter())
            layout.open_workdir(record, group, new_structure=True)
    assert [r.getMessage() for r in caplog.records if "already committed" in r.getMessage()] == [
        f"checkpoint iteration 2 under {tmp_path} is already committed: this save replaces it "
        "(atomically, at its commit)"]


def test_load_on_a_closed_checkpointer_refuses_before_reading_anything(tmp_path):
    ck = Checkpointer(CkptOptions())
    ck.close()
    with pytest.raises(RuntimeError, match="closed"):
        ck.load({}, tmp_path / "nothing_here")


def test_a_torn_directory_of_a_crashed_save_is_removed_off_the_save_path(tmp_path, monkeypatch,
                                                                          one_rank_group):
    """A save killed during its write leaves iter_N.incomplete (12 GB at ~1B: 2.9 s to remove);
    the next save of N renames it aside and removes it on a background thread, and saves into a
    fresh directory."""
    import shutil
    import threading
    import time

    import torch

    from megatron_ckpt_ext import backend

    root = tmp_path / "ckpt"
    torn = root / "iter_0000007.incomplete"
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(b"half of a killed save")
    removed: list[tuple[str, str]] = []
    real = shutil.rmtree

    def recording(path, *a, **k):
        removed.append((os.path.basename(path), threading.current_thread().name))
        return real(path, *a, **k)

    monkeypatch.setattr(layout.shutil, "rmtree", recording)
    st = backend.sharded_tensor_cls()
    with Checkpointer(CkptOptions(), save_dir=str(root)) as ck:
        ck.save({"w": st.from_rank_offsets("w", torch.arange(8.0), replica_id=0)}, root,
                iteration=7)
    assert read_tracker(root) == 7
    assert not (root / "iter_0000007" / "__0_0.distcp").read_bytes().startswith(b"half")
    deadline = time.monotonic() + 30
    while (root / "iter_0000007.incomplete.deleting").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ("iter_0000007.incomplete.deleting", "mcx-remove-torn") in removed
    assert not [r for r in removed
                if r[0].startswith("iter_0000007") and r[1] == threading.current_thread().name]
