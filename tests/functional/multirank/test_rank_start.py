"""How run_ranks starts its ranks (tests/_support/dist.py): forks of a server that imported torch
and megatron-core once, each given the caller's environment of the moment (not the server's at
its start)."""

from __future__ import annotations

import pytest

from . import _rank_start_workers as w
from tests._support.dist import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]

PROBE = "MCX_TEST_RANK_START_PROBE"


def test_ranks_see_the_callers_environment_of_the_moment(monkeypatch):
    monkeypatch.delenv(PROBE, raising=False)
    run_ranks(w.sees, args=(PROBE, None), timeout=60)  # the server runs from here on
    monkeypatch.setenv(PROBE, "set after the server started")
    run_ranks(w.sees, args=(PROBE, "set after the server started"), timeout=60)
    monkeypatch.delenv(PROBE)
    run_ranks(w.sees, args=(PROBE, None), timeout=60)


def test_ranks_start_with_megatron_core_imported(monkeypatch):
    monkeypatch.delenv("MCX_TEST_START_METHOD", raising=False)
    run_ranks(w.imported_once, timeout=60)


def test_ranks_on_cuda_start_as_fresh_interpreters(monkeypatch):
    """A server that imported megatron-core has initialized CUDA, and a fork of it cannot use
    CUDA: with MCX_TEST_DEVICE=cuda ranks are spawned (scripts/gpu_tests.sh)."""
    from tests._support import dist

    monkeypatch.delenv("MCX_TEST_START_METHOD", raising=False)
    monkeypatch.setenv("MCX_TEST_DEVICE", "cuda")
    assert dist._start_method() == "spawn"
    monkeypatch.setenv("MCX_TEST_START_METHOD", "forkserver")
    assert dist._start_method() == "forkserver"  # asked for: as asked
