"""Validation rules: each warning and error, with the wording that names the flag."""

from __future__ import annotations

import logging

import pytest

from megatron_ckpt_ext import _runtime
from megatron_ckpt_ext.errors import CkptOptionsError
from megatron_ckpt_ext.options import CkptOptions
from megatron_ckpt_ext.validation import check, validate


def codes(options, caps=None):
    return {f.code: f for f in validate(options, caps)}


def test_defaults_have_no_findings():
    assert validate(CkptOptions()) == []


def test_recommended_combination_has_no_findings():
    assert validate(CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                                ckpt_assume_constant_structure=True)) == []


def test_async_with_several_workers_warns_and_names_the_flag():
    f = codes(CkptOptions(async_save=True, dist_ckpt_workers=2))["async-forked-writers"]
    assert f.level == "warning" and "--dist-ckpt-workers 2" in f.message and "--dist-ckpt-workers 1" in f.message


def test_several_workers_without_async_is_fine():
    assert "async-forked-writers" not in codes(CkptOptions(dist_ckpt_workers=4))


def test_cpu_shm_without_constant_structure_warns_about_cost():
    f = codes(CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True))["shm-not-reused"]
    assert "--ckpt-assume-constant-structure" in f.message and "costly" in f.message


def test_cpu_shm_without_async_has_no_effect():
    found = codes(CkptOptions(async_ckpt_use_cpu_shm=True))
    assert "--async-save" in found["shm-no-effect"].message
    assert "shm-not-reused" not in found  # one message, not two, for the same mistake


def test_persistent_worker_without_async_has_no_effect():
    assert "persistent-no-effect" in codes(CkptOptions(use_persistent_ckpt_worker=True))


def test_priorities_without_async_have_no_effect():
    f = codes(CkptOptions(async_ckpt_io_priority=3))["priority-no-effect"]
    assert "--async-ckpt-io-priority" in f.message


def test_check_warns_once_on_rank0(caplog):
    _runtime._reset_warnings_for_tests()
    opts = CkptOptions(async_ckpt_use_cpu_shm=True)
    with caplog.at_level(logging.WARNING):
        check(opts)
        check(opts)
    hits = [r for r in caplog.records if "has no effect without --async-save" in r.getMessage()]
    assert len(hits) == 1


def test_check_is_silent_off_rank0(caplog, monkeypatch):
    _runtime._reset_warnings_for_tests()
    monkeypatch.setattr(_runtime, "rank", lambda: 1)
    with caplog.at_level(logging.WARNING):
        check(CkptOptions(async_ckpt_use_cpu_shm=True))
    assert not [r for r in caplog.records if "--async-save" in r.getMessage()]


def test_check_raises_all_errors_in_one_exception(caps_factory):
    caps = caps_factory(cuda_available=False, mcore_dist_ckpt_importable=False,
                        mcore_error="mcore 0.19.2 with nvrx 0.4.1: upgrade nvrx or uninstall it")
    with pytest.raises(CkptOptionsError) as e:
        check(CkptOptions(fsdp_use_symm_mem=True), caps)
    msg = str(e.value)
    assert "--fsdp-use-symm-mem needs CUDA" in msg and "upgrade nvrx or uninstall it" in msg


# -- rules that consult the installed backend (real Capabilities, fields overridden) ----------
ASYNC = dict(async_save=True)


def test_nvrx_provider_needs_no_async_warning(caps_factory):
    assert validate(CkptOptions(**ASYNC), caps_factory(async_provider="nvrx")) == []


def test_async_without_nvrx_falls_back_to_mcore_with_a_warning(caps_factory):
    caps = caps_factory(async_provider="mcore", nvrx_error="No module named 'nvidia_resiliency_ext'",
                        mcore_version="0.16.1")
    f = codes(CkptOptions(**ASYNC), caps)["async-via-mcore"]
    assert "--async-save" in f.message and "megatron-core 0.16.1" in f.message


def test_async_without_any_provider_runs_synchronously_with_a_warning(caps_factory):
    f = codes(CkptOptions(**ASYNC), caps_factory(async_provider="sync"))["async-unavailable"]
    assert "saves run synchronously" in f.message and "nvidia-resiliency-ext" in f.message


def test_no_async_no_provider_warning(caps_factory):
    assert validate(CkptOptions(), caps_factory(async_provider="sync")) == []


def test_persistent_worker_missing_names_flag_and_upgrade(caps_factory):
    caps = caps_factory(queue_persistent=False, nvrx_version="0.3.0")
    f = codes(CkptOptions(use_persistent_ckpt_worker=True, **ASYNC), caps)["persistent-unsupported"]
    assert "--use-persistent-ckpt-worker" in f.message and "0.3.0" in f.message and "Upgrade" in f.message


def test_cpu_shm_on_gpu_with_old_nvrx_warns_worker_keeps_cuda(caps_factory):
    caps = caps_factory(cuda_available=True, queue_persistent=True, queue_cpu_shm_mode=False, nvrx_version="0.4.1")
    opts = CkptOptions(async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True,
                       use_persistent_ckpt_worker=True, **ASYNC)
    f = codes(opts, caps)["shm-worker-cuda-context"]
    assert "--async-ckpt-use-cpu-shm" in f.message and "0.4.1" in f.message and ">= 0.7.0" in f.message
    assert "shm-worker-cuda-context" not in codes(opts, caps_factory(
        cuda_available=True, queue_persistent=True, queue_cpu_shm_mode=True))


