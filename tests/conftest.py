"""Shared fixtures, and the tier markers applied by path. Tests run on CPU-only torch; nothing
here needs a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests._support.tiers import markers_for

_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker from where it sits (tests/unit -> unit, tests/functional
    -> functional, tests/compat -> compat; multi-rank tests also ``multirank``), so ``-m TIER``
    selects exactly that tier (tests/_support/tiers.py)."""
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(_TESTS):
            for name in markers_for(path.relative_to(_TESTS)):
                item.add_marker(name)


@pytest.fixture
def caps_factory():
    """Real backend capabilities with chosen fields overridden (pins validation branches)."""
    from megatron_ckpt_ext import backend

    def make(**overrides):
        return dataclasses.replace(backend.detect(), **overrides)

    return make


@pytest.fixture()
def one_rank_group():
    """A gloo process group of one rank in the test process (megatron-core's save and load need
    one), torn down after the test."""
    from datetime import timedelta

    import torch.distributed as dist

    from tests._support.dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()
