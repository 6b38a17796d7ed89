"""Rank functions of test_integrity.py (spawned: module level)."""

from __future__ import annotations

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointIntegrityError
from tests._support.dist import sharded


def _state(rank: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.float32) + 100 * rank}


def save_two_ranks(rank: int, world: int, root: str) -> None:
    with Checkpointer(CkptOptions(async_save=True)) as ck:
        ck.save(sharded(rank, world, _state(rank)), root, iteration=1)
        ck.maybe_finalize(blocking=True)


def load_fails_naming(rank: int, world: int, root: str, bad: str) -> None:
    like = {"w": torch.zeros(1024)}
    with Checkpointer(CkptOptions()) as ck:
        try:
            ck.load(sharded(rank, world, like), root)
        except CheckpointIntegrityError as e:
            assert bad in str(e) and "iteration 1" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: a flipped bit in {bad} loaded")


def load_halves(rank: int, world: int, root: str) -> None:
    """Each rank loads its half of tensors saved whole by one rank (narrowed reads), with the
    parallel reader; both halves must be the saved bytes."""
    from pathlib import Path

    from megatron_ckpt_ext.backend import load_reader

    expected = torch.load(Path(root) / "expected.pt")
    like = {k: torch.zeros(v.numel() // world) for k, v in expected.items()}
    with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
        got = ck.load(sharded(rank, world, like), root, iteration=1)
    assert load_reader._CLASSES, "the parallel reader was not used"
    report = ck.load_reports[-1]
    assert (report["direct_items"], report["stock_items"]) == (len(expected), 0), report
    for k, v in expected.items():
        n = v.numel() // world
        assert torch.equal(got[k], v[rank * n:(rank + 1) * n]), k


def load_reads_no_summed_file_twice(rank: int, world: int, root: str) -> None:
    """A verifying load where each rank's reads sum its own data file: no rank's check reads a
    data file again (each was judged by the rank that summed it), the load verifies."""
    from megatron_ckpt_ext.load import verify

    checked: list[str] = []
    real = verify.verify_files
    verify.verify_files = lambda path, m, names, **kw: (checked.extend(names),
                                                        real(path, m, names, **kw))[1]
    like = {"w": torch.zeros(1024)}
    with Checkpointer(CkptOptions(ckpt_load_threads=2)) as ck:
        got = ck.load(sharded(rank, world, like), root)
        assert ck.load_reports[-1]["verified"] is True
    assert torch.equal(got["w"], _state(rank)["w"])
    assert not [n for n in checked if n.endswith(".distcp")], (rank, checked)
