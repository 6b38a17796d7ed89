"""The README documents every flag and config key, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_ckpt_ext.options import CkptOptions, knobs

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_flag_table_covers_every_knob():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[a-z-]+)[^`]*` \| `([a-z_]+)` \|", README, re.M)}
    assert rows == {k.flag: k.key for k in knobs()}


def test_readme_config_defaults_match_from_config():
    cfg = CkptOptions.from_config({})
    assert (cfg.ckpt_fully_parallel_load, cfg.load_rng, cfg.distributed_timeout_minutes) == (True, False, None)
    for key in ("fully_parallel_load", "load_rng", "distributed_timeout_minutes"):
        assert re.search(rf"\| `{key}` \|[^\n]*\*\*", README), f"README must mark {key}'s config default"


def test_ci_runs_the_readme_test_command():
    test_cmd = re.search(r"^(bash scripts/test\.sh)$", README, re.M)
    assert test_cmd, "README must show the test command on its own line"
    ci = (ROOT / ".ci" / "run").read_text()
    # the command itself, on its own line or under a time limit (`timeout ... bash scripts/test.sh`)
    assert re.search(rf"^(timeout [^\n]*\s)?{re.escape(test_cmd.group(1))}(\s|$)", ci, re.M)
