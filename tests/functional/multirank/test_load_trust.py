"""What a load trusts, with two ranks: a damaged file that both ranks read is named once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.dist import run_ranks

from . import _load_trust_workers as lw


def _flip_bit(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_file_both_ranks_read_is_named_once(tmp_path):
    """Both ranks read (and judge) the file that holds a replicated tensor: one problem."""
    run_ranks(lw.save, world_size=2, timeout=120, args=(str(tmp_path),))
    bad = tmp_path / "iter_0000001" / "__0_0.distcp"  # rank 0 wrote the replicated "b"
    _flip_bit(bad, offset=len(bad.read_bytes()) // 2)
    run_ranks(lw.load_names_each_bad_file_once, world_size=2, timeout=120,
              args=(str(tmp_path), bad.name))


@pytest.mark.parametrize("local", [False, True], ids=["dcp_exchange", "local_plans"])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
def test_a_state_one_rank_cannot_load_fails_the_load_on_every_rank(tmp_path, verify, local):
    """Rank 1 builds a tensor the checkpoint lacks, rank 0's state fits. Whether torch DCP plans
    the load over the group (megatron-core <= 0.16: its collective raises on every rank) or on
    each rank alone (0.19: nothing tells rank 0), every rank raises the load error, none trains
    on from a load another rank refused, none waits for it (the spawn's timeout)."""
    run_ranks(lw.save, world_size=2, timeout=120, args=(str(tmp_path),))
    run_ranks(lw.load_where_one_rank_does_not_fit, world_size=2, timeout=120,
              args=(str(tmp_path), verify, local))


def test_a_storage_load_plans_on_each_rank_alone(tmp_path):
    """megatron-core <= 0.16 let torch DCP gather every rank's load plan to one rank and scatter
    it back (the global plan is the identity); the load now plans on each rank, as 0.19 does,
    and makes a failure on one rank every rank's itself (the test above)."""
    run_ranks(lw.save, world_size=2, timeout=120, args=(str(tmp_path),))
    run_ranks(lw.load_plans_on_each_rank, world_size=2, timeout=120, args=(str(tmp_path),))
