"""The package's CRC-32 (megatron_ckpt_ext/_crc.py): ISA-L's where installed, with zlib's values,
so a manifest written by either verifies with the other and a flipped byte is caught by both."""

from __future__ import annotations

import os
import zlib

import pytest

from megatron_ckpt_ext import _crc, manifest


def test_the_fast_crc_is_used_where_installed_and_gives_zlibs_values():
    pytest.importorskip("isal")  # pinned in constraints/ci-py311.txt: CI has it
    assert _crc.IMPLEMENTATION == "isal"
    data = os.urandom((3 << 20) + 17)
    assert _crc.crc32(data) == zlib.crc32(data)
    running = _crc.crc32(data[5:], _crc.crc32(data[:5]))  # chained, as the writers sum
    assert running == zlib.crc32(data[5:], zlib.crc32(data[:5]))


@pytest.mark.parametrize("impl", ["isal", "zlib"])
def test_a_manifest_written_with_either_checksum_verifies_with_the_other(impl, tmp_path,
                                                                         monkeypatch):
    pytest.importorskip("isal")
    from isal.isal_zlib import crc32 as isal_crc32

    write, check = (zlib.crc32, isal_crc32) if impl == "isal" else (isal_crc32, zlib.crc32)
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(1 << 20))
    monkeypatch.setattr(manifest, "crc32", write)
    manifest.write_manifest(ckpt, 1)
    monkeypatch.setattr(manifest, "crc32", check)
    data = manifest.read_manifest(ckpt)
    assert manifest.verify_files(ckpt, data) == []
    raw = bytearray((ckpt / "__0_0.distcp").read_bytes())
    raw[4321] ^= 0x04
    (ckpt / "__0_0.distcp").write_bytes(bytes(raw))
    assert [p.file for p in manifest.verify_files(ckpt, data)] == ["__0_0.distcp"]
