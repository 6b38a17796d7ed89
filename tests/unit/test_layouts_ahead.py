"""The load's metadata step done ahead (backend/layouts_ahead.py): prepare_restore parses where
each item's bytes lie in this rank's files of the checkpoint it will load, on a thread while the
model is built; the load then parses none of them again, unless a file is not the one parsed
(replaced since), and what was parsed serves that one load only."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend
from megatron_ckpt_ext.backend import direct_read, layouts_ahead

ITEMS = 6


def _state(fill: float | None = None) -> dict:
    st = backend.sharded_tensor_cls()
    return {f"w{i}": st.from_rank_offsets(
        f"w{i}", torch.full((512 + i,), fill) if fill is not None else torch.arange(512.0 + i) + i,
        replica_id=0) for i in range(ITEMS)}


@pytest.fixture
def saved(one_rank_group, tmp_path):
    root = tmp_path / "ckpt"
    with Checkpointer(CkptOptions()) as ck:
        ck.save(_state(), root, iteration=1)
        ck.maybe_finalize(blocking=True)
    return root


def _ahead_done() -> None:
    for t in threading.enumerate():
        if t.name == "mcx-layouts-ahead":
            t.join(30)


@pytest.fixture
def parsed(monkeypatch):
    """How many item layouts the load parses itself (the ahead thread is done before)."""
    calls = []
    real = direct_read.item_layout

    def counting(fd, offset, length):
        calls.append((offset, length))
        return real(fd, offset, length)

    def start_counting():
        _ahead_done()
        monkeypatch.setattr(direct_read, "item_layout", counting)
    return calls, start_counting


def _items_in(directory, rank: int) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(directory)).read_metadata().storage_data.values()
    return sum(info.relative_path.startswith(f"__{rank}_") for info in storage)


def _exact(state: dict) -> bool:
    return all(torch.equal(state[f"w{i}"], torch.arange(512.0 + i) + i) for i in range(ITEMS))


def test_a_load_after_prepare_restore_parses_none_of_its_items_again(saved, parsed):
    calls, start_counting = parsed
    with Checkpointer(CkptOptions()) as ck:
        ck.prepare_restore(saved)
        start_counting()
        assert _exact(ck.load(_state(0.0), saved))
        assert calls == []
        assert ck.load_reports[-1]["direct_items"] == ITEMS
        # served that load only: the next one (no prepare_restore) parses every item itself
        assert _exact(ck.load(_state(0.0), saved))
        assert len(calls) == ITEMS


def test_a_file_replaced_after_the_parse_is_parsed_again(saved, parsed):
    calls, start_counting = parsed
    data = next((saved / "iter_0000001").glob("*.distcp"))
    with Checkpointer(CkptOptions()) as ck:
        ck.prepare_restore(saved)
        start_counting()
        shutil.copy2(data, data.with_suffix(".tmp"))  # the same bytes, another file
        os.replace(data.with_suffix(".tmp"), data)
        assert _exact(ck.load(_state(0.0), saved))
    assert len(calls) == ITEMS


def test_only_this_ranks_files_are_parsed_and_as_the_load_would(saved):
    directory = saved / "iter_0000001"
    other = layouts_ahead.LayoutsAhead(directory, rank=1)
    other.run()
    assert len(other) == 0  # rank 0 wrote every file here
    mine = layouts_ahead.LayoutsAhead(directory, rank=0)
    mine.run()
    # every item the checkpoint's metadata places in this rank's files (megatron-core 0.19 adds
    # its common state as one more item there)
    assert len(mine) == _items_in(directory, rank=0) >= ITEMS
    tensors = 0
    for (name, offset, length) in list(mine._layouts):
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            got, want = mine.layout(name, fd, offset, length), direct_read.item_layout(
                fd, offset, length)
        finally:
            os.close(fd)
        assert got[1] == want[1], (got, want)  # the same verdict, also for what is no tensor
        if want[1]:  # not one tensor's bytes (0.19's common state): read whole by its own load
            continue
        tensors += 1
        assert got[0].start == want[0].start
        assert (got[0].dtype, got[0].size, got[0].record) == (want[0].dtype, want[0].size,
                                                              want[0].record)
    assert tensors == ITEMS


def test_nothing_is_parsed_without_a_checkpoint_and_nothing_kept_after_a_load(saved, tmp_path):
    assert layouts_ahead.start(tmp_path / "nothing", 0) is None
    assert layouts_ahead.take(tmp_path / "nothing") is None
    with Checkpointer(CkptOptions()) as ck:
        ck.prepare_restore(saved)
        _ahead_done()
        assert layouts_ahead.take(saved / "iter_0000001") is not None
        ck.load(_state(0.0), saved)
    assert layouts_ahead.take(saved / "iter_0000001") is None


def test_a_load_of_another_iteration_leaves_nothing_parsed_behind(one_rank_group, tmp_path):
    root = tmp_path / "ckpt"
    with Checkpointer(CkptOptions()) as ck:
        for it in (1, 2):
            ck.save(_state(), root, iteration=it)
            ck.maybe_finalize(blocking=True)
    with Checkpointer(CkptOptions()) as ck:
        ck.prepare_restore(root)  # the tracker names iteration 2
        _ahead_done()
        assert layouts_ahead.take(root / "iter_0000002") is not None
        assert _exact(ck.load(_state(0.0), root, iteration=1))
    assert layouts_ahead.take(root / "iter_0000002") is None


@pytest.mark.parametrize("tracker", ["garbage", "a directory"])
def test_a_damaged_tracker_is_left_to_the_load_to_report(one_rank_group, tmp_path, tracker):
    root = tmp_path / "ckpt"
    root.mkdir()
    if tracker == "a directory":
        (root / "latest_checkpointed_iteration.txt").mkdir()
    else:
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    with Checkpointer(CkptOptions()) as ck:
        assert not ck.prepare_restore(root)  # nothing read ahead, nothing raised
        with pytest.raises(OSError if tracker == "a directory" else ValueError,
                           match="latest_checkpointed_iteration.txt") as raised:
            ck.load(_state(0.0), root)
        assert "iteration=N" in str(raised.value)  # the fix is named


def test_a_first_start_prepares_nothing_not_even_the_device_crc(saved, tmp_path, monkeypatch):
    """--load = --save on a first start (nothing committed yet): prepare_restore builds nothing
    beside the model build (the device CRC's kernel and tables slowed the real client's build by
    about 0.13 s for no load); with a committed checkpoint the CRC is built ahead, except where
    the node's memory restores it (its sums run on the host, before the copy)."""
    from megatron_ckpt_ext.load import loader

    warmed: list = []
    monkeypatch.setattr(loader._crc_device, "warm_up_current", lambda o: warmed.append(o))
    with Checkpointer(CkptOptions()) as ck:
        ck.prepare_restore(tmp_path / "empty")
        assert warmed == []
        ck.prepare_restore(saved)
        _ahead_done()
    assert len(warmed) == 1
    loader.read_ahead(CkptOptions(), saved, pin_chunks=False)  # restored from memory
    assert len(warmed) == 1
