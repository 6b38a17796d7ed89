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


def _bash_commands() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```$", README, re.M | re.S)
    return [line.split("#")[0].strip() for b in blocks for line in b.splitlines()
            if line.split("#")[0].strip()]


def test_readme_commands_run_where_pip_put_python_and_save_outside_the_checkout():
    """`torchrun` is not on PATH under pyenv until a rehash; `--save ckpt` would write into the
    checkout, each block replacing the last's checkpoints."""
    commands = _bash_commands()
    assert not [c for c in commands if c.startswith("torchrun")], (
        "use python -m torch.distributed.run")
    assert not [c for c in commands if re.search(r"--(save|load) (?!\$|/)", c)], (
        "README commands save into a scratch directory ($CKPT, $(mktemp -d) or an absolute path)")


def test_readme_preemption_signals_exactly_the_jobs_ranks():
    """`pkill -f "python -u ..."` matches nothing under python3 and hits other users' jobs."""
    commands = _bash_commands()
    assert not [c for c in commands if "pkill" in c and "-f" in c.split()]
    assert any(re.search(r"pkill -TERM -P \$LAUNCHER\b", c) for c in commands)
    assert "LAUNCHER=$!" in commands
