"""The MCX_* switches: registered once, read only through env_switch, documented exactly in
docs/DEBUGGING.md (not in the README), and debug.py stays a standard-library leaf."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from megatron_ckpt_ext import debug
from megatron_ckpt_ext.debug import ENV_SWITCHES, env_switch, non_default_switches

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_ckpt_ext"


def test_every_switch_read_in_the_package_is_registered():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "os.environ.get(\"MCX_" not in text, f"{path.name} reads an MCX_ switch directly"
        used |= set(re.findall(r'env_switch\("(MCX_[A-Z0-9_]+)"\)', text))
    assert used == set(ENV_SWITCHES), used ^ set(ENV_SWITCHES)
    with pytest.raises(KeyError):
        env_switch("MCX_NOT_A_SWITCH")


def _doc_rows() -> dict[str, tuple[str, str]]:
    """docs/DEBUGGING.md's switch table: name -> (default, set to)."""
    text = (ROOT / "docs" / "DEBUGGING.md").read_text()
    return {m[1]: (m[2], m[3])
            for m in re.finditer(r"^\| `(MCX_[A-Z0-9_]+)` \| ([^|]+?) \| `([^`]+)` \|", text, re.M)}


def test_the_debugging_doc_lists_exactly_the_registered_switches_with_their_defaults():
    rows = _doc_rows()
    assert set(rows) == set(ENV_SWITCHES), set(rows) ^ set(ENV_SWITCHES)
    for name, switch in ENV_SWITCHES.items():
        default, set_to = rows[name]
        assert default == (f"`{switch.default}`" if switch.default else "unset"), name
        assert switch.help.startswith(f"{set_to}: "), name  # the value whose effect help gives


def test_the_readme_names_no_switch():
    readme = (ROOT / "README.md").read_text()
    assert [name for name in ENV_SWITCHES if name in readme] == []
    assert "docs/DEBUGGING.md" in readme


def test_debug_is_a_standard_library_leaf():
    tree = ast.parse((PACKAGE / "debug.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"debug.py imports from the package (line {node.lineno})"
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            assert name.split(".")[0] in sys.stdlib_module_names | {"__future__"}, name


def test_env_switch_reads_the_environment_with_its_registered_default(monkeypatch):
    monkeypatch.delenv("MCX_SPAWN_IMPORTS_MAIN", raising=False)
    assert env_switch("MCX_SPAWN_IMPORTS_MAIN") == "0"
    monkeypatch.setenv("MCX_SPAWN_IMPORTS_MAIN", "1")
    assert env_switch("MCX_SPAWN_IMPORTS_MAIN") == "1"


def test_non_default_switches_lists_only_those_set_off_their_default(monkeypatch):
    for name in ENV_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert non_default_switches() == {}
    monkeypatch.setenv("MCX_KEEP_PRELOAD", "0")  # set, to its default
    monkeypatch.setenv("MCX_WRITER_TRACE", "")  # set, to its default (unset)
    monkeypatch.setenv("MCX_TEST_DEVICE", "cuda")  # an MCX_ variable that is no switch
    assert non_default_switches() == {}
    monkeypatch.setenv("MCX_KEEP_CRC32", "1")
    monkeypatch.setenv("MCX_WRITER_TRACE", "/tmp/wt")
    assert debug.non_default_switches() == {"MCX_KEEP_CRC32": "1",
                                            "MCX_WRITER_TRACE": "/tmp/wt"}


def test_a_profiled_call_inside_another_runs_once_under_the_outer_profile(tmp_path):
    """Python allows one profiler at a time: the inner call just runs, and only the outer one
    is written (the launcher's profile of Megatron's save_checkpoint holds our save)."""
    from megatron_ckpt_ext.debug import profiled

    ran = []

    def inner():
        ran.append("inner")
        return 3

    def outer():
        return profiled(str(tmp_path), "inner", 0, inner) + 1

    assert profiled(str(tmp_path), "outer", 0, outer) == 4
    assert ran == ["inner"]
    text = (tmp_path / "save_profile_rank0.txt").read_text()
    assert "==== outer" in text and "==== inner" not in text
    assert profiled(str(tmp_path), "again", 0, inner) == 3  # the flag is down again
    assert "==== again" in (tmp_path / "save_profile_rank0.txt").read_text()
