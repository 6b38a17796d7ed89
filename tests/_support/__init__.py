"""Helpers shared by the test tiers (unit, functional, compat); no tests here.

A test module imports from here or from a worker module of its own directory (``_*.py``, the rank
bodies that spawned processes import), never from ``tools/`` (lab scripts) or from another test
module (tests/unit/test_layout_of_tests.py holds this). A test of a ``tools/`` script loads that
script by its path, as the thing under test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["ROOT", "load_script"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (tests do not depend on how deep they sit under tests/)."""


def load_script(path: str, name: str, *, register: bool = False) -> ModuleType:
    """The script at ``path`` (relative to the repository root: a ``tools/``, ``scripts/`` or
    ``benchmarks/`` file under test) loaded as module ``name``; ``register``: also put in
    ``sys.modules`` under ``name`` first (kept if already there), for code that imports it by
    name (processes it spawns)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
