"""Validation rules: each warning and error, with the wording that names the flag."""

from __future__ import annotations

import logging

import pytest

from megatron_ckpt_ext.options import CkptOptions, CkptOptionsError
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
    from megatron_ckpt_ext import backend

    backend._reset_warnings_for_tests()
    opts = CkptOptions(async_ckpt_use_cpu_shm=True)
    with caplog.at_level(logging.WARNING):
        check(opts)
        check(opts)
    hits = [r for r in caplog.records if "has no effect without --async-save" in r.getMessage()]
    assert len(hits) == 1


def test_check_is_silent_off_rank0(caplog, monkeypatch):
    from megatron_ckpt_ext import backend

    backend._reset_warnings_for_tests()
    monkeypatch.setattr(backend, "rank", lambda: 1)
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
