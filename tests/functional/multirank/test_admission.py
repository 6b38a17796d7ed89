"""Node-level admission on real ranks: the node's sum of uneven ranks' staging (not one rank's
bytes times the local ranks) is checked before the first staging; over budget, every rank raises
InsufficientHostMemory and nothing is written; within it, the save commits; with
--ckpt-node-memory-fallback sync, the saves go synchronously instead."""

from __future__ import annotations

import os

import pytest

from tests._support.dist import run_ranks, world

from . import _admission_workers as aw


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["temporal", "persistent-shm"])
def test_the_node_sum_of_uneven_ranks_decides(tmp_path, mode):
    need = aw.staging_bytes(world())
    # rank 0 alone (64 KiB) times the ranks would fit in need - 1; the true sum does not
    run_ranks(aw.admit, timeout=120, args=(str(tmp_path / "short"), mode, need - 1))
    assert not (tmp_path / "short" / "iter_0000001").exists()
    run_ranks(aw.admit, timeout=120, args=(str(tmp_path / "fits"), mode, need))
    assert (tmp_path / "fits" / "iter_0000001").is_dir()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["temporal", "persistent-shm"])
def test_over_budget_with_the_sync_fallback_saves_synchronously(tmp_path, mode):
    need = aw.staging_bytes(world())
    run_ranks(aw.admit, timeout=120, args=(str(tmp_path), mode, need - 1, "sync"))
    assert (tmp_path / "iter_0000002").is_dir()


@pytest.mark.timeout(150)
def test_a_job_that_fits_only_without_an_ended_runs_snapshot_frees_it_and_saves(tmp_path):
    """A node whose /dev/shm outlived a job: the job after it (another save root) would not fit
    beside the snapshot that run kept; a snapshot kept for a restart never keeps a job from
    running, so its ranks free it (one warning) and save. Before: refused on every rank."""
    from megatron_ckpt_ext.staging.retained import discard, read_seal, seal_path
    from megatron_ckpt_ext.staging.segments import is_mapped

    old, new, ranks = tmp_path / "ended_run", tmp_path / "next_job", world()
    seals = [seal_path("/dev/shm", old, r) for r in range(ranks)]
    try:
        run_ranks(aw.seal_and_end, timeout=120, args=(str(old),))
        assert all(os.path.exists(s) for s in seals)
        run_ranks(aw.admit_beside_ended_snapshots, timeout=120, args=(str(new), 4096))
        assert not any(os.path.exists(s) for s in seals)
        assert (new / "iter_0000001").is_dir()
    finally:  # a failure leaves no snapshot of this test in the node's /dev/shm
        for seal in filter(None, map(read_seal, seals)):
            discard(seal, is_mapped=is_mapped)
