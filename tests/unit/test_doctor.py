"""The doctor CLI: versions, one row per feature, exit 0, --json for machines."""

from __future__ import annotations

import dataclasses
import json

from megatron_ckpt_ext import backend, doctor
from megatron_ckpt_ext.__main__ import main

STATUSES = {"available", "fallback", "missing"}


def _row(caps, feature):
    return next(r for r in doctor.rows(caps) if r.feature == feature)


def test_text_report_lists_versions_and_every_feature(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    caps = backend.detect()
    for needle in ("python", "torch", "megatron-core", "nvidia-resiliency-ext", "CUDA available",
                   caps.torch_version, str(caps.mcore_version)):
        assert needle in out
    for row in doctor.rows(caps):
        assert row.feature in out


def test_json_report_is_machine_readable(capsys):
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    caps = backend.detect()
    assert data["capabilities"] == dataclasses.asdict(caps)
    assert data["backend"] == doctor.backend_key(caps)
    assert {r["status"] for r in data["features"]} <= STATUSES
    names = [r["feature"] for r in data["features"]]
    assert len(names) == len(set(names)) and {"cpu_shm_staging", "nvrx_cpu_shm_mode"} <= set(names)


def test_cpu_shm_rows_follow_nvrx_cpu_shm_mode():
    base = backend.detect()
    new = dataclasses.replace(base, async_provider="nvrx", queue_cpu_shm_mode=True, nvrx_version="0.7.0")
    old = dataclasses.replace(base, async_provider="nvrx", queue_cpu_shm_mode=False, nvrx_version="0.4.1")
    assert _row(new, "cpu_shm_staging").status == "available"
    assert _row(new, "nvrx_cpu_shm_mode").status == "available"
    assert _row(old, "cpu_shm_staging").status == "fallback"
    assert "ours (per-tensor shm staging)" in _row(old, "cpu_shm_staging").detail
    assert "0.4.1" in _row(old, "nvrx_cpu_shm_mode").detail
    assert _row(old, "nvrx_cpu_shm_mode").status == "missing"


def test_async_save_row_names_the_fallback():
    base = backend.detect()
    assert _row(dataclasses.replace(base, async_provider="mcore"), "async_save").status == "fallback"
    sync = _row(dataclasses.replace(base, async_provider="sync"), "async_save")
    assert sync.status == "fallback" and "synchronous" in sync.detail


def test_unusable_mcore_row_carries_the_reason():
    caps = dataclasses.replace(backend.detect(), mcore_dist_ckpt_importable=False,
                               mcore_error="upgrade nvidia-resiliency-ext to >= 0.6.0")
    row = _row(caps, "mcore_dist_ckpt")
    assert row.status == "missing" and "0.6.0" in row.detail
