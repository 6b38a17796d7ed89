"""Rank bodies for how run_ranks starts its ranks (a module of its own so ranks can import it)."""

from __future__ import annotations

import os


def sees(rank: int, world: int, name: str, value: str | None) -> None:
    assert os.environ.get(name) == value, (rank, name, os.environ.get(name))


def imported_once(rank: int, world: int) -> None:
    """megatron-core came with the fork (the server preloaded it), not imported by this rank."""
    import sys

    assert "megatron.core.dist_checkpointing" in sys.modules
