"""A file's CRC-32 from the CRC-32s of its pieces (manifest.crc32_combine / tiled_crc32): what
the loader folds when its reading threads sum the bytes they read, in any order of arrival."""

from __future__ import annotations

import random
import zlib

import pytest

from megatron_ckpt_ext import manifest


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 100_003])
def test_combine_equals_the_crc_of_the_concatenation(pure, n):
    rng = random.Random(n)
    a, b = rng.randbytes(1 + n % 97), rng.randbytes(n)
    got = manifest.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b), pure=pure)
    assert got == zlib.crc32(a + b)


def test_pieces_in_any_order_fold_to_the_file_crc_and_gaps_or_overlaps_give_none():
    rng = random.Random(22)
    data = rng.randbytes(300_000)
    cuts = [0, *sorted(rng.sample(range(1, len(data)), 40)), len(data)]
    pieces = [(a, b - a, zlib.crc32(data[a:b])) for a, b in zip(cuts, cuts[1:])]
    rng.shuffle(pieces)
    assert manifest.tiled_crc32(pieces, len(data)) == zlib.crc32(data)
    assert manifest.tiled_crc32(pieces[1:], len(data)) is None  # a gap
    assert manifest.tiled_crc32(pieces + pieces[:1], len(data)) is None  # an overlap
    assert manifest.tiled_crc32(pieces, len(data) + 1) is None  # short of the end
    assert manifest.tiled_crc32([], 0) == 0
    ten = [(a, 10, zlib.crc32(data[a:a + 10])) for a in (0, 0, 20)]  # a gap as long as an overlap
    assert manifest.tiled_crc32(ten, 30) is None
