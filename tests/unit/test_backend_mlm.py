"""Seam detection for megatron.training (backend.megatron_training_seams).

megatron.training of megatron-core 0.19.2 does not import on this CPU machine (its import chain
needs triton), so the seams are tested against signatures recorded from the real sources:
``RECORDED`` (tests/_support/mlm_seams.py) holds, per Megatron-LM release, each seam function's
parameters and the names its code looks up. ``test_recording_matches_real_sources`` re-extracts them (with ``ast``) from
the unpacked 0.19.2 wheel and the Megatron-LM mirror's release branches when those are present,
so the recording cannot drift from the sources. Stand-in modules are then built from the
recording (real functions with those signatures and lookups) and probed by the same
``inspect``-based code the adapter runs on a GPU machine.
"""

from __future__ import annotations

import types

import pytest

from megatron_ckpt_ext import backend
from tests._support.mlm_seams import (MIRROR, PROBED, RECORDED, WHEEL_0192, extract,
                                      extract_release, git_show, modules_from, wheel_reader)


# -- tests ---------------------------------------------------------------------------------------
def test_recording_matches_real_sources_of_the_0_19_2_wheel():
    real = extract_release(wheel_reader)
    if real is None:
        pytest.skip(f"megatron-core 0.19.2 sources not unpacked at {WHEEL_0192} (MCORE0192_DIR)")
    assert real == RECORDED["0.19.2"]


def test_recording_matches_mirror_branch_core_r0_19_0():
    real = extract_release(lambda p: git_show("core_r0.19.0", p))
    if real is None:
        pytest.skip(f"Megatron-LM mirror not at {MIRROR} (MLM_MIRROR: a git clone of Megatron-LM)")
    assert real == RECORDED["0.19.2"]


def test_0_19_2_has_every_seam_and_is_parse_then_pretrain():
    seams = backend.megatron_training_seams(modules=modules_from(RECORDED["0.19.2"]))
    assert seams.ok, seams.describe_problem()
    assert seams.missing == ()
    assert seams.pretrain_extra_args_provider is False
    assert seams.parse_args_fn == "arguments.parse_and_validate_args"
    assert seams.persistent_worker_init is True


def test_0_16_pretrain_takes_extra_args_provider_from_the_real_branch():
    real = extract_release(lambda p: git_show("core_r0.16.0", p))
    if real is None:
        pytest.skip(f"Megatron-LM mirror not at {MIRROR} (MLM_MIRROR: a git clone of Megatron-LM)")
    seams = backend.megatron_training_seams(modules=modules_from(real))
    assert seams.pretrain_extra_args_provider is True
    assert seams.parse_args_fn == "arguments.parse_args"  # 0.16 has no parse_and_validate_args
    assert seams.ok, seams.describe_problem()


@pytest.mark.parametrize(("short", "name"), [
    ("checkpointing", "schedule_async_save"),
    ("training", "maybe_finalize_async_save"),
    ("async_utils", "is_empty_async_queue"),
])
def test_a_missing_seam_is_named(short, name):
    mods = modules_from(RECORDED["0.19.2"])
    delattr(mods[short], name)
    seams = backend.megatron_training_seams(modules=mods)
    assert not seams.ok
    assert seams.missing == (f"megatron.training.{short}.{name} (absent)",)
    assert f"megatron.training.{short}.{name}" in seams.describe_problem()


def test_save_checkpoint_that_no_longer_calls_dist_checkpointing_is_a_missing_seam():
    recording = {k: dict(v) for k, v in RECORDED["0.19.2"].items()}
    params, _ = recording["checkpointing"]["save_checkpoint"]
    recording["checkpointing"]["save_checkpoint"] = [params, ["schedule_async_save"]]
    seams = backend.megatron_training_seams(modules=modules_from(recording))
    assert seams.missing == ("megatron.training.checkpointing.save_checkpoint "
                             "(does not look up dist_checkpointing)",)


def test_dist_checkpointing_without_save_is_a_missing_seam():
    mods = modules_from(RECORDED["0.19.2"])
    mods["checkpointing"].dist_checkpointing = types.ModuleType("stub")
    seams = backend.megatron_training_seams(modules=mods)
    assert seams.missing == ("megatron.training.checkpointing.dist_checkpointing (has no save/load)",)


def test_without_megatron_training_detection_reports_why_and_never_raises():
    seams = backend.megatron_training_seams()
    if backend.detect().megatron_training and seams.error is None:
        pytest.skip("megatron.training imports here")
    assert not seams.ok
    assert "megatron.training" in seams.error
    assert "cannot be imported" in seams.describe_problem()


def test_oldest_branches_without_async_utils_are_refused_by_name():
    real = {}
    for short, names in PROBED.items():
        source = git_show("core_r0.8.0", f"megatron/training/{short}.py")
        if source is None and not MIRROR.exists():
            pytest.skip(f"Megatron-LM mirror not at {MIRROR} (MLM_MIRROR: a git clone of Megatron-LM)")
        real[short] = extract(source, names) if source is not None else {}
    seams = backend.megatron_training_seams(modules=modules_from(real))
    assert not seams.ok
    assert any(m.startswith("megatron.training.async_utils.") for m in seams.missing), seams.missing
