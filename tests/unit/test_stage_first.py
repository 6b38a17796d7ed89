"""A steady async save stages before its directory opens (save/steps.py ``_stage_first``): its
copies run while rank 0 creates ``iter_N.incomplete`` and the ranks agree. The first save and
a new structure still open first; a failed open after staging gives the buffers back, and the
next save stages into them and writes the right bytes."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointWriteError
from megatron_ckpt_ext.hooks import SaveHooks
from megatron_ckpt_ext.save import layout
from tests._support.dist import sharded

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_group")]  # tests/conftest.py

OPTIONS = dict(async_save=True, async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True)


class _SeesTheDirectory(SaveHooks):
    """At "staged": whether the save's ``iter_N.incomplete`` existed yet."""

    def __init__(self) -> None:
        self.open_when_staged: dict[int, bool] = {}

    def at(self, point, record):  # noqa: ANN001
        if point == "staged":
            self.open_when_staged[record.iteration] = layout.incomplete_name(
                record.root, record.iteration).is_dir()


def _state(value: float, n: int = 64) -> dict:
    return sharded(0, 1, {"w": torch.full((n,), value), "b": torch.arange(n, dtype=torch.float32)
                          + value})


def _loads(ck: Checkpointer, root, iteration: int, value: float) -> None:
    loaded = ck.load(_state(0.0), root, iteration=iteration)
    for key, expected in _state(value).items():
        assert torch.equal(loaded[key], expected.data), (iteration, key)


def test_steady_saves_stage_before_the_directory_opens_and_write_their_own_bytes(tmp_path):
    hooks = _SeesTheDirectory()
    root = tmp_path / "ckpt"
    with Checkpointer(CkptOptions(**OPTIONS), hooks=hooks) as ck:
        for it in (1, 2, 3):
            ck.save(_state(float(it)), root, iteration=it)
            ck.maybe_finalize(blocking=True)
        ck.save(sharded(0, 1, {"w": torch.ones(8)}), root, iteration=4)  # a new structure
        ck.maybe_finalize(blocking=True)
        for it in (1, 2, 3):
            _loads(ck, root, it, float(it))
    # the first save admits the node (collective) after the open; a new structure opens first
    assert hooks.open_when_staged == {1: True, 2: False, 3: False, 4: True}


def test_a_failed_open_after_staging_gives_the_buffers_back(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    real = layout._make_workdir

    def fails_at_two(record, workdir):  # noqa: ANN001
        return OSError(28, "No space left on device") if record.iteration == 2 else real(
            record, workdir)

    monkeypatch.setattr(layout, "_make_workdir", fails_at_two)
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck.save(_state(1.0), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        allocated = ck.staging_stats()["allocations"]
        with pytest.raises(CheckpointWriteError, match="cannot create"):
            ck.save(_state(2.0), root, iteration=2)
        ck.save(_state(3.0), root, iteration=3)  # stages into the same buffers again
        ck.maybe_finalize(blocking=True)
        assert ck.staging_stats()["allocations"] == allocated
        assert not layout.incomplete_name(root, 2).exists()
        _loads(ck, root, 3, 3.0)
        _loads(ck, root, 1, 1.0)
