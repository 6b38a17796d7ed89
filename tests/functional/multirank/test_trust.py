"""Input that looked valid but hung a save until --ckpt-timeout, or lost other ranks' tensors."""

from __future__ import annotations

import pytest

from tests._support.dist import run_ranks, world
from ._trust_workers import nothing_to_write_commits, plain_tensor_on_one_rank_fails_everywhere

pytestmark = pytest.mark.multirank

MODES = {
    "sync": {},
    "temporal": {"async_save": True},
    "persistent": {"async_save": True, "use_persistent_ckpt_worker": True},
    "persistent-cpu-shm": {"async_save": True, "use_persistent_ckpt_worker": True,
                           "async_ckpt_use_cpu_shm": True, "ckpt_assume_constant_structure": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_rank_with_nothing_to_write_commits_promptly(tmp_path, mode):
    # ckpt_timeout far above the bound: a save that waits for it fails the bound, not the timeout
    options = {**MODES[mode], "ckpt_timeout": 600, "ckpt_fully_parallel_save": False}
    run_ranks(nothing_to_write_commits, timeout=180, args=(str(tmp_path / "ckpt"), options, 30.0))


@pytest.mark.parametrize("mode", ["sync", "persistent-cpu-shm"])
def test_a_plain_tensor_on_one_rank_fails_every_rank_naming_it(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(plain_tensor_on_one_rank_fails_everywhere, timeout=180,
              args=(str(tmp_path / "ckpt"), MODES[mode], str(out)))
    last = world() - 1
    mine = (out / f"error{last}").read_text()
    assert "'extra.bias'" in mine and "(3,)" in mine and "ShardedTensor.from_rank_offsets" in mine
    for rank in range(last):  # the others name the rank (one GPU: a world of one, no others)
        other = (out / f"error{rank}").read_text()
        assert f"rank {last}" in other and "Nothing was written" in other
