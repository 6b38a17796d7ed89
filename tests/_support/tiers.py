"""The test tiers, by directory: what ``-m unit``, ``-m functional`` and ``-m compat`` select.

tests/conftest.py marks every collected test from its path with these; pyproject.toml registers
the markers; tests/unit/test_layout_of_tests.py checks that every test file has exactly one tier.
"""

from __future__ import annotations

from pathlib import PurePath

__all__ = ["TIERS", "markers_for"]

# first directory under tests/ -> the tier marker of the tests in it
TIERS = {
    "unit": "unit",              # the package's modules and paths, mostly in-process
    "functional": "functional",  # multirank/: gloo ranks on localhost; e2e/: scripts, recipes
    "compat": "compat",          # the same checks against other backends (.ci/compat_matrix.sh)
}
# a directory whose tests spawn several ranks over gloo on localhost: marked ``multirank`` too
MULTIRANK_DIR = "multirank"


def markers_for(rel: PurePath) -> tuple[str, ...]:
    """The markers of the test file at ``rel`` (relative to tests/): its tier, then ``multirank``
    for the multi-rank tests; () for a file outside every tier."""
    parts = rel.parts
    if len(parts) < 2 or parts[0] not in TIERS:
        return ()
    extra = ("multirank",) if MULTIRANK_DIR in parts[:-1] else ()
    return (TIERS[parts[0]], *extra)
