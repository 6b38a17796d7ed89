"""A job going down on an error keeps its node's sealed snapshot of the last committed save, so
its restart can restore from memory; a clean close frees it (unless asked to keep it)."""

from __future__ import annotations

import os

import pytest

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.staging.retained import discard, read_seal

from tests._support.seals import save_and_wait_for_the_seal


@pytest.mark.parametrize("ends", ["error", "clean"])
def test_the_snapshot_outlives_a_close_on_an_error_only(one_rank_group, tmp_path, ends):
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    path = None
    try:
        with Checkpointer(options, save_dir=str(tmp_path)) as ck:
            path = save_and_wait_for_the_seal(ck, tmp_path)
            if ends == "error":
                raise KeyError("the trainer's own error")
    except KeyError:
        pass
    seal = read_seal(path)
    try:
        if ends == "error":
            assert seal is not None and seal.iteration == 1
            assert all(os.path.exists(e.path) for e in seal.entries)
        else:
            assert seal is None
    finally:
        if seal is not None:
            discard(seal, is_mapped=lambda p: False)
