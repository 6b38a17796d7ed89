"""What a load trusts, with two ranks: a damaged file that both ranks read is named once."""

from __future__ import annotations

from pathlib import Path

from tests._support.dist import run_ranks

from . import _load_trust_workers as lw


def _flip_bit(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_file_both_ranks_read_is_named_once(tmp_path):
    """Both ranks read (and judge) the file that holds a replicated tensor: one problem."""
    run_ranks(lw.save, world_size=2, timeout=120, args=(str(tmp_path),))
    bad = tmp_path / "iter_0000001" / "__0_0.distcp"  # rank 0 wrote the replicated "b"
    _flip_bit(bad, offset=len(bad.read_bytes()) // 2)
    run_ranks(lw.load_names_each_bad_file_once, world_size=2, timeout=120,
              args=(str(tmp_path), bad.name))
