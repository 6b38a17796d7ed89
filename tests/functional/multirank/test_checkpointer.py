"""Checkpointer on 2 gloo ranks (CPU): round trips in every mode, no forked writers, crash before
commit, interop with stock megatron-core and plain torch DCP, clean close."""

from __future__ import annotations


import pytest
import torch

from megatron_ckpt_ext.backend.detection import detect

from . import _ckpt_workers as w
from tests._support.dist import device, run_ranks, world

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]

MODES = {
    "sync": {},
    "sync-workers2": {"dist_ckpt_workers": 2},
    "sync-no-fully-parallel-save": {"ckpt_fully_parallel_save": False},
    "async-temporal": {"async_save": True},
    "async-persistent": {"async_save": True, "use_persistent_ckpt_worker": True},
    "async-workers2": {"async_save": True, "dist_ckpt_workers": 2},
    "async-fully-parallel-load": {"async_save": True, "ckpt_fully_parallel_load": True},
    "async-constant-structure": {"async_save": True, "ckpt_assume_constant_structure": True},
    # cpu-shm without constant structure: a fresh buffer set per save, freed at its commit
    "async-temporal-cpu-shm": {"async_save": True, "async_ckpt_use_cpu_shm": True},
    "async-persistent-cpu-shm": {"async_save": True, "use_persistent_ckpt_worker": True,
                                 "async_ckpt_use_cpu_shm": True},
    "async-persistent-cpu-shm-constant": {"async_save": True, "use_persistent_ckpt_worker": True,
                                          "async_ckpt_use_cpu_shm": True,
                                          "ckpt_assume_constant_structure": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_roundtrip_is_bit_exact_and_holds_each_saves_own_values(mode, tmp_path):
    run_ranks(w.roundtrip, args=(str(tmp_path), MODES[mode], 3), timeout=180)


def test_one_writer_forks_no_writer_process_and_two_do(tmp_path):
    run_ranks(w.count_forks_during_sync_save, args=(str(tmp_path / "a"), {}, str(tmp_path)))
    assert [int((tmp_path / f"forks{r}").read_text()) for r in range(world())] == [0] * world()
    run_ranks(w.count_forks_during_sync_save,
              args=(str(tmp_path / "b"), {"dist_ckpt_workers": 2}, str(tmp_path)))
    # a writer with an I/O mode to choose (nvrx >= 0.5's is_multiproc_io, off by default: the
    # megatron-core 0.19 stack) writes N > 1 buckets on threads; one without it forks per bucket
    if not detect().writer_multiproc_io:
        assert all(int((tmp_path / f"forks{r}").read_text()) > 0 for r in range(world()))


@pytest.mark.parametrize("mode", ["sync", "async-temporal", "async-persistent"])
def test_failure_before_commit_keeps_previous_checkpoint_latest(mode, tmp_path):
    run_ranks(w.crash_before_commit, args=(str(tmp_path), MODES[mode]))


@pytest.mark.parametrize("mode", ["sync", "async-persistent-cpu-shm-constant"])
def test_checkpoint_loads_with_stock_megatron_core_and_plain_torch_dcp(mode, tmp_path):
    run_ranks(w.save_for_interop, args=(str(tmp_path), MODES[mode]))
    run_ranks(w.stock_load, args=(str(tmp_path),))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "iter_0000003"), str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    for key in ("w", "b", "step"):
        full = torch.cat([w.step_state(3, r)[key].cpu() for r in range(world())])
        assert torch.equal(plain[key], full), key


@pytest.mark.parametrize("mode", ["async-temporal", "async-persistent"])
def test_close_leaves_no_child_process_and_is_idempotent(mode, tmp_path):
    run_ranks(w.close_cleans_up, args=(str(tmp_path / "ck"), MODES[mode], str(tmp_path)))
    assert [(tmp_path / f"alive{r}").read_text() for r in range(world())] == [""] * world()


@pytest.mark.parametrize("mode,switch,frozen", [
    ("async-persistent-cpu-shm-constant", None, True),
    ("async-persistent-cpu-shm-constant", "0", False),
    ("async-temporal", None, False),
])
def test_trainer_objects_are_frozen_only_while_a_forked_worker_shares_them(mode, switch, frozen,
                                                                          tmp_path, monkeypatch):
    """The forked persistent writer shares the trainer's pages; the trainer's objects are
    gc.freeze()-d so its full collections do not copy those pages (Checkpointer._freeze_gc).
    Garbage is collected first; close() unfreezes (unless something else had frozen objects
    before: unfreezing is all or nothing); MCX_FREEZE_GC_AT_FORK=0 and the temporal writer (no
    long-lived fork) freeze nothing."""
    if switch is not None:
        monkeypatch.setenv("MCX_FREEZE_GC_AT_FORK", switch)
    run_ranks(w.gc_frozen_while_worker_forked, args=(str(tmp_path / "ck"), MODES[mode], str(tmp_path)))
    for r in range(world()):
        words = (tmp_path / f"gc{r}").read_text().split()
        collected, (base, frozen_open, frozen_after) = words[0] == "True", map(int, words[1:])
        if frozen:
            assert collected, "garbage made before the Checkpointer was frozen"
            assert frozen_open > base + 1000, (base, frozen_open)
            # close() unfreezes (count 0) only where nothing else had frozen objects first; frozen
            # objects freed by refcount meanwhile leave the count, so no exact equality
            assert (frozen_after == 0) == (base == 0), ("close() must unfreeze ours, and only "
                                                        "ours", base, frozen_open, frozen_after)
        else:
            assert frozen_open == frozen_after == base, (base, frozen_open, frozen_after)


OVERLAP = {"async_save": True, "use_persistent_ckpt_worker": True, "async_ckpt_use_cpu_shm": True,
           "ckpt_assume_constant_structure": True, "ckpt_overlap_snapshot": True}


def test_overlapped_snapshot_returns_before_the_copies_and_the_optimizer_step_waits(tmp_path):
    run_ranks(w.overlap_roundtrip, args=(str(tmp_path / "ck"), OVERLAP, 3), timeout=200)


TRIAL_MODES = {
    "cpu-shm-persistent": {"async_save": True, "async_ckpt_use_cpu_shm": True,
                           "ckpt_assume_constant_structure": True, "use_persistent_ckpt_worker": True},
    "cpu-shm-temporal": {"async_save": True, "async_ckpt_use_cpu_shm": True,
                         "ckpt_assume_constant_structure": True},
    "no-shm-persistent": {"async_save": True, "ckpt_assume_constant_structure": True,
                          "use_persistent_ckpt_worker": True},
}


@pytest.mark.parametrize("mode", list(TRIAL_MODES))
def test_stale_and_dirty_data_trial_ten_async_saves(mode, tmp_path):
    run_ranks(w.stale_and_dirty_trial, args=(str(tmp_path), TRIAL_MODES[mode], 10), timeout=200)


@pytest.mark.skipif(device() != "cuda", reason="needs CUDA tensors (MCX_TEST_DEVICE=cuda)")
def test_cpu_shm_writer_holds_no_cuda_context(tmp_path):
    run_ranks(w.worker_cuda_contexts, args=(str(tmp_path / "a"), TRIAL_MODES["cpu-shm-persistent"], str(tmp_path)))
    children, with_ctx = (tmp_path / "ctx0").read_text().split("|")
    assert children != "[]", "expected a persistent writer process"
    assert with_ctx == "[]", f"writer processes with a CUDA context: {with_ctx}"
    # Contrast (recorded, not asserted): without cpu-shm the worker maps the tensors via CUDA IPC.
    run_ranks(w.worker_cuda_contexts, args=(str(tmp_path / "b"), TRIAL_MODES["no-shm-persistent"], str(tmp_path)))
    print("without cpu-shm, children|with CUDA context:", (tmp_path / "ctx0").read_text())


@pytest.mark.skipif(device() != "cuda", reason="megatron-core's shard exchange runs on CUDA")
def test_fully_parallel_load_exchanges_replicated_shards(tmp_path):
    run_ranks(w.replicated_fully_parallel_load, args=(str(tmp_path),))


@pytest.mark.parametrize("mode", ["sync", "async-persistent-cpu-shm-constant"])
def test_unwritable_root_raises_on_every_rank_before_staging(mode, tmp_path):
    root = tmp_path / "afile" / "ckpt"
    run_ranks(w.unwritable_root, args=(str(root), MODES[mode]), timeout=120)


@pytest.mark.parametrize("keep_clones", [False, True])
def test_staged_copies_are_waited_for_before_the_writer_gets_them(keep_clones, tmp_path):
    """save() plans and hands the request over while the device copies run, then waits for them;
    where the writer's planning clones the staged tensors (clones kept), it waits before
    planning."""
    run_ranks(w.copy_wait_order, args=(str(tmp_path / "ck"), TRIAL_MODES["cpu-shm-temporal"],
                                       keep_clones), timeout=200)


@pytest.mark.skipif(world() < 2, reason="one rank changes its structure while another does not")
@pytest.mark.parametrize("mode", ["cpu-shm-temporal", "constant-sync"])
def test_structure_change_on_one_rank_replans_and_validates_on_every_rank(mode, tmp_path):
    options = {"constant-sync": {"ckpt_assume_constant_structure": True}}.get(mode) or TRIAL_MODES[mode]
    run_ranks(w.one_rank_changes_structure, args=(str(tmp_path / "ck"), options), timeout=200)


@pytest.mark.parametrize("mode", ["cpu-shm-temporal", "cpu-shm-persistent"])
def test_writer_writes_only_after_the_staged_copies_are_published(mode, tmp_path):
    run_ranks(w.late_copies_roundtrip, args=(str(tmp_path / "ck"), TRIAL_MODES[mode], 3),
              timeout=200)


@pytest.mark.skipif(world() < 2, reason="needs a slow rank and a fast one")
def test_every_rank_reports_the_slowest_ranks_times_and_the_sum_of_bytes(tmp_path):
    run_ranks(w.slowest_rank_report, args=(str(tmp_path / "ck"), MODES["async-temporal-cpu-shm"],
                                           0.8), timeout=150)


@pytest.mark.parametrize("mode", ["sync-constant-structure", "async-persistent-cpu-shm-constant"])
def test_shape_change_under_constant_structure_saves_and_loads_each_shape(mode, tmp_path):
    options = MODES.get(mode) or {"ckpt_assume_constant_structure": True}
    run_ranks(w.shape_change_roundtrip, args=(str(tmp_path / "ck"), options), timeout=180)
