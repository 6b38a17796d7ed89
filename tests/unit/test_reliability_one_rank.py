"""The one-rank kills of the crash trials (``tools/reliability.py crash --kill one|mixed``): the
victim dies with its children, the survivors get a grace to exit by themselves and are then torn
down as torchrun does (SIGTERM, then SIGKILL), and a restore is flagged wrong when it used memory
though some rank held no seal of the tracker's iteration, or the ranks' tiers differ."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tests._support import load_script

ROOT = Path(__file__).resolve().parents[2]


def _module():
    """The harness module under test, loaded from its path (tests import nothing from tools/)."""
    return load_script("tools/_reliability_one_rank.py", "reliability_one_rank")


one = _module()


def _trial(seals, tracker, tiers, **extra):
    return {"seals_left": seals, "after": {"tracker": tracker, "tier": tiers[0], "tiers": tiers},
            "phase": "random", **extra}


@pytest.mark.parametrize("seals,tiers,sealed,wrong", [
    ([5, 5], ["memory", "memory"], "every", False),
    ([5, 5], ["storage", "storage"], "every", False),  # a flipped byte: refused, not wrong
    ([5, None], ["storage", "storage"], "some", False),
    ([None, 5], ["memory", "memory"], "some", True),   # a rank without the seal used memory
    ([5, 5], ["memory", "storage"], "every", True),    # the all-or-nothing agreement broke
    ([4, None], ["storage", "storage"], "none", False),
])
def test_a_restore_from_memory_needs_every_rank_sealed_at_the_trackers_iteration(
        seals, tiers, sealed, wrong):
    got = one.agreement(_trial(seals, 5, tiers))
    assert (got["sealed"], got["wrong"]) == (sealed, wrong)


def test_the_summary_counts_partly_sealed_restores_and_wrong_ones():
    survivor = [{"rank": 0, "ended_by": "exited", "error_by_teardown": "RuntimeError: peer"}]
    trials = [
        _trial([None, 5], 5, ["storage", "storage"], kill="one", victim=1, victim_alive=True,
               survivors=survivor, seals_at_kill=[5, 5], victim_at={"at": "step"}),
        _trial([5, 5], 5, ["memory", "memory"], kill="all"),
        _trial([4, 4], 5, ["storage", "storage"], kill="all"),
        _trial([5, None], 5, ["memory", "memory"], kill="all"),
    ]
    s = one.summarize(trials)
    assert s["one_rank_kills"] == 1 and s["survivors_ended_by"] == {"exited": 1}
    assert s["survivors_failed_by_teardown"] == 1
    assert s["restores_with_some_ranks_sealed"] == 2 and s["some_sealed_read_storage"] == 1
    assert s["some_sealed_in_one_rank_kills"] == 1
    assert s["survivor_seals_dropped_on_the_way_out"] == 1  # rank 0 held 5 at the kill, not after
    assert s["restores_with_every_rank_sealed"] == 1 and s["ranks_with_stale_seals"] == 2
    assert s["memory_restores_without_every_seal_or_mixed_tiers"] == 1


def test_every_rank_kills_draw_nothing_and_mixed_draws_both_kinds():
    rng = random.Random(7)
    state = rng.getstate()
    assert one.choose(rng, "all", 2) == ("all", None)
    assert rng.getstate() == state  # the every-rank trials keep their random sequence
    draws = [one.choose(rng, "mixed", 3) for _ in range(40)]
    assert {k for k, _ in draws} == {"all", "one"}
    assert {v for k, v in draws if k == "one"} == {0, 1, 2}
    assert all(v is None for k, v in draws if k == "all")
    assert one.hook_rank("staging", 1) == 1 and one.hook_rank("after_tracker", 1) == 0


def _python(code: str, log: Path) -> subprocess.Popen:
    fh = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT)
    proc.log_path = str(log)
    return proc


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(60)
def test_one_rank_kill_takes_the_victims_children_and_tears_the_rest_down_like_torchrun(
        tmp_path, monkeypatch):
    monkeypatch.setattr(one, "TERM_WAIT_S", 0.5)
    child_file = tmp_path / "child.pid"
    victim = _python(  # a trainer with a writer child that outlives it unless killed too
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(child_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n", tmp_path / "rank0.log")
    survivors = [
        _python("import sys, time; time.sleep(0.3); "
                "print('RuntimeError: Connection closed by peer', flush=True); sys.exit(3)",
                tmp_path / "rank1.log"),  # fails on its collective and exits by itself
        _python("import time; time.sleep(60)", tmp_path / "rank2.log"),  # blocked: SIGTERM
        _python("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(60)", tmp_path / "rank3.log"),  # ignores SIGTERM: SIGKILL
    ]
    procs = [victim, *survivors]
    try:
        deadline = time.monotonic() + 20
        while not child_file.exists() or not child_file.read_text():
            assert time.monotonic() < deadline, "the victim's child did not start"
            time.sleep(0.02)
        (tmp_path / "progress_r0.json").write_text(json.dumps({"at": "staged", "it": 4}))
        child = int(child_file.read_text())
        kill = one.OneRankKill(0, tmp_path, root=tmp_path / "ckpt", world=4, grace_s=1.0)
        assert kill(procs) is True
        record = kill.record
        assert record["victim_alive"] and record["victim_children_killed"] == 1
        assert record["victim_at"] == {"at": "staged", "it": 4}
        assert victim.returncode == -9 and _gone(child)
        ended = {s["rank"]: (s["ended_by"], s["rc"]) for s in record["survivors"]}
        assert ended == {1: ("exited", 3), 2: ("SIGTERM", -15), 3: ("SIGKILL", -9)}
        first = record["survivors"][0]
        assert "Connection closed by peer" in first["error_by_teardown"]
        assert first["after_s"] < 1.0 <= record["survivors"][1]["after_s"]
        assert record["seals_at_kill"] == [None] * 4
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
