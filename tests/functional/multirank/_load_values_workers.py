"""Rank functions of test_load_values.py (spawned: module level)."""

from __future__ import annotations

import os

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from tests._support.dist import sharded


def _state(rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's slice of each tensor."""
    n = 2048 // world
    return {f"w{i}": (torch.arange(2048, dtype=torch.float32) + i)[rank * n:(rank + 1) * n]
            for i in range(3)}


def save(rank: int, world: int, root: str) -> None:
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(rank, world, _state(rank, world)), root, iteration=1)


def load_counting_metadata_reads(rank: int, world: int, root: str, threads: int) -> None:
    """This rank's load unpickles the checkpoint's .metadata exactly once."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystemReader.read_metadata
    reads: list[str] = []

    def counting(self, *args, **kwargs):
        reads.append(os.fspath(self.path))
        return real(self, *args, **kwargs)

    filesystem.FileSystemReader.read_metadata = counting
    try:
        like = {k: torch.zeros_like(v) for k, v in _state(rank, world).items()}
        with Checkpointer(CkptOptions(ckpt_load_threads=threads)) as ck:
            got = ck.load(sharded(rank, world, like), root)
    finally:
        filesystem.FileSystemReader.read_metadata = real
    assert len(reads) == 1, f"rank {rank}: .metadata read {len(reads)} times: {reads}"
    assert all(torch.equal(got[k], v) for k, v in _state(rank, world).items())


def load_with_layouts_ahead(rank: int, world: int, root: str) -> None:
    """prepare_restore parses this rank's own file of the checkpoint (``__{rank}_*``), none of
    the other's, and the load then parses none of the items it reads there again."""
    import threading

    from megatron_ckpt_ext.backend import direct_read, layouts_ahead

    like = {k: torch.zeros_like(v) for k, v in _state(rank, world).items()}
    with Checkpointer(CkptOptions(ckpt_load_threads=2)) as ck:
        ck.prepare_restore(root)
        for t in threading.enumerate():
            if t.name == "mcx-layouts-ahead":
                t.join(60)
        ahead = layouts_ahead.take(os.path.join(root, "iter_0000001"))
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(os.path.join(root, "iter_0000001")).read_metadata().storage_data
        # every item the metadata places in this rank's file: 3 (megatron-core 0.19: 4, with its
        # common state)
        mine = sum(i.relative_path == f"__{rank}_0.distcp" for i in storage.values())
        assert mine >= 3 and ahead is not None and len(ahead) == mine, \
            f"rank {rank}: {ahead and len(ahead)} of {mine}"
        assert {name for name, _, _ in ahead._layouts} == {f"__{rank}_0.distcp"}
        real, parsed = direct_read.item_layout, []
        direct_read.item_layout = lambda fd, o, n: (parsed.append(o), real(fd, o, n))[1]
        try:
            got = ck.load(sharded(rank, world, like), root)
        finally:
            direct_read.item_layout = real
    assert parsed == [], f"rank {rank} parsed {len(parsed)} items again"
    assert all(torch.equal(got[k], v) for k, v in _state(rank, world).items())
