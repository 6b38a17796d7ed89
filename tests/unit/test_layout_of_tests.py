"""How tests/ is laid out: every test file sits in one tier (unit, functional, compat) whose marker
selects exactly it, and test code takes shared helpers from tests/_support or from a worker module
of its own directory, never from tools/ (lab scripts) or from another test module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests._support import ROOT
from tests._support.tiers import TIERS, markers_for

TESTS = ROOT / "tests"
TIER_MARKERS = sorted(set(TIERS.values()))


def _imported(node: ast.AST, path: Path) -> list[str]:
    """The dotted modules an import statement may bind (``from M import n``: M and M.n)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    package = path.relative_to(ROOT).parent.parts
    base = package[:len(package) - node.level + 1] if node.level else ()
    module = ".".join([*base, *(node.module.split(".") if node.module else [])])
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


def _allowed(module: str, path: Path) -> bool:
    """Not tools/, not a test module; under tests/ only _support or the importer's own folder."""
    parts = module.split(".")
    if parts[0] == "tools" or any(p.startswith("test_") for p in parts):
        return False
    if parts[0] != "tests" or parts[1:2] == ["_support"]:
        return True
    folder = ROOT
    for part in parts:  # the deepest folder the dotted name walks through
        if not (folder / part).is_dir():
            break
        folder = folder / part
    return folder == path.parent


def _bad_imports(path: Path) -> list[str]:
    """``path``'s imports that break the layout, as 'file:line: module'."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        wrong = [m for m in _imported(node, path) if not _allowed(m, path)]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {wrong[0]}")
    return bad


def test_no_test_code_imports_tools_another_test_module_or_another_folders_helper():
    bad = [line for path in sorted(TESTS.rglob("*.py")) for line in _bad_imports(path)]
    assert not bad, ("imports of tools/, of a test module or of another folder's helper: move "
                     "what tests share into tests/_support, a worker module (_*.py) next to its "
                     "test; a test of a tools/ script loads it by path:\n" + "\n".join(bad))


def test_every_test_file_sits_in_one_tier():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 10
    stray = [str(f.relative_to(ROOT)) for f in files if not markers_for(f.relative_to(TESTS))]
    assert not stray, (f"test files outside the tiers {sorted(TIERS)} of tests/ "
                       f"(tests/_support/tiers.py): {stray}")


def test_the_tier_markers_are_registered():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0] for line in config["markers"]}
    assert registered >= {*TIER_MARKERS, "multirank"}, registered


def test_each_collected_test_has_exactly_one_tier_marker():
    """The whole collection, with conftest's markers: no test is in none or in two tiers."""
    one_of = " or ".join(TIER_MARKERS)
    pairs = [f"({a} and {b})" for i, a in enumerate(TIER_MARKERS) for b in TIER_MARKERS[i + 1:]]
    expr = f"not ({one_of}) or " + " or ".join(pairs)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "-m", expr, "tests"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    # every test collected, and every one deselected by the expression
    assert r.returncode == 5 and re.search(r"^no tests collected \([1-9]\d* deselected\)", r.stdout,
                                           re.M), (
        f"tests in no tier or in two (pytest -m {expr!r}):\n{r.stdout[-4000:]}{r.stderr[-2000:]}")
