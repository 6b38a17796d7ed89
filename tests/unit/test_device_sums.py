"""The load's device sums (backend/load_sums.py ``_DeviceSums``): chunks handed over by the
reading threads are summed by one thread, in any order, and ``collect`` returns each chunk's
zlib CRC-32 with its file and offset, so the file's pieces fold into the manifest's value; a
failure in that thread is raised by ``collect`` and never hangs it. Run here on CPU tensors with
CUDA's stream calls stubbed (the kernel path is checked on the GPU: test_cuda_load.py)."""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

from megatron_ckpt_ext import manifest
from megatron_ckpt_ext.backend import load_sums

pytestmark = pytest.mark.unit


class _Stream:
    def __init__(self, device=None):  # noqa: ANN001
        self.waited = []

    def wait_event(self, event):  # noqa: ANN001
        self.waited.append(event)

    def synchronize(self):
        pass


@pytest.fixture
def cpu_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())


def test_chunks_summed_by_the_device_thread_fold_into_the_files_crc(cpu_streams):
    data = torch.randint(0, 256, (3_000_017,), dtype=torch.uint8)
    sums = load_sums._DeviceSums()
    cuts = [0, 5, 1_048_576, 1_048_577, 2_500_000, data.numel()]
    spans = list(zip(cuts, cuts[1:]))
    for a, b in reversed(spans):  # handed over out of file order, as threads finish
        sums.put("f.distcp", a, data[a:b], copied=object())
    pieces = sums.collect()
    assert sorted((o, n) for _, o, n, _ in pieces) == [(a, b - a) for a, b in spans]
    for name, offset, n, crc in pieces:
        assert name == "f.distcp" and crc == zlib.crc32(data[offset:offset + n].numpy())
    folded = manifest.tiled_crc32([(o, n, c) for _, o, n, c in pieces], data.numel())
    assert folded == zlib.crc32(data.numpy())


def test_a_failure_in_the_device_thread_is_raised_by_collect(cpu_streams, monkeypatch):
    from megatron_ckpt_ext import _crc_device

    def broken(self, data):  # noqa: ANN001
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(_crc_device.DeviceCrc, "linear", broken)
    sums = load_sums._DeviceSums()
    data = torch.zeros(4096, dtype=torch.uint8)
    for a in range(0, 4096, 1024):  # later chunks after the failure are drained, not summed
        sums.put("f.distcp", a, data[a:a + 1024], copied=object())
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        sums.collect()
    sums.close()  # nothing left running


def test_nothing_handed_over_collects_nothing():
    sums = load_sums._DeviceSums()
    assert sums.collect() == []
    sums.close()


def test_one_load_sums_on_one_device_only(monkeypatch):
    """Targets on a second device (one process, two GPUs) sum on the host: the device thread
    serves the first device it was asked for."""
    from megatron_ckpt_ext import _crc_device

    monkeypatch.setattr(_crc_device, "ready", lambda device: True)
    sums = load_sums._DeviceSums()
    assert sums.ready("cuda:1") and sums.ready("cuda:1")
    assert not sums.ready("cuda:0")
