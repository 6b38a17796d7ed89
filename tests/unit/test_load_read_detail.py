"""The load report's ``read_detail`` and ``verify_detail``. ``read_detail``: ``sums_wait_s``, the part of the read step spent after the
last read waiting for the sums (here the host's summing threads, made slow), so a report tells a
load bound by its checksums from one bound by its reads; ``sum_device_busy_s`` is 0 where no
device summed. ``verify_detail`` splits ``verify_s`` into its steps (the collective that learns
what every rank summed, this rank's share of the check, the verdict), and ``rank_phases`` is this
rank's own phases beside ``phases`` (each the slowest rank's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.backend import load_sums
from tests._support.dist import sharded

pytestmark = pytest.mark.unit


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
def test_a_verifying_load_reports_how_long_its_reads_waited_for_the_sums(tmp_path: Path,
                                                                         monkeypatch):
    state = {f"w{i}": torch.randn(1 << 16) for i in range(3)}  # 256 KiB each
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)
    real = load_sums.crc32

    def slow(data, *rest):  # noqa: ANN001
        if len(data) >= 1 << 18:  # the records' chunks, summed on the summing threads
            import time

            time.sleep(0.3)
        return real(data, *rest)

    monkeypatch.setattr(load_sums, "crc32", slow)
    with Checkpointer(CkptOptions(ckpt_load_threads=2)) as ck:
        got = ck.load(sharded(0, 1, {k: torch.zeros(1 << 16) for k in state}), tmp_path)
        report = ck.load_reports[-1]
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert report["verified"] is True
    detail = report["read_detail"]
    assert detail["sum_device_busy_s"] == 0.0
    # three chunks of 0.3 s on two summing threads: 0.6 s, the reads done long before
    assert 0.4 <= detail["sums_wait_s"] <= report["phases"]["read_s"] + 1e-6, report


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
def test_the_next_saves_preparation_after_a_load_is_its_own_phase(tmp_path: Path, monkeypatch):
    """What a load spends starting the next save's staging (``Checkpointer.prepare``: the node
    admission on its first call) is reported as ``prepare_save_s``, not hidden in ``load_s``."""
    state = {"w": torch.randn(1 << 10)}
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)
    real = Checkpointer.prepare

    def slow(self, *args, **kwargs):  # noqa: ANN001
        import time

        time.sleep(0.2)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "prepare", slow)
    with Checkpointer(CkptOptions()) as ck:
        ck.load(sharded(0, 1, {"w": torch.zeros(1 << 10)}), tmp_path)
        report = ck.load_reports[-1]
    assert 0.2 <= report["phases"]["prepare_save_s"] <= report["load_s"], report


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
def test_a_verifying_load_reports_the_steps_of_its_check(tmp_path: Path, monkeypatch):
    """A slow ``settle`` (at 8 ranks: the wait for the slowest rank's reads) shows as
    ``verify_detail.settle_s``, inside this rank's ``verify_s``; an unverified load has none."""
    from megatron_ckpt_ext.load import verify

    state = {"w": torch.randn(1 << 12)}
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)
    real = verify.Pending.settle

    def slow(self, group):  # noqa: ANN001
        import time

        time.sleep(0.25)
        return real(self, group)

    monkeypatch.setattr(verify.Pending, "settle", slow)
    with Checkpointer(CkptOptions()) as ck:
        ck.load(sharded(0, 1, {"w": torch.zeros(1 << 12)}), tmp_path)
        report = ck.load_reports[-1]
    with Checkpointer(CkptOptions(ckpt_verify_load=False)) as ck:
        ck.load(sharded(0, 1, {"w": torch.zeros(1 << 12)}), tmp_path)
        unverified = ck.load_reports[-1]
    steps = report["verify_detail"]
    assert set(steps) == {"settle_s", "check_s", "agree_s"}, report
    assert steps["settle_s"] >= 0.25 > steps["check_s"] + steps["agree_s"], report
    assert report["rank_phases"]["verify_s"] >= steps["settle_s"], report
    assert set(report["rank_phases"]) == set(report["phases"]), report
    assert unverified["verify_detail"] == {}, unverified
