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


def test_chunks_summed_by_the_device_thread_fold_into_the_files_crc(cpu_streams, monkeypatch):
    """Chunks of any length and alignment, handed over out of file order as the reading threads
    finish: each one's aligned middle summed by the device thread, its ends on the host; every
    piece folds into the file's CRC."""
    from types import SimpleNamespace

    from megatron_ckpt_ext import _crc_device

    monkeypatch.setattr(_crc_device, "ready", lambda device: True)
    data = torch.randint(0, 256, (3_000_017,), dtype=torch.uint8)
    sums = load_sums._Sums(True, 1, on_device=True)
    plan = SimpleNamespace(what="f.distcp", summed=True)
    assert sums.on_device(plan, "cpu")
    cuts = [0, 5, 1_048_576, 1_048_577, 2_500_000, data.numel()]
    for a, b in reversed(list(zip(cuts, cuts[1:]))):
        sums.device_chunk(plan, a, data[a:b], object(), memoryview(data[a:b].numpy()))
    assert sums.device_bytes > 2_000_000  # the middles: the most of it
    sums.wait()
    pieces = sums._pieces["f.distcp"]
    assert sum(n for _, n, _ in pieces) == data.numel()
    assert manifest.tiled_crc32(pieces, data.numel()) == zlib.crc32(data.numpy())


def test_a_failure_in_the_device_thread_is_raised_by_collect(cpu_streams, monkeypatch):
    from megatron_ckpt_ext import _crc_device

    def broken(self, data, out):  # noqa: ANN001
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(_crc_device.DeviceCrc, "level0_into", broken)
    sums = load_sums._DeviceSums()
    align = _crc_device.ALIGN
    data = torch.zeros(4 * align, dtype=torch.uint8)
    for a in range(0, 4 * align, align):  # later chunks after the failure are drained
        sums.put("f.distcp", a, data[a:a + align], copied=object())
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


def test_aligned_chunks_are_summed_in_slots_across_blocks(cpu_streams):
    """More chunks than a block has slots, each a 16-byte aligned multiple of ALIGN: every
    chunk's CRC is zlib's; a piece of any other kind is an error that collect() raises."""
    from megatron_ckpt_ext import _crc_device

    align = _crc_device.ALIGN
    data = torch.randint(0, 256, ((_crc_device.SLOTS + 9) * 3 * align,), dtype=torch.uint8)
    sums = load_sums._DeviceSums()
    spans, a = [], 0
    for i in range(_crc_device.SLOTS + 9):
        n = (1 + i % 3) * align
        spans.append((a, a + n))
        a += n
    for a, b in spans:
        sums.put("f.distcp", a, data[a:b], copied=object())
    pieces = sums.collect()
    assert sorted((o, n) for _, o, n, _ in pieces) == [(a, b - a) for a, b in spans]
    for _, offset, n, crc in pieces:
        assert crc == zlib.crc32(data[offset:offset + n].numpy())
    odd = load_sums._DeviceSums()
    odd.put("f.distcp", 0, data[:777], copied=object())
    with pytest.raises(ValueError, match="aligned multiple"):
        odd.collect()
    odd.close()


def test_a_devices_chunk_sums_its_unaligned_ends_on_the_host(cpu_streams, monkeypatch):
    """The part of a chunk the device sums starts 16-byte aligned and is a multiple of ALIGN
    long; the bytes before and after it are summed from the host copy at once, and all the
    pieces fold into the file's CRC."""
    from types import SimpleNamespace

    from megatron_ckpt_ext import _crc_device

    monkeypatch.setattr(_crc_device, "ready", lambda device: True)
    align = _crc_device.ALIGN
    base = torch.randint(0, 256, (5 * align + 4096,), dtype=torch.uint8)
    chunk = base[3:3 + 3 * align + 1000]  # starts 3 bytes past an aligned address
    sums = load_sums._Sums(True, 1, on_device=True)
    plan = SimpleNamespace(what="f.distcp", summed=True)
    assert sums.on_device(plan, "cpu")
    view = memoryview(chunk.numpy().tobytes())
    sums.device_chunk(plan, 0, chunk, object(), view)
    skip = -chunk.data_ptr() % 16
    assert 0 < skip < 16
    assert sums.device_bytes == (chunk.numel() - skip) // align * align == 3 * align
    sums.wait()
    pieces = sums._pieces["f.distcp"]
    assert sorted((o, n) for o, n, _ in pieces) == [
        (0, skip), (skip, 3 * align), (skip + 3 * align, chunk.numel() - skip - 3 * align)]
    assert manifest.tiled_crc32(pieces, chunk.numel()) == zlib.crc32(view)



def test_a_chunk_past_one_slot_is_cut_into_slots_at_their_offsets(cpu_streams):
    from megatron_ckpt_ext import _crc_device

    n = _crc_device.SLOT_BYTES + _crc_device.ALIGN
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    sums = load_sums._DeviceSums()
    sums.put("f.distcp", 4096, data, copied=object())
    pieces = sums.collect()
    slot, align = _crc_device.SLOT_BYTES, _crc_device.ALIGN
    assert [(o, k) for _, o, k, _ in pieces] == [(4096, slot), (4096 + slot, align)]
    for _, offset, k, crc in pieces:
        assert crc == zlib.crc32(data[offset - 4096:offset - 4096 + k].numpy())


def test_the_device_threads_time_at_work_is_counted(cpu_streams, monkeypatch):
    """``_Sums.device_busy_s`` (the load report's ``read_detail.sum_device_busy_s``): the device
    thread's seconds from taking each chunk to its launches issued."""
    import time
    from types import SimpleNamespace

    from megatron_ckpt_ext import _crc_device

    real = _crc_device.DeviceCrc.level0_into

    def slow(self, data, out):  # noqa: ANN001
        time.sleep(0.05)
        real(self, data, out)

    monkeypatch.setattr(_crc_device.DeviceCrc, "level0_into", slow)
    monkeypatch.setattr(_crc_device, "ready", lambda device: True)
    align = _crc_device.ALIGN
    data = torch.zeros(4 * align, dtype=torch.uint8)
    sums = load_sums._Sums(True, 1, on_device=True)
    plan = SimpleNamespace(what="f.distcp", summed=True)
    for a in range(0, 4 * align, align):
        sums.device_chunk(plan, a, data[a:a + align], object(),
                          memoryview(data[a:a + align].numpy()))
    sums.wait()
    assert 0.2 <= sums.device_busy_s < 5, sums.device_busy_s
