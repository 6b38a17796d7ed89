"""``save/layout.py`` is the on-disk layout's one home: one parser of directory names, the
suffixes spelled once, and one manifest check shared by the load and ``verify``."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from megatron_ckpt_ext import manifest, verify_cli
from megatron_ckpt_ext._mlm_seams import _iteration_of
from megatron_ckpt_ext.load.verify import check_manifest, committed_before
from megatron_ckpt_ext.save import layout
from megatron_ckpt_ext.save.layout import (DELETING, INCOMPLETE, OLD, checkpoint_name,
                                           parse_iteration)
from megatron_ckpt_ext.save.retention import to_delete

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ckpt_ext"
HOME = PACKAGE / "save" / "layout.py"

ACCEPTED = {
    "iter_0000000": 0,
    "iter_0000001": 1,
    "iter_0001234": 1234,
    "iter_9999999": 9_999_999,
    "iter_10000000": 10_000_000,  # what checkpoint_name writes past seven digits
    "iter_123456789": 123_456_789,
}
REJECTED = [
    *(f"iter_0000001{suffix}" for suffix in (INCOMPLETE, DELETING, OLD)),
    "iter_0000001.incomplete.old", "iter_000001", "iter_00000001", "iter_", "iter_-000001",
    "iter_+000001", "iter_ 000001", "iter_000_001", "iter_0000001\n", " iter_0000001",
    "ITER_0000001", "xiter_0000001", "iter_0000001x", "iter_000000a", "iter_" + "\u0661" * 7,
    "latest_checkpointed_iteration.txt", "",
]


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_parser_reads_every_name_checkpoint_name_writes(name, tmp_path):
    assert parse_iteration(name) == ACCEPTED[name]
    assert checkpoint_name(tmp_path, ACCEPTED[name]).name == name


@pytest.mark.parametrize("name", REJECTED)
def test_the_parser_refuses_suffixed_and_foreign_names(name):
    assert parse_iteration(name) is None


def test_the_suffixed_names_are_the_committed_name_plus_the_suffix(tmp_path):
    committed = checkpoint_name(tmp_path, 7)
    assert layout.incomplete_name(tmp_path, 7).name == committed.name + INCOMPLETE
    assert layout.suffixed(committed, DELETING).name == committed.name + DELETING
    assert layout._aside(committed).name == committed.name + OLD
    assert {INCOMPLETE, DELETING, OLD} == {".incomplete", ".deleting", ".old"}


def test_every_caller_takes_the_same_names_for_committed(tmp_path):
    """The retention's listing, the load's fallback listing and the Megatron-LM seam accept
    exactly the names the parser accepts."""
    names = [*ACCEPTED, *(n for n in REJECTED if n.startswith(("iter_", "ITER_", "xiter_"))
                          and n.strip() == n)]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text("{}")
    want = sorted(ACCEPTED.values())
    (tmp_path / layout.TRACKER).write_text(f"{want[-1]}\n")
    assert committed_before(tmp_path, 1 << 62) == want[::-1]
    gone = to_delete(tmp_path, most_recent_k=1, retain_interval=None)
    assert [parse_iteration(p.name) for p in gone] == want[:-1], gone
    for name in names:
        assert _iteration_of(f"/save/{name}/") == parse_iteration(name), name


def _string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal of the module's code (f-string parts too), docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def _layout_spelled_outside(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [f"line {line}: {text!r}" for line, text in _string_constants(tree)
             if re.search(r"\.(incomplete|deleting|old)\b", text)]
    for node in ast.walk(tree):  # re.compile / re.match / ... of a pattern naming iter_
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                and any(isinstance(a, ast.Constant) and "iter_" in str(a.value)
                        for a in node.args)):
            found.append(f"line {node.lineno}: re.{node.func.attr} of an iter_ name")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != HOME)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_layout_spells_the_suffixes_or_parses_iter_names(path):
    offenders = _layout_spelled_outside(path)
    assert not offenders, (f"{path.relative_to(PACKAGE.parent)} spells the on-disk layout "
                           f"itself: {offenders}. Use save/layout.py's names (INCOMPLETE, "
                           "DELETING, OLD, suffixed, leftovers) and parse_iteration instead")


def test_the_scan_sees_what_it_forbids(tmp_path):
    """The scan flags a suffix literal, an f-string part and a regex, not a docstring."""
    source = ('"""iter_N.incomplete in a docstring is prose."""\nimport re\n'
              'A = ".deleting"\nB = f"{x}.old"\nC = re.compile(r"iter_(\\d{7})")\n')
    tree_file = tmp_path / "m.py"
    tree_file.write_text(source)
    assert [f.split(":")[0] for f in _layout_spelled_outside(tree_file)] == [
        "line 3", "line 4", "line 5"]


# -- one manifest check --------------------------------------------------------------------------
def _checkpoint(root: Path, iteration: int, *, manifest_for: int | None = None) -> Path:
    path = checkpoint_name(root, iteration)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    (path / "metadata.json").write_text("{}")
    manifest.write_marker(path, iteration)
    manifest.write_manifest(path, iteration if manifest_for is None else manifest_for)
    return path


def test_the_load_and_verify_judge_a_manifest_alike(tmp_path, capsys):
    """Each way a manifest cannot be trusted: the shared check's kind, the load's problem text,
    and ``verify``'s exit code and lines."""
    ok = _checkpoint(tmp_path / "ok", 3)
    assert check_manifest(ok).kind == "" and check_manifest(ok).manifest["iteration"] == 3
    other = _checkpoint(tmp_path / "other", 3, manifest_for=2)
    damaged = _checkpoint(tmp_path / "damaged", 3)
    (damaged / manifest.MANIFEST).write_text(json.dumps({"format": "unknown"}))
    missing = _checkpoint(tmp_path / "missing", 3)
    (missing / manifest.MANIFEST).unlink()
    stock = _checkpoint(tmp_path / "stock", 3)
    (stock / manifest.MANIFEST).unlink()
    (stock / manifest.MARKER).unlink()
    cases = {other: ("iteration", f"{manifest.MANIFEST}: written for iteration 2, not 3", ""),
             damaged: ("damaged", f"{manifest.MANIFEST} has no known format",
                       "the manifest is damaged"),
             missing: ("missing", f"{manifest.MANIFEST}: missing, but megatron-ckpt-ext wrote",
                       f"restore {manifest.MANIFEST}")}
    for path, (kind, problem, fix) in cases.items():
        check = check_manifest(path)
        assert check.kind == kind and check.problem.startswith(problem), check
        assert verify_cli.run(str(path)) == 1
        out, err = capsys.readouterr()
        assert out.startswith(f"BAD {path / manifest.MANIFEST}: "), out
        assert out.count(manifest.MANIFEST) == 1 and out.endswith(
            check.why.split(manifest.MANIFEST, 1)[-1].removeprefix(":").lstrip() + "\n"), out
        assert (fix in err) if fix else err == "", err
    assert verify_cli.check_manifest is check_manifest  # one check, not a copy
    assert check_manifest(stock).manifest is None and not check_manifest(stock).kind
    assert verify_cli.run(str(stock)) == 2
    assert verify_cli.run(str(ok)) == 0
    assert capsys.readouterr().out.startswith(f"OK {ok}: 3 files")