def test_unsupported_priorities_warn(caps_factory):
    f = codes(CkptOptions(async_ckpt_cpu_priority=5, **ASYNC), caps_factory(queue_priorities=False))
    assert "priority-unsupported" in f
    assert "priority-unsupported" not in codes(CkptOptions(async_ckpt_cpu_priority=5, **ASYNC),
                                               caps_factory(queue_priorities=True))


def test_constant_structure_without_cached_metadata_warns(caps_factory):
    f = codes(CkptOptions(ckpt_assume_constant_structure=True), caps_factory(strategy_cached_metadata=False))
    assert "--ckpt-assume-constant-structure" in f["cached-metadata-unsupported"].message


def test_symm_mem_on_cpu_is_an_error(caps_factory):
    f = codes(CkptOptions(fsdp_use_symm_mem=True), caps_factory(cuda_available=False))["symm-mem-needs-cuda"]
    assert f.level == "error" and "--fsdp-use-symm-mem" in f.message


def test_symm_mem_without_backend_support_warns(caps_factory):
    f = codes(CkptOptions(fsdp_use_symm_mem=True), caps_factory(cuda_available=True, fsdp_symm_mem=False))
    assert f["symm-mem-unsupported"].level == "warning"


def test_unusable_dist_checkpointing_is_a_start_up_error(caps_factory):
    caps = caps_factory(mcore_dist_ckpt_importable=False, mcore_error="megatron-core 0.19.2 with nvidia-resiliency-ext 0.4.1 ...")
    f = codes(CkptOptions(), caps)["mcore-dist-ckpt-unusable"]
    assert f.level == "error" and "0.19.2" in f.message


def test_fully_parallel_load_on_cpu_falls_back_with_a_warning(caps_factory):
    f = codes(CkptOptions(ckpt_fully_parallel_load=True), caps_factory(cuda_available=False))
    assert "--ckpt-fully-parallel-load" in f["fully-parallel-load-needs-cuda"].message
    assert "fully-parallel-load-needs-cuda" not in codes(CkptOptions(ckpt_fully_parallel_load=True),
                                                         caps_factory(cuda_available=True))


def test_overlap_snapshot_names_each_missing_flag(caps_factory):
    f = codes(CkptOptions(ckpt_overlap_snapshot=True, **ASYNC))["overlap-snapshot-no-effect"]
    assert "--async-ckpt-use-cpu-shm" in f.message and "--use-persistent-ckpt-worker" in f.message
    assert "--async-save" not in f.message.split("without")[1].split(":")[0]
    f = codes(CkptOptions(ckpt_overlap_snapshot=True))["overlap-snapshot-no-effect"]
    assert "--async-save, --async-ckpt-use-cpu-shm, --use-persistent-ckpt-worker" in f.message


def test_overlap_snapshot_complete_is_clean_on_cuda_and_warned_without(caps_factory):
    opts = CkptOptions(ckpt_overlap_snapshot=True, async_ckpt_use_cpu_shm=True,
                       ckpt_assume_constant_structure=True, use_persistent_ckpt_worker=True, **ASYNC)
    cuda = caps_factory(cuda_available=True, queue_persistent=True, queue_cpu_shm_mode=True)
    assert not {c for c in codes(opts, cuda) if c.startswith("overlap")}
    f = codes(opts, caps_factory(cuda_available=False, queue_persistent=True))["overlap-snapshot-no-cuda"]
    assert "--ckpt-overlap-snapshot" in f.message and "Drop the flag" in f.message


@pytest.mark.parametrize("given,fix", [
    ({}, "add --async-save and --async-ckpt-use-cpu-shm"),
    ({"async_save": True}, "add --async-ckpt-use-cpu-shm"),
    ({"async_save": True, "async_ckpt_use_cpu_shm": True, "ckpt_memory_restore": False},
     "drop --no-ckpt-memory-restore"),
])
def test_two_snapshot_sets_without_the_memory_tier_is_an_error_naming_the_fix(given, fix):
    f = codes(CkptOptions(ckpt_memory_snapshot_sets=2, **given))["snapshot-sets-need-memory-tier"]
    assert f.level == "error" and "--ckpt-memory-snapshot-sets 2" in f.message and fix in f.message


@pytest.mark.parametrize("given,fix", [
    ({}, "add --async-save and --async-ckpt-use-cpu-shm"),
    ({"async_save": True, "async_ckpt_use_cpu_shm": True, "ckpt_memory_restore": False},
     "drop --no-ckpt-memory-restore"),
])
def test_partner_copies_without_the_memory_tier_is_an_error_naming_the_fix(given, fix):
    f = codes(CkptOptions(ckpt_memory_partner=True, **given))["partner-needs-memory-tier"]
    assert f.level == "error" and "--ckpt-memory-partner" in f.message and fix in f.message
    assert validate(CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                                ckpt_assume_constant_structure=True,
                                ckpt_memory_partner=True)) == []


def test_two_snapshot_sets_with_the_memory_tier_is_fine():
    assert validate(CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                                ckpt_assume_constant_structure=True,
                                ckpt_memory_snapshot_sets=2)) == []
