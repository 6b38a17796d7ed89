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
