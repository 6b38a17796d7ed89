"""The docs that describe the code as it is (ARCHITECTURE.md, DEBUGGING.md) name real places:
every ``path.py: name`` they cite is a module of the package that defines ``name`` (a function,
a class or a class's member, a module-level name) or imports it (a re-export). A rename that
leaves the docs behind fails here. History (docs/notes, the session sections) is not checked:
it names what the code was."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_ckpt_ext"
DOCS = ("docs/ARCHITECTURE.md", "docs/DEBUGGING.md")
# `save/report.py: gc_pauses`, `_cpu_shim.py: install`, `save/steps.py: _SaveSteps.stage`
_CITED = re.compile(r"`((?:[a-z_]+/)*[a-z_0-9]+\.py): ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


@lru_cache(maxsize=None)
def _names(path: Path) -> frozenset[str]:
    names: set[str] = set()

    def targets(node: ast.AST) -> list[str]:
        found = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.id for t in found if isinstance(t, ast.Name)]

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{member.name}")
                elif isinstance(member, (ast.Assign, ast.AnnAssign)):
                    names.update(f"{node.name}.{n}" for n in targets(member))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(targets(node))
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return frozenset(names)


def _module(cited: str) -> Path | None:
    path = PACKAGE / cited
    if path.exists():
        return path
    same_name = list(PACKAGE.rglob(Path(cited).name))  # a bare file name, unique in the package
    return same_name[0] if "/" not in cited and len(same_name) == 1 else None


def cited_places(text: str) -> list[tuple[int, str, str]]:
    return [(n, m.group(1), m.group(2)) for n, line in enumerate(text.splitlines(), 1)
            for m in _CITED.finditer(line)]


def missing(text: str) -> list[str]:
    out = []
    for n, cited, name in cited_places(text):
        path = _module(cited)
        if path is None:
            out.append(f"line {n}: {cited} is no module of the package")
        elif name not in _names(path):
            out.append(f"line {n}: {cited} has no {name}")
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_place_the_doc_cites_is_in_the_code(doc):
    text = (ROOT / doc).read_text()
    assert cited_places(text), f"{doc} cites no place: the pattern no longer matches its style"
    assert missing(text) == [], doc


def test_a_renamed_or_moved_place_is_caught():
    text = ("`save/report.py: gc_pauses` `save/report.py: no_such_name` "
            "`save/nowhere.py: gc_pauses` `save/steps.py: _SaveSteps.no_member`")
    assert [m.split(":", 1)[1].strip() for m in missing(text)] == [
        "save/report.py has no no_such_name", "save/nowhere.py is no module of the package",
        "save/steps.py has no _SaveSteps.no_member"]
