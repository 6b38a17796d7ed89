"""The checkpoint's own collectives in a world of one rank: each is the identity, with no round
trip through a backend (at one rank every save's blocking paid for one, and the wait gave the GIL
away to whatever thread ran beside the save). Worlds of two ranks and more run them for real:
tests/functional/multirank/test_control_group.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_ckpt_ext import CkptOptions
from megatron_ckpt_ext.collectives import Group


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_a_group_of_one_runs_no_collective(world_of_one, monkeypatch):
    called = []
    for name in ("all_reduce", "all_gather", "barrier", "new_group"):
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda *a, _n=name, _r=real, **k: called.append(_n)
                            or _r(*a, **k))
    group = Group(None, CkptOptions())
    assert group.size() == 1
    assert group.all_max([1.0, 0.0, -1.0]) == [1.0, 0.0, -1.0]
    assert group.all_sum([2.5]) == [2.5]
    assert group.all_gather({"rank": 0}) == [{"rank": 0}]
    group.barrier()
    assert called == []


def test_without_a_process_group_too():
    assert not dist.is_initialized()
    group = Group(None, CkptOptions())
    assert group.all_max([3.0]) == [3.0] and group.all_gather(1) == [1]
    group.barrier()
