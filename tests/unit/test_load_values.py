"""A load unpickles its checkpoint's DCP ``.metadata`` once: the readers megatron-core builds
during one load share that read (its sharded load's, and on megatron-core 0.19 its common-state
load's), and a load handed the ``Metadata`` its caller read already unpickles none."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.backend.load_reader import ReadSettings, parallel_reads
from megatron_ckpt_ext.collectives import Group
from megatron_ckpt_ext.load.loader import Loader
from megatron_ckpt_ext.load.report import LoadRecord
from tests._support.dist import sharded

_STATE = {f"w{i}": torch.arange(4096, dtype=torch.float32) + i for i in range(3)}


@pytest.fixture
def metadata_reads(monkeypatch) -> list[str]:
    """Each unpickling of a ``.metadata`` by torch's reader (every reader class's read ends in
    it): the checkpoint directory, once per read."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystemReader.read_metadata
    reads: list[str] = []

    def counting(self, *args, **kwargs):
        reads.append(os.path.abspath(os.fspath(self.path)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(filesystem.FileSystemReader, "read_metadata", counting)
    return reads


def _saved(root: Path) -> Path:
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, _STATE), root, iteration=1)
    return root / "iter_0000001"


def _like() -> dict:
    return sharded(0, 1, {k: torch.zeros_like(v) for k, v in _STATE.items()})


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
@pytest.mark.parametrize("threads", [1, 4])
def test_a_load_unpickles_the_metadata_once(tmp_path, metadata_reads, threads):
    path = _saved(tmp_path)
    metadata_reads.clear()
    with Checkpointer(CkptOptions(ckpt_load_threads=threads)) as ck:
        got = ck.load(_like(), tmp_path)
        assert ck.load_reports[-1]["verified"] is True
    assert metadata_reads == [str(path)]
    assert all(torch.equal(got[k], v) for k, v in _STATE.items())


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("threads", [1, 4])
def test_a_load_handed_the_metadata_unpickles_none(tmp_path, metadata_reads, threads):
    """What a caller unpickled before the load (megatron-core 0.19's common-state check reads
    the same file) is not read again by megatron-core's readers, parallel or not."""
    from torch.distributed.checkpoint import FileSystemReader

    path = _saved(tmp_path)
    metadata = FileSystemReader(str(path)).read_metadata()
    metadata_reads.clear()
    options = CkptOptions(ckpt_load_threads=threads)
    loader = Loader(options, Group(None, options), load_strategy=lambda: None)
    record = LoadRecord(root=tmp_path)
    got = loader.load(_like(), path, record, explicit=True, metadata=metadata)
    assert metadata_reads == []
    assert record.verified and all(torch.equal(got[k], v) for k, v in _STATE.items())
    assert (record.direct_items, record.stock_items) == ((3, 0) if threads > 1 else (0, 0))


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("threads", [1, 4])
def test_the_readers_of_one_load_share_one_read(tmp_path, metadata_reads, monkeypatch, threads):
    """Every reader megatron-core builds while the reads are set up (by its strategies' factory,
    and by the one megatron-core 0.19's serialization binds under its own name) answers from
    one read; readers built before or after read for themselves."""
    path = _saved(tmp_path)
    torch_strategy = importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    serialization = importlib.import_module("megatron.core.dist_checkpointing.serialization")
    factory = torch_strategy._get_filesystem_reader
    monkeypatch.setattr(serialization, "_get_filesystem_reader", factory, raising=False)
    metadata_reads.clear()
    with parallel_reads(ReadSettings(threads)):
        readers = [torch_strategy._get_filesystem_reader(str(path)),
                   torch_strategy._get_filesystem_reader(path),
                   serialization._get_filesystem_reader(str(path))]
        first, *others = [r.read_metadata() for r in readers]
    assert metadata_reads == [str(path)]
    assert all(md is first for md in others)
    assert torch_strategy._get_filesystem_reader is factory
    assert serialization._get_filesystem_reader is factory
    factory(str(path)).read_metadata()  # outside the load: a read of its own
    assert metadata_reads == [str(path)] * 2


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("handed", [False, True])
def test_a_restore_from_memory_reads_the_rest_with_one_metadata_read(tmp_path, metadata_reads,
                                                                     monkeypatch, handed):
    """From memory, the rest of the state (common state, ShardedObjects) is megatron-core's load,
    which on 0.19 builds two readers (its common-state load's under serialization's own name,
    its sharded load's): they share one unpickle of ``.metadata`` (backend.metadata_read_once),
    and none where the load's locate step handed over the one it unpickled."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ckpt_ext import backend
    from megatron_ckpt_ext.load import memory

    path = _saved(tmp_path)
    known = FileSystemReader(str(path)).read_metadata() if handed else None
    torch_strategy = importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    serialization = importlib.import_module("megatron.core.dist_checkpointing.serialization")
    monkeypatch.setattr(serialization, "_get_filesystem_reader",
                        torch_strategy._get_filesystem_reader, raising=False)
    got = []

    def as_megatron_core_0_19(state, checkpoint_dir, strategy, fill, **_):  # two readers
        got.append(serialization._get_filesystem_reader(checkpoint_dir).read_metadata())
        got.append(torch_strategy._get_filesystem_reader(checkpoint_dir).read_metadata())
        return {}

    monkeypatch.setattr(backend, "load_with_tensors_from", as_megatron_core_0_19)
    metadata_reads.clear()
    memory._load_rest_and_fill(_like(), path, lambda: None, metadata=known)
    assert metadata_reads == ([] if handed else [str(path)])
    assert got[0] is got[1] and (known is None or got[0] is known)


@pytest.mark.usefixtures("one_rank_group")
def test_a_load_hands_what_locate_read_to_the_restore_from_memory(tmp_path, monkeypatch):
    """Checkpointer.load: the ``.metadata`` its locate step kept goes to the memory tier's load
    (as to the storage loader)."""
    from megatron_ckpt_ext import checkpointer

    path = _saved(tmp_path)
    sentinel, seen = object(), {}

    def locating(root, *, metadata, **_):
        metadata[str(path)] = sentinel
        return path

    def restoring(stager, state, at, record, *args, metadata=None, **_):
        seen["metadata"], record.path = metadata, at
        return {}

    monkeypatch.setattr(checkpointer, "locate", locating)
    monkeypatch.setattr(checkpointer, "restore_from_memory", restoring)
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True)
    with Checkpointer(options) as ck:
        ck.load(sharded(0, 1, {k: torch.zeros(4096) for k in _STATE}), tmp_path)
    assert seen["metadata"] is sentinel


def test_locate_hands_the_metadata_it_read_to_the_load(tmp_path, metadata_reads):
    """A megatron-core 0.19 checkpoint keeps its common state inside the torch_dist files: the
    check that it is there unpickles ``.metadata`` and keeps it for the load."""
    import torch.distributed.checkpoint as dcp

    from megatron_ckpt_ext.load.locate import locate
    from megatron_ckpt_ext.save.layout import TRACKER, checkpoint_name

    path = checkpoint_name(tmp_path, 3)
    dcp.save({"common_state": torch.zeros(2), "w": torch.ones(4)}, checkpoint_id=str(path),
             no_dist=True)
    (path / "metadata.json").write_text("{}")
    (tmp_path / TRACKER).write_text("3")
    kept: dict = {}
    assert locate(tmp_path, metadata=kept) == path
    assert metadata_reads == [os.path.abspath(path)]
    assert "common_state" in kept[str(path)].state_dict_metadata
