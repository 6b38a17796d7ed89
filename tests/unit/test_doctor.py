"""The doctor CLI: versions, one row per feature, exit 0, --json for machines."""

from __future__ import annotations

import dataclasses
import json

import pytest

import megatron_ckpt_ext
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


def _full(**overrides):
    """Capabilities of a backend where the whole async path is available (nvrx >= 0.7 on CUDA)."""
    whole = dict(mcore_dist_ckpt_importable=True, async_provider="nvrx", nvrx_version="0.7.0",
                 queue_persistent=True, queue_cpu_shm_mode=True, cuda_available=True,
                 worker_needs_cuda=False)  # fixed: megatron-core 0.19.2 with nvrx 0.7.0 says True
    return dataclasses.replace(backend.detect(), **{**whole, **overrides})


def test_text_report_ends_with_the_one_line_verdict(capsys):
    assert main(["doctor"]) == 0
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert last == doctor.verdict(backend.detect()) and last.startswith("verdict: ")


def test_json_report_carries_the_verdict(capsys):
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == doctor.verdict(backend.detect())


def test_verdict_ok_when_the_async_path_is_whole():
    assert doctor.verdict(_full()) == "verdict: OK - async cpu-shm saves with a persistent worker available"


@pytest.mark.parametrize("overrides,says", [
    ({"async_provider": "sync"}, "--async-save saves synchronously"),
    ({"async_provider": "mcore", "nvrx_version": None}, "--async-save uses megatron-core's async path"),
    ({"queue_persistent": False}, "--use-persistent-ckpt-worker starts a fresh writer process per save"),
    ({"queue_cpu_shm_mode": False, "nvrx_version": "0.4.1"},
     "with --async-ckpt-use-cpu-shm the writer still initialises CUDA"),
])
def test_verdict_names_what_falls_back(overrides, says):
    line = doctor.verdict(_full(**overrides))
    assert line.startswith("verdict: OK with fallbacks - ") and says in line and "\n" not in line


def test_verdict_says_not_usable_without_dist_checkpointing():
    line = doctor.verdict(_full(mcore_dist_ckpt_importable=False, mcore_error="needs nvrx >= 0.6.0"))
    assert line == ("verdict: NOT USABLE - megatron-core dist_checkpointing cannot be imported: "
                    "needs nvrx >= 0.6.0")


@pytest.mark.parametrize("warmup", [True, False])
def test_doctor_agrees_with_the_readme_the_worker_starts_at_construction(warmup):
    # README: the Checkpointer "starts the writer now, not in save 1" (a warm-up request where
    # nvrx has no warmup_persistent_caller).
    for row in doctor.rows(_full(warmup_persistent_caller=warmup)):
        assert "first save" not in row.detail, row
    row = _row(_full(warmup_persistent_caller=False), "warmup_persistent_caller")
    assert "starts the persistent worker when the Checkpointer is built" in row.detail


@pytest.mark.parametrize("argv", [["--version"], ["doctor", "--version"]])
def test_version_prints_the_package_version(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"megatron-ckpt-ext {megatron_ckpt_ext.__version__}"


def _on_defaults(monkeypatch):
    from megatron_ckpt_ext.debug import ENV_SWITCHES

    for name in ENV_SWITCHES:
        monkeypatch.delenv(name, raising=False)


def test_a_debug_switch_off_its_default_is_listed_before_the_verdict(monkeypatch, capsys):
    _on_defaults(monkeypatch)
    monkeypatch.setenv("MCX_KEEP_CRC32", "1")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    listed = [i for i, line in enumerate(lines) if "MCX_" in line]
    assert len(listed) == 1 and lines[listed[0]].startswith("debug switch MCX_KEEP_CRC32=1 ")
    assert listed[0] < len(lines) - 1 and lines[-1].startswith("verdict: ")
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["debug_switches"] == {"MCX_KEEP_CRC32": "1"}


def test_no_debug_switch_is_listed_on_the_defaults(monkeypatch, capsys):
    _on_defaults(monkeypatch)
    monkeypatch.setenv("MCX_KEEP_CRC32", "0")  # set, but to its default
    assert main(["doctor"]) == 0
    assert "MCX_" not in capsys.readouterr().out
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["debug_switches"] == {}


def test_verdict_on_a_host_without_cuda_does_not_claim_cpu_shm_is_whole():
    line = doctor.verdict(_full(cuda_available=False, queue_cpu_shm_mode=False))
    assert "no CUDA here" in line and "cpu_shm_staging" in line, line


def test_the_report_names_the_crc32_in_use_and_how_to_get_the_fast_one(monkeypatch):
    """A host without the isal wheel verifies at zlib's rate: the doctor says so, with the
    fix."""
    from megatron_ckpt_ext import _crc

    monkeypatch.setattr(_crc, "IMPLEMENTATION", "isal")
    assert doctor.report()["crc32"].startswith("isal")
    monkeypatch.setattr(_crc, "IMPLEMENTATION", "zlib")
    data = doctor.report()
    assert data["crc32"].startswith("zlib") and "pip install isal" in data["crc32"]
    assert "CRC-32                 zlib" in doctor.format_text(data)
