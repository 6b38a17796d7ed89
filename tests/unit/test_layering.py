"""backend/ is the only code of the package that imports megatron-core, nvrx, Megatron-LM or
Megatron-FSDP, and the only user of ``inspect`` (docs: ARCHITECTURE, rules of the house)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ckpt_ext"
FORBIDDEN = ("megatron", "nvidia_resiliency_ext", "megatron_fsdp", "inspect")
IMPORTERS = {"import_module", "__import__", "find_spec"}


def _outside_backend() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "backend" not in p.relative_to(PACKAGE).parts)


def _forbidden(name: str) -> bool:
    return name.split(".")[0] in FORBIDDEN


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Absolute module names imported, by statement or by a literal ``importlib.import_module``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in IMPORTERS):
            found.append((node.lineno, node.args[0].value))
    return found


def test_the_package_has_modules_outside_backend():
    names = {p.name for p in _outside_backend()}
    assert {"checkpointer.py", "fsdp.py", "megatron_lm.py"} <= names


@pytest.mark.parametrize("path", _outside_backend(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_backend_imports_the_backends_or_inspect(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    offenders = [f"line {line}: {name}" for line, name in _imported_names(tree) if _forbidden(name)]
    assert not offenders, (f"{path.relative_to(PACKAGE.parent)} imports {offenders}: move that "
                           "read into megatron_ckpt_ext/backend/ and call it from there")
