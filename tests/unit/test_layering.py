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


def _package_imports() -> dict[str, set[str]]:
    """Each package module -> the package modules it imports (any level, TYPE_CHECKING too)."""
    pkg = Path(__file__).resolve().parents[2] / "megatron_ckpt_ext"
    files = {".".join(p.relative_to(pkg).with_suffix("").parts).removesuffix(".__init__")
             .removesuffix("__init__"): p for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        here = [h for h in here if h]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here[:len(here) - (node.level - 1)]
                names = [node.module] if node.module else [a.name for a in node.names]
                deps.update(".".join([*base, *n.split(".")]) for n in names)
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def test_no_import_circle_in_the_package():
    graph = _package_imports()
    state: dict[str, int] = {}

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            assert state.get(dep) != 1, f"import circle: {' -> '.join([*path, dep])}"
            if dep not in state:
                visit(dep, [*path, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])


@pytest.mark.parametrize("path", _outside_backend(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_outside_backend_only_the_backends_public_names_are_used(path):
    """backend/ is one room behind one door: other modules use the names its ``__init__``
    exports, never a submodule of it (``..backend.load_reader``) nor a private name
    (``backend._x``), so backend/ can be rearranged without touching the rest."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if "backend" in parts and parts.index("backend") < len(parts) - 1:
                bad.append((node.lineno, f"from {'.' * node.level}{node.module} import ..."))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "backend" and node.attr.startswith("_")):
            bad.append((node.lineno, f"backend.{node.attr}"))
    assert not bad, f"{path.relative_to(PACKAGE)} reaches into backend/: {bad}"
