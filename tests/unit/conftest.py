"""Fixtures of the unit tests of a restore from memory prepared ahead (tests/_support)."""

from tests._support.prepared_restore import pool, sealed  # noqa: F401  (fixtures)
