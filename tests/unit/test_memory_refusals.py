"""Why the memory tier refuses a sealed snapshot for a load, one reason per check, each named as
rank 0 logs it (``load/memory.py: _mismatch``). The checks overlap (a snapshot of another
iteration is of another commit too), so a refusal's cause is only told right when each check
stands on its own: these tests pin each message to its case."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.load.memory import _mismatch, tensor_layout
from megatron_ckpt_ext.manifest import read_manifest
from megatron_ckpt_ext.save.layout import checkpoint_name
from megatron_ckpt_ext.staging.retained import Seal, SealEntry
from tests._support.dist import sharded

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _state() -> dict:
    return sharded(0, 1, {"w": torch.arange(64, dtype=torch.float32),
                          "b": torch.ones(8, dtype=torch.bfloat16)})


@pytest.fixture
def case(tmp_path):
    """A committed iteration 2 (and 1) under ``root`` and the seal that matches iteration 2."""
    root = tmp_path / "ckpt"
    with Checkpointer(CkptOptions()) as ck:
        for it in (1, 2):
            ck.save(_state(), root, iteration=it)
    entries = [SealEntry(key=k, offset=o, shape=s, dtype=d, spec=k, path=None, nbytes=0)
               for k, o, s, d in tensor_layout(_state())]
    crc = read_manifest(checkpoint_name(root, 2))["manifest_crc32"]
    seal = Seal(root=os.path.realpath(root), rank=0, world=1, iteration=2, manifest_crc32=crc,
                entries=entries)
    return root, seal


def test_the_matching_seal_is_taken(case):
    root, seal = case
    assert _mismatch(seal, _state(), root, 2, 1) == ""


def test_no_seal(case):
    root, _ = case
    assert _mismatch(None, _state(), root, 2, 1) == \
        "no sealed snapshot of this save root on this node"


def test_a_seal_of_another_save_root(case, tmp_path):
    root, seal = case
    other = dataclasses.replace(seal, root=os.path.realpath(tmp_path / "other"))
    assert _mismatch(other, _state(), root, 2, 1).startswith("the snapshot belongs to ")


def test_a_seal_taken_at_another_world_size(case):
    root, seal = case
    assert _mismatch(dataclasses.replace(seal, world=2), _state(), root, 2, 1) == \
        "the snapshot was taken at world size 2, this run has 1"


def test_a_seal_of_another_iteration(case):
    root, seal = case
    assert _mismatch(seal, _state(), root, 1, 1) == \
        "the snapshot holds iteration 2, the load asks for 1"


def test_a_seal_of_another_commit_of_the_same_iteration(case):
    """The iteration saved again after the seal (a re-save): its manifest is another."""
    root, seal = case
    stale = dataclasses.replace(seal, manifest_crc32="0badc0de")
    assert _mismatch(stale, _state(), root, 2, 1).startswith(
        "the snapshot is not of this commit of the iteration (manifest CRC 0badc0de vs ")


def test_a_state_of_another_layout_reads_storage(case):
    root, seal = case
    resharded = sharded(0, 1, {"w": torch.arange(32, dtype=torch.float32),
                               "b": torch.ones(8, dtype=torch.bfloat16)})
    assert _mismatch(seal, resharded, root, 2, 1).startswith(
        "the state's tensors differ from the snapshot's (2 vs 2 tensors, or another layout)")
