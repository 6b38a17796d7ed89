"""Operations through the Checkpointer (issue 23): retention after commits, the failure policy
of async saves, and preemption (--exit-signal-handler) in the example loop under SIGTERM."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointWriteError
from megatron_ckpt_ext.hooks import SaveHooks
from megatron_ckpt_ext.save.layout import read_tracker
from tests._support.dist import sharded

ROOT = Path(__file__).resolve().parents[3]
ASYNC = {"async_save": True}
PERSISTENT_SHM = {"async_save": True, "use_persistent_ckpt_worker": True,
                  "async_ckpt_use_cpu_shm": True, "ckpt_assume_constant_structure": True}



def _state(step: int) -> dict:
    return {"w": torch.arange(2048, dtype=torch.float32) + step}


def _iters(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir()
                  if p.name.startswith("iter_") and p.name[5:].isdigit())


# -- retention -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_retention_keeps_the_window_after_each_commit(tmp_path, one_rank_group, mode):
    options = CkptOptions(most_recent_k=2, save_retain_interval=4, **(ASYNC if mode == "async"
                                                                      else {}))
    with Checkpointer(options, save_dir=tmp_path) as ck:
        for step in range(1, 10):
            ck.save(sharded(0, 1, _state(step)), tmp_path, iteration=step)
            ck.maybe_finalize(blocking=True)
        ck._retention.wait()
        assert _iters(tmp_path) == [4, 8, 9]
    assert _iters(tmp_path) == [4, 8, 9] and read_tracker(tmp_path) == 9
    like = {"w": torch.zeros(2048)}
    with Checkpointer(CkptOptions()) as ck:
        assert torch.equal(ck.load(sharded(0, 1, like), tmp_path)["w"], _state(9)["w"])


def test_retention_finishes_a_deletion_a_crash_interrupted_at_the_next_start(tmp_path,
                                                                           one_rank_group):
    with Checkpointer(CkptOptions()) as ck:
        for step in (1, 2):
            ck.save(sharded(0, 1, _state(step)), tmp_path, iteration=step)
    os.rename(tmp_path / "iter_0000001", tmp_path / "iter_0000001.deleting")  # the crash
    with Checkpointer(CkptOptions(most_recent_k=1), save_dir=tmp_path):
        assert not (tmp_path / "iter_0000001.deleting").exists()
    assert _iters(tmp_path) == [2]


# -- failure policy ------------------------------------------------------------------------------
def _failing_write(*args, **kwargs):
    raise OSError("injected: the disk went away")


class _FailIterations(SaveHooks):
    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def wrap_request(self, request, record):
        if record.iteration in self.bad:
            # the request's arguments kept: a caller may fill them in first (nvrx 0.7's
            # temporal caller puts the preloaded tensors into async_fn_args[1])
            return request._replace(async_fn=partial(_failing_write))
        return request


@pytest.mark.parametrize("extra", [ASYNC, PERSISTENT_SHM], ids=["temporal", "persistent-shm"])
def test_warn_policy_abandons_a_failed_save_and_training_goes_on(tmp_path, one_rank_group,
                                                                 caplog, extra):
    options = CkptOptions(ckpt_failure_policy="warn", **extra)
    caplog.set_level("ERROR", logger="megatron_ckpt_ext")
    with Checkpointer(options, hooks=_FailIterations({2})) as ck:
        for step in (1, 2, 3):
            ck.save(sharded(0, 1, _state(step)), tmp_path, iteration=step)
            ck.maybe_finalize(blocking=True)
            if step == 2:
                assert read_tracker(tmp_path) == 1  # the previous checkpoint stays the latest
        assert len(ck.failed_saves) == 1 and "iteration 2" in ck.failed_saves[0]["error"]
    assert read_tracker(tmp_path) == 3 and 2 not in _iters(tmp_path)
    assert "--ckpt-failure-policy warn: training goes on" in caplog.text


def test_raise_policy_raises_and_warn_raises_after_n_in_a_row(tmp_path, one_rank_group):
    with Checkpointer(CkptOptions(**ASYNC), hooks=_FailIterations({1})) as ck:
        ck.save(sharded(0, 1, _state(1)), tmp_path, iteration=1)
        with pytest.raises(CheckpointWriteError, match="iteration 1 .* failed on every rank"):
            ck.maybe_finalize(blocking=True)
    options = CkptOptions(ckpt_failure_policy="warn", ckpt_max_consecutive_failures=2, **ASYNC)
    with Checkpointer(options, hooks=_FailIterations({2, 3, 5, 6})) as ck:
        for step in (2, 3):  # two in a row: the second raises
            ck.save(sharded(0, 1, _state(step)), tmp_path / "b", iteration=step)
            if step == 2:
                ck.maybe_finalize(blocking=True)
        with pytest.raises(CheckpointWriteError, match="2th failed save in a row"):
            ck.maybe_finalize(blocking=True)
    with Checkpointer(options, hooks=_FailIterations({5, 7})) as ck:  # a success resets the count
        for step in (5, 6, 7, 8):
            ck.save(sharded(0, 1, _state(step)), tmp_path / "c", iteration=step)
            ck.maybe_finalize(blocking=True)
        assert len(ck.failed_saves) == 2
    assert read_tracker(tmp_path / "c") == 8


# -- preemption ----------------------------------------------------------------------------------
def _launch(save: Path, *flags: str, iters: int = 100000) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_loop.py"), "--save", str(save), "--save-interval", "3",
           "--train-iters", str(iters), "--exit-signal-handler", *flags]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _workers(proc: subprocess.Popen, n: int = 2, timeout: float = 60) -> list[int]:
    """The rank processes torchrun started (its children running train_loop.py)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "train_loop.py"],
                             capture_output=True, text=True).stdout.split()
        if len(out) >= n:
            return [int(p) for p in out]
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("trial", range(3))
def test_sigterm_at_a_random_point_exits_0_with_a_loadable_latest_checkpoint(tmp_path, trial):
    """SIGTERM to the ranks (as SLURM sends it; in trial 0 to rank 1 only) at a random moment
    of a run that saves every 3 iterations: every rank exits 0 within the grace window, the
    tracker names a committed checkpoint that verifies, and rank 0 reported signal-to-durable."""
    rng = random.Random(trial)
    save = tmp_path / "ckpt"
    flags = ("--async-save", "--ckpt-preempt-grace-s", "60")
    if trial == 2:
        flags += ("--async-ckpt-use-cpu-shm", "--ckpt-assume-constant-structure",
                  "--use-persistent-ckpt-worker")
    proc = _launch(save, *flags)
    try:
        workers = _workers(proc)
        deadline = time.time() + 60
        while read_tracker(save) is None and time.time() < deadline:  # saving has begun
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        sent = time.time()
        for pid in (workers[-1:] if trial == 0 else workers):
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-1500:]}{err[-3000:]}"
    assert took < 60, took
    latest = read_tracker(save)
    assert latest is not None and (save / f"iter_{latest:07d}").is_dir()
    verify = subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", "verify", str(save)],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "SIGTERM received" in err and "grace window" in err, err[-3000:]
    # rank 0 reports the exit checkpoint (even when only rank 1 got the signal), not a save
    # that was in flight at the signal
    assert f"exit checkpoint iteration {latest} durable" in err, err[-3000:]
    done = [line for line in out.splitlines() if line.startswith("done at iteration")]
    assert done and int(done[0].split()[3].rstrip(":")) == latest, (done, latest)
