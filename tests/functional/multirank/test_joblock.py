"""One job per --save directory: a second job fails at start-up on every rank naming the holder;
the lock of a killed job is taken over with one warning; a closed Checkpointer lets go."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import SaveDirectoryInUse
from megatron_ckpt_ext.save.joblock import LOCK
from tests._support.dist import run_ranks

from . import _joblock_workers as jw

REPO = Path(__file__).resolve().parents[3]


def _start_holder(root: Path, **env: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.functional.multirank._joblock_workers", str(root)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))), **env})
    line = proc.stdout.readline()
    if not line.startswith("held "):
        proc.kill()
        pytest.fail(f"the holder job did not start: {line}{proc.stderr.read()[-3000:]}")
    return proc, int(line.split()[1])


def test_a_second_job_fails_naming_the_holder_and_a_killed_ones_lock_is_taken_over(
        tmp_path, caplog):
    root = tmp_path / "ckpt"
    holder, child = _start_holder(root)
    try:
        run_ranks(jw.second_job_fails, world_size=2, timeout=120, args=(str(root), holder.pid))
        with pytest.raises(SaveDirectoryInUse, match=f"pid {holder.pid}"):
            Checkpointer(CkptOptions(), save_dir=root)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert (root / LOCK).is_file()  # a killed job leaves its record behind
        # and its unfinished saves: one cut short (an exit checkpoint killed by the scheduler:
        # that iteration never comes again) and a removal it was doing when killed
        torn, aside = root / "iter_0000037.incomplete", root / "iter_0000030.incomplete.deleting"
        for d in (torn / "sub", aside):
            d.mkdir(parents=True)
            (d / "__0_0.distcp").write_bytes(b"x" * 4096)
        with caplog.at_level(logging.WARNING):  # its forked child lives on, without the lock
            with Checkpointer(CkptOptions(), save_dir=root):
                pass
            with Checkpointer(CkptOptions(), save_dir=root):  # released at close: no warning
                pass
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)
        holder.wait(timeout=30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "taking over" in warnings[0], warnings
    assert f"pid {holder.pid}" in warnings[0] and "holder-job" in warnings[0], warnings
    assert "unfinished saves ['iter_0000037.incomplete'] are removed" in warnings[0], warnings
    assert not (root / LOCK).exists()  # a clean close removes it
    deadline = time.monotonic() + 30  # removed on a background thread
    while sorted(p.name for p in root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.name for p in root.iterdir()) == []


def test_checkpointers_of_one_process_share_the_lock(tmp_path):
    """Train then resume in one process, or two Checkpointers open at once: the same job."""
    first = Checkpointer(CkptOptions(), save_dir=tmp_path)
    with Checkpointer(CkptOptions(), save_dir=tmp_path):
        pass
    assert (tmp_path / LOCK).is_file()  # still held by the first
    first.close()
    assert not (tmp_path / LOCK).exists()


def test_ranks_other_than_0_take_no_lock_before_the_process_group_is_up(tmp_path, monkeypatch):
    """Megatron-LM 0.19 builds the persistent worker (our early Checkpointer, with --save) on
    every rank before torch.distributed is initialized: only RANK 0 may take the lock there."""
    root = tmp_path / "ckpt"
    holder, child = _start_holder(root)  # rank 0 of the same job, holding the lock
    try:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with Checkpointer(CkptOptions(), save_dir=root):  # no SaveDirectoryInUse
            pass
        assert (root / LOCK).is_file()  # still rank 0's
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)
        holder.wait(timeout=30)


def test_the_lock_taken_before_the_process_group_is_up_names_the_jobs_world_size(tmp_path,
                                                                               monkeypatch):
    """The launcher's early Checkpointer takes the lock on RANK 0 before torch.distributed is
    up: the lock (and a later job's message about it) names the job's WORLD_SIZE ranks, not 1."""
    import json

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with Checkpointer(CkptOptions(), save_dir=tmp_path):
        held = json.loads((tmp_path / LOCK).read_text())
    assert held["world_size"] == 2, held


@pytest.mark.parametrize("ours", ["torchrun-job-b", "torchrun-job-a"], ids=["another-job", "same-job"])
def test_a_rank_before_the_process_group_is_up_fails_on_another_live_jobs_lock(tmp_path,
                                                                              monkeypatch, ours):
    """A requeued job starting while the old one still runs: before torch.distributed is up
    rank 0's verdict cannot reach the other ranks, so each of them reads the lock itself and
    fails when a live process of another job (its launcher's run id) holds it; a rank of the
    holder's own job goes on."""
    root = tmp_path / "ckpt"
    holder, child = _start_holder(root, TORCHELASTIC_RUN_ID="torchrun-job-a")
    try:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", ours)
        if ours == "torchrun-job-a":
            with Checkpointer(CkptOptions(), save_dir=root):
                pass
        else:
            with pytest.raises(SaveDirectoryInUse, match=f"pid {holder.pid}.*holder-job"):
                Checkpointer(CkptOptions(), save_dir=root)
        assert (root / LOCK).is_file()  # the holder's, untouched
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)
        holder.wait(timeout=30)


def test_taking_over_a_lock_from_another_host_removes_only_the_saves_it_cannot_finish(
        tmp_path, caplog):
    """Where a file system's locks are node-local, a lock record from another host may belong
    to a job still running there: of its unfinished saves only those older than the tracker's
    iteration (a later save committed after them) are removed; a newer one and a removal in
    progress stay, and the warning names the other host."""
    import json

    from megatron_ckpt_ext.save.layout import TRACKER

    root = tmp_path / "ckpt"
    (root / "iter_0000040").mkdir(parents=True)
    (root / TRACKER).write_text("40")
    (root / LOCK).write_text(json.dumps({"host": "another-node", "pid": 4242, "world_size": 8,
                                         "job": "slurm:77..0", "command": "pretrain_gpt.py"}))
    older, newer = root / "iter_0000037.incomplete", root / "iter_0000045.incomplete"
    aside = root / "iter_0000030.incomplete.deleting"
    for d in (older, newer, aside):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 4096)
    with caplog.at_level(logging.WARNING):
        with Checkpointer(CkptOptions(), save_dir=root):
            pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "another-node" in warnings[0], warnings
    assert "unfinished saves ['iter_0000037.incomplete'] are removed" in warnings[0], warnings
    deadline = time.monotonic() + 30  # removed on a background thread
    while older.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["iter_0000030.incomplete.deleting", "iter_0000040",
                     "iter_0000045.incomplete", TRACKER], names
