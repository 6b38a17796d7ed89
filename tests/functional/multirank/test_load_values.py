"""A load on two ranks: each rank unpickles the checkpoint's DCP .metadata once, and parses its own
files' item layouts ahead (prepare_restore), not again in the load."""

from __future__ import annotations

import pytest

from tests._support.dist import run_ranks

from . import _load_values_workers as vw


@pytest.mark.parametrize("threads", [1, 4])
def test_each_rank_unpickles_the_metadata_once(tmp_path, threads):
    run_ranks(vw.save, world_size=2, timeout=120, args=(str(tmp_path),))
    run_ranks(vw.load_counting_metadata_reads, world_size=2, timeout=120,
              args=(str(tmp_path), threads))


def test_each_rank_parses_its_own_files_ahead_and_not_again(tmp_path):
    run_ranks(vw.save, world_size=2, timeout=120, args=(str(tmp_path),))
    run_ranks(vw.load_with_layouts_ahead, world_size=2, timeout=120, args=(str(tmp_path),))
