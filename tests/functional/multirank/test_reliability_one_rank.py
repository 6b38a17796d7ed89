"""One rank killed alone (``tools/reliability.py crash --kill one``), the CI subset: one rank's
trainer is SIGKILLed with its writers while the other lives; the other is torn down as a
launcher would, the job restarts on the same directory and restores exactly the tracker's
iteration (from memory only when every rank held that iteration sealed), bit-exact, and leaves
no process or segment behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support import load_script
from tests._support.dist import world

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.multirank]


rel = load_script("tools/reliability.py", "reliability", register=True)  # the harness under test


@pytest.mark.timeout(300)
@pytest.mark.skipif(world() < 2, reason="one rank killed alone needs two ranks")
def test_one_rank_killed_alone_restores_the_trackers_iteration_and_never_a_partial_snapshot(
        tmp_path):
    # before_save: the victim is killed holding the last commit sealed while the survivor waits
    # in the next save's first collective; whether the survivor's seal outlives its own exit
    # decides the restart's tier: memory only with every rank sealed at the tracker's iteration.
    plan = [("persistent-shm", "before_save"), ("temporal-shm", "staging"),
            ("persistent-shm", "after_tracker"), ("temporal-shm", rel.RANDOM)]
    campaign = rel.CrashCampaign(tmp_path, world=world(), device=rel.rw.device(), saves=6,
                                 seed=2, random_window_s=3.0, log=lambda line: None)
    campaign.kill, campaign.step_s = "one", 0.5
    result = campaign.run(plan)
    s, trials = result["summary"], result["trials"]
    details = [rel._trial_line(t) for t in trials]
    killed = [t for t in trials if t.get("victim_alive")]
    assert len(killed) >= len(plan) - 1 and s["one_rank_kills"] == len(killed), details
    for t in killed:
        assert t["kill"] == "one" and 0 <= t["victim"] < world(), t
        assert t["victim_at"] is not None and len(t["seals_left"]) == world(), t
        assert [x["ended_by"] for x in t["survivors"]] != ["alive"] * (world() - 1), t
        assert len(set(t["after"]["tiers"])) == 1, t  # every rank restored from one tier
        every = rel.one.agreement(t)["sealed"] == "every"
        assert t["after"]["tier"] == ("memory" if every else "storage"), t
    sealed = s["restores_with_some_ranks_sealed"] + s["restores_with_every_rank_sealed"]
    assert sealed >= 1, details  # the plan did leave snapshots to agree on
    assert s["some_sealed_read_storage"] == s["restores_with_some_ranks_sealed"], details
    assert s["every_sealed_undamaged_read_storage"] == 0, details
    assert s["memory_restores_without_every_seal_or_mixed_tiers"] == 0, details
    assert s["torn_loads"] == 0 and s["unverified"] == 0, details
    assert s["tracker_mismatches"] == 0, details
    assert s["leftover_processes"] == 0, [t["orphans"] for t in trials]
    assert s["shm_dead_owner_segments_after_next_start"] == 0
    assert s["leftover_shm_segments_at_end"] == 0
    assert s["failures"] == 0, details
