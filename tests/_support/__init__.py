"""Helpers shared by the test tiers (unit, functional, compat); no tests here.

A test module imports from here or from a worker module of its own directory (``_*.py``, the rank
bodies that spawned processes import), never from ``tools/`` (lab scripts) or from another test
module (tests/unit/test_layout_of_tests.py holds this). A test of a ``tools/`` script loads that
script by its path, as the thing under test.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ROOT"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (tests do not depend on how deep they sit under tests/)."""
