"""A Checkpointer closed on an error (a ``with`` block left on an exception) while the ranks are
at different points of their collectives, as a terminal's Ctrl-C leaves them: the close commits
only what every rank has written, each of its collectives bounded, so a rank's exit is never
held by a collective its peers will not make; the error raised stays the loop's own and the last
committed checkpoint stays the latest (docs/RELIABILITY.md, "Ctrl-C")."""

from __future__ import annotations

import json

import pytest

from megatron_ckpt_ext.save.layout import read_tracker
from megatron_ckpt_ext.verify_cli import run as verify

from . import _close_workers as w
from ._ckpt_workers import ASYNC_MODES
from tests._support.dist import run_ranks, world

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


@pytest.mark.parametrize("mode", list(ASYNC_MODES))
def test_a_rank_closing_on_an_error_is_not_held_by_a_peer_that_is_elsewhere(mode, tmp_path):
    if world() < 2:
        pytest.skip("needs two ranks")
    root = tmp_path / "ckpt"
    late_s, cap_s = 12.0, 1.0
    run_ranks(w.error_at_another_point, args=(str(root), ASYNC_MODES[mode], late_s, cap_s,
                                              str(tmp_path)))
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["raised"] == "rank 0"  # the loop's own error, not the close's
    assert first["close_s"] < late_s / 2  # not until the late rank came (the drain's wait)
    assert read_tracker(root) == 1  # save 2 was abandoned, never committed
    assert not (root / "iter_0000002").exists()
    assert verify(str(root)) == 0  # the tracker's checkpoint
