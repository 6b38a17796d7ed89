"""benchmarks/real_client.py: Megatron's timers and losses, parsed from its logs, named by save
kind, and a restarted run's losses compared (the GPU driver's JSON rests on this)."""

from __future__ import annotations

from tests._support import load_script

rc = load_script("benchmarks/real_client.py", "real_client")

LOG = """\
[2026-11-25 16:51:25.2] saving checkpoint at iteration     100 to /x in torch_dist format
(min, max) time across ranks (ms):
    save-checkpoint ................................: (1700.00, 1751.70)
 [2026-11-25] iteration      101/     350 | lm loss: 6.100000E+00 | grad norm: 1.0 |
 [2026-11-25] iteration      102/     350 | lm loss: 6.000000E+00 | grad norm: 1.0 |
[2026-11-25 16:51:32.6] saving checkpoint at iteration     200 to /x in torch_dist format
(min, max) time across ranks (ms):
    save-checkpoint ................................: (90.00, 98.30)
[2026-11-25 16:51:41.6] saving checkpoint at iteration     350 to /x in torch_dist format
(min, max) time across ranks (ms):
    save-checkpoint ................................: (100.00, 107.10)
"""
RESTART = """\
(min, max) time across ranks (ms):
    load-checkpoint ................................: (560.00, 571.00)
INFO:megatron_ckpt_ext.load.report:checkpoint load report: {"tier": "memory", "load_s": 0.52}
 [2026-11-25] iteration      101/     350 | lm loss: 6.100000E+00 | grad norm: 1.0 |
 [2026-11-25] iteration      102/     350 | lm loss: 6.050000E+00 | grad norm: 1.0 |
[rank0]: RuntimeError: Worker cache miss for key 60. Worker may have restarted.
"""


def test_saves_are_named_by_kind_and_timed_by_megatrons_max():
    parsed = rc.parse_log(LOG)
    named = rc.name_saves(parsed["saves"], resumed=False, interval=100)
    assert [(s["iteration"], s["save"], s["stall_s"]) for s in named] == [
        (100, "first", 1.7517), (200, "steady", 0.0983), (350, "end_of_training", 0.1071)]
    resumed = rc.name_saves(parsed["saves"], resumed=True, interval=100)
    assert resumed[0]["save"] == "first_after_resume"


def test_a_restart_is_read_with_its_tier_load_time_and_error():
    parsed = rc.parse_log(RESTART)
    assert parsed["load_s"] == 0.571 and parsed["tier"] == "memory"
    assert parsed["error"].startswith("RuntimeError: Worker cache miss")


def test_restarted_losses_match_except_megatrons_mean_of_its_first_two():
    a = rc.parse_log(LOG)["losses"]
    b = rc.parse_log(RESTART)["losses"]
    assert rc.losses_match(a, b, 101) == {"compared": 2, "differ": [], "identical": True,
                                          "max_rel_diff": 0.0}
    b[101] = "6.100001E+00"
    check = rc.losses_match(a, b, 101)
    assert check["differ"] == [101] and 0 < check["max_rel_diff"] < 1e-6, check


def test_the_steady_row_is_compared_with_the_copy_floor_of_its_model():
    rows = [{"model": "134m", "source": "ours", "save": "steady", "stall_s": s}
            for s in (0.05, 0.06, 0.07)]
    steady = rc.table(rows, [], {"134m": {"d2h_pinned_s": 0.03}})[0]
    assert steady["ours_median_over_copy_floor"] == 2.0, steady
    assert "ours_median_over_copy_floor" not in rc.table(rows, [])[0]
