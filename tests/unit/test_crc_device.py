"""The device CRC-32 (megatron_ckpt_ext/_crc_device.py) gives zlib's values for any length and
offset: level 0 alone, a padded first block, and the levels above it. Here its torch operations
run on CPU tensors; its Triton kernel is checked against zlib on the GPU
(tests/functional/multirank/test_cuda_load.py), and a load uses it only once that check passed."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from megatron_ckpt_ext import _crc_device, manifest

_RNG = np.random.default_rng(5)
_DATA = _RNG.integers(0, 256, (3 << 20) + 4099, dtype=np.uint8)


@pytest.mark.parametrize("start,length", [
    (0, 0), (0, 1), (3, 7), (0, 1023), (1, 1024), (5, 1025),  # level 0, one padded block
    (0, 256 * 1024), (9, 256 * 1024 + 1),  # one level above, exactly and just past a row
    (17, (3 << 20) + 11),  # two levels above, the first rows padded
])
def test_the_device_crc_gives_zlibs_value(start, length):
    data = torch.from_numpy(_DATA[start:start + length].copy())
    assert _crc_device.crc32_tensor(data) == zlib.crc32(data.numpy().tobytes())


def test_the_length_constant_is_the_crc_of_that_many_zero_bytes():
    for n in (1, 1000, 70_000):
        assert _crc_device.finish(0, n) == zlib.crc32(bytes(n))
    assert _crc_device.finish(0, 0) == 0


def test_a_level_table_moves_a_value_past_the_blocks_after_it():
    sub = _crc_device.BLOCK
    table = _crc_device.level_table(sub)
    value = 0x1234ABCD
    i = _crc_device.FAN_IN - 3  # two blocks of ``sub`` bytes after it
    moved = 0
    for b in range(4):
        moved ^= int(table[4 * i + b][(value >> (8 * b)) & 0xFF])
    assert moved == manifest._multmodp(manifest._shift_op(2 * sub), value)


def test_without_the_kernel_a_cpu_process_never_marks_the_device_sums_ready(monkeypatch):
    monkeypatch.setattr(_crc_device, "_KERNEL", [None])
    monkeypatch.setattr(_crc_device, "_READY", {})
    assert not _crc_device.warm_up("cpu")
    _crc_device._READY["cpu"].wait(0)  # its thread ends without setting it
    for t in __import__("threading").enumerate():
        if t.name == "mcx-crc-warm-up":
            t.join(10)
    assert not _crc_device.ready("cpu")


def test_slot_sums_give_each_pieces_zlib_value_across_blocks():
    align = _crc_device.ALIGN
    crc, data = _crc_device.DeviceCrc.on("cpu"), torch.from_numpy(_DATA.copy())
    slots, expected = _crc_device.SlotSums(crc), []
    for i in range(_crc_device.SLOTS + 5):  # one full block folded, then a partial one
        a, n = (i * 4096) % (1 << 20), (1 + i % 4) * align
        expected.append((slots.add(data[a:a + n]), n, zlib.crc32(_DATA[a:a + n].tobytes())))
    values = slots.values()
    assert len(values) == _crc_device.SLOTS + 5
    for index, n, want in expected:
        assert _crc_device.finish(values[index], n) == want


def test_a_slot_takes_only_an_aligned_multiple_of_align():
    slots = _crc_device.SlotSums(_crc_device.DeviceCrc.on("cpu"))
    data = torch.from_numpy(_DATA.copy())
    for piece in (data[1:1 + _crc_device.ALIGN], data[:_crc_device.ALIGN + 1024]):
        with pytest.raises(ValueError, match="aligned multiple"):
            slots.add(piece)


@pytest.mark.parametrize("address,nbytes,expected", [
    (0x1000, 10, (0, 0)), (0x1003, 5, (5, 0)), (0x1003, 100_000, (13, 6 * 16384)),
    (0x1000, 16384, (0, 16384)), (0x100F, 16385, (1, 16384)),
])
def test_the_device_takes_the_aligned_middle_of_a_chunk(address, nbytes, expected):
    assert _crc_device.device_span(address, nbytes) == expected
