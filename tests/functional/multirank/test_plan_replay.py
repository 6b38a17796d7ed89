"""Steady saves replaying megatron-core's plan on every rank (gloo): backend/replay.py."""

from __future__ import annotations

import pytest

from . import _replay_workers as w
from tests._support.dist import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(200)]


@pytest.mark.parametrize("fully_parallel,change_rank", [(False, 1), (True, -1)],
                         ids=["one-rank-plans-in-full", "fully-parallel-save"])
def test_every_rank_replays_and_a_rank_that_plans_in_full_waits_for_none(tmp_path,
                                                                        fully_parallel,
                                                                        change_rank):
    run_ranks(w.steady_saves_replay, args=(str(tmp_path), fully_parallel, change_rank),
              timeout=150)
