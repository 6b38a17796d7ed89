"""A job suspended and resumed while a save is being written (SLURM's ``scontrol suspend`` and
preemption by suspension, a container's pause: every process of the job stopped, the cgroup
frozen or SIGSTOP, then continued): the time the job stood still is not the save's time, so the
save commits after the resume instead of failing ``--ckpt-timeout`` (docs/RELIABILITY.md,
"A suspended job"). Both ways a cluster stops a job: SIGSTOP to every process (SLURM's
``scontrol suspend``) and a frozen cgroup (SLURM's cgroup plugin, ``docker pause``: no signal)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from megatron_ckpt_ext.save.layout import read_tracker

from . import _control_workers as cw
from . import _suspend_workers as w
from ._ckpt_workers import ASYNC_MODES
from tests._support.dist import _tree, run_ranks, world
from tests._support.freezer import frozen, unavailable

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(150)]


def _suspend_while_writing(out: Path, ranks: int, stop_s: float, seen: dict, how: str) -> None:
    """The cluster's part: once every rank's writer is writing save 2, stop every process of
    the job (ranks and writers) ``how`` (SIGSTOP, or their cgroup frozen), wait ``stop_s``,
    continue them."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if all((out / f"writing_r{r}").exists() for r in range(ranks)):
            break
        time.sleep(0.02)
    else:
        return
    pids = [p for r in range(ranks) for p in _tree(int((out / f"pid_r{r}").read_text()))]
    if how == "freezer":
        with frozen(pids) as moved:
            seen["stopped"] = moved
            time.sleep(stop_s)
        return
    for sig in (signal.SIGSTOP, signal.SIGCONT):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if sig == signal.SIGSTOP:
            seen["stopped"] = len(pids)
            time.sleep(stop_s)


@pytest.mark.parametrize("how", ["sigstop", "freezer"])
@pytest.mark.parametrize("mode", list(ASYNC_MODES))
def test_a_save_in_flight_across_a_suspension_longer_than_the_timeout_commits(mode, how,
                                                                             tmp_path):
    if how == "freezer" and unavailable():
        pytest.skip(unavailable())
    root, ranks = tmp_path / "ckpt", world()
    options = {**ASYNC_MODES[mode], "ckpt_timeout": 3}
    hold_s, stop_s = 1.5, 6.0  # a healthy write well inside the timeout; a stop twice as long
    seen: dict = {}
    cluster = threading.Thread(target=_suspend_while_writing,
                               args=(tmp_path, ranks, stop_s, seen, how), daemon=True)
    cluster.start()
    run_ranks(w.save_across_a_suspend, args=(str(root), options, hold_s, str(tmp_path)))
    cluster.join(timeout=30)
    assert seen.get("stopped", 0) >= ranks * 2  # every rank and its writer were stopped
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["committed"] and r["loaded_iteration_2"], r
        assert r["save_to_end_s"] > stop_s, r  # the save was in flight across the stop
    assert read_tracker(root) == 2


@pytest.mark.parametrize("how", ["sigstop", "freezer"])
def test_a_job_stopped_while_a_rank_waits_in_our_collective_does_not_time_it_out(how, tmp_path):
    """Our collectives' bound counts the time the process ran: rank 0 waits in one (bound 3 s)
    while rank 1 has not reached it, the job stands still 6 s, rank 1 comes after the continue:
    the collective completes on both. Before, rank 0's wait had run out in the stop (it raised
    at the continue, and rank 1 then waited for it in vain). Over an NCCL world, as Megatron-LM's
    (our gloo group made with a long timeout of its own)."""
    if how == "freezer" and unavailable():
        pytest.skip(unavailable())
    ranks = world()

    def stop_both() -> None:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "waiting").exists() and all(
                (tmp_path / f"pid_r{r}").exists() for r in range(ranks))):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        time.sleep(0.5)  # rank 0 inside the wait
        pids = [p for r in range(ranks) for p in _tree(int((tmp_path / f"pid_r{r}").read_text()))]
        if how == "freezer":
            with frozen(pids):
                time.sleep(6.0)
                (tmp_path / "go").write_text("")
            return
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(6.0)
        (tmp_path / "go").write_text("")
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    cluster = threading.Thread(target=stop_both, daemon=True)
    cluster.start()
    run_ranks(cw.suspended_inside_a_collective, args=(str(tmp_path),))
    cluster.join(timeout=30)
    for r in range(ranks):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["error"] is None and seen["got"] == [float(ranks - 1)], (r, seen)
        # gloo's own timeout runs on the host's clock: it must outlast any stop ours leaves out
        assert len(seen["group_timeout_s"]) == 1 and seen["group_timeout_s"][0] >= 86400, seen
