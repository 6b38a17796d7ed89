"""The first save planned ahead in prepare()'s background thread, on every rank (gloo)."""

from __future__ import annotations

import pytest

from . import _plan_ahead_workers as w
from tests._support.dist import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(200)]


@pytest.mark.parametrize("fail_rank,fully_parallel", [(-1, False), (1, False), (-1, True)],
                         ids=["every-rank-plans", "rank-1-fails", "fully-parallel-save"])
def test_the_first_save_finds_its_plan_made_ahead_on_every_rank_or_on_none(tmp_path, fail_rank,
                                                                          fully_parallel):
    run_ranks(w.first_save_planned_ahead, args=(str(tmp_path), fail_rank, fully_parallel),
              timeout=150)


@pytest.mark.parametrize("preprocess", [True, False], ids=["megatrons-preprocessing", "none"])
def test_ranks_common_states_are_compared_after_megatrons_preprocessing(tmp_path, preprocess):
    run_ranks(w.common_state_compared_after_preprocessing, args=(str(tmp_path), preprocess),
              timeout=150)
