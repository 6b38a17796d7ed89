"""A load at one rank plans on its own rank: torch DCP is not asked to gather and scatter the
load's plan over a process group of one (megatron-core <= 0.16 lets it, pickling every read item
twice; 0.19 asks for ``no_dist`` itself). Calls that say ``no_dist``, or run on a larger group,
are left as they are, and nothing is wrapped outside a one-rank group or after the load."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend
from megatron_ckpt_ext.backend import load_metadata

pytestmark = pytest.mark.unit


def _state(fill: float | None = None) -> dict:
    st = backend.sharded_tensor_cls()
    return {f"w{i}": st.from_rank_offsets(
        f"w{i}", torch.full((64,), fill) if fill is not None else torch.arange(64.0) + i,
        replica_id=0) for i in range(3)}


def test_a_one_rank_load_asks_dcp_for_no_collective(one_rank_group, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import utils

    with Checkpointer(CkptOptions()) as ck:
        ck.save(_state(), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
    real, use_dist = utils._DistWrapper.__init__, []

    def init(self, group, use, *args, **kwargs):
        use_dist.append(use)
        real(self, group, use, *args, **kwargs)

    monkeypatch.setattr(utils._DistWrapper, "__init__", init)
    before = {name: getattr(dcp, name) for name in ("load_state_dict", "load")}
    with Checkpointer(CkptOptions()) as ck:
        got = ck.load(_state(0.0), tmp_path)
    assert use_dist and not any(use_dist), use_dist  # every DCP load of it planned locally
    assert all(torch.equal(got[f"w{i}"], torch.arange(64.0) + i) for i in range(3))
    assert all(getattr(dcp, name) is fn for name, fn in before.items())  # put back after it


class _Dist:
    def __init__(self, size: int, default: int = 1) -> None:
        self.size, self.default = size, default

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group=None) -> int:
        return self.default if group is None else self.size


def _fake_load(state_dict, storage_reader, process_group=None, coordinator_rank=0,
               no_dist=False, planner=None):
    return no_dist


def test_a_call_that_says_no_dist_or_runs_on_a_larger_group_is_left_alone():
    local = load_metadata._planned_locally(_fake_load, _Dist(1))
    assert local({}, None) is True
    assert local({}, None, None, 0, False) is False  # said positionally
    assert local({}, None, no_dist=False) is False
    on_two = load_metadata._planned_locally(_fake_load, _Dist(2))
    assert on_two({}, None, process_group=object()) is False
    # a wrapper left installed while the default group grew: the collectives run
    assert load_metadata._planned_locally(_fake_load, _Dist(2, default=2))({}, None) is False


def test_nothing_is_wrapped_without_a_one_rank_group():
    before = dcp.load_state_dict
    with load_metadata.planned_on_each_rank() as applies:
        assert applies is False
        assert dcp.load_state_dict is before
    assert dcp.load_state_dict is before


def test_megatron_core_019s_positional_reader_call_goes_through(one_rank_group, tmp_path):
    """megatron-core 0.19 calls ``dcp.load(state_dict, reader, planner=..., no_dist=True)``:
    the reader positionally, which torch's ``_api_bc_check`` accepts although the signature
    makes it keyword-only. Inside the one-rank wrapper that call loads (it raised
    ``TypeError: too many positional arguments`` on every one-rank load of 0.19), and a call of
    that form without ``no_dist`` gets it."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    want = {"a": torch.arange(8.0), "b": torch.ones(3)}
    dcp.save(want, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    with load_metadata.planned_on_each_rank() as applies:
        assert applies is True
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, FileSystemReader(str(tmp_path)), no_dist=True)
        assert all(torch.equal(got[k], v) for k, v in want.items())
    seen = []

    def inner(state_dict, *, storage_reader=None, planner=None, process_group=None,
              no_dist=False):
        seen.append(no_dist)

    @functools.wraps(inner)
    def bc_checked(*args, **kwargs):  # what torch's _api_bc_check does with two positionals
        if len(args) == 2:
            kwargs["storage_reader"] = args[1]
            return inner(args[0], **kwargs)
        return inner(*args, **kwargs)

    local = load_metadata._planned_locally(bc_checked, _Dist(1))
    local({}, object())
    local({}, object(), no_dist=False)
    local({}, object(), planner=None, no_dist=True)
    local({}, storage_reader=object())
    assert seen == [True, False, True, True]


def test_every_size_plans_locally_on_the_installing_thread_only():
    """For a load that agrees on failures itself (load/loader.py), a call on a group of any size
    plans locally, but only on the thread that installed the wrapper: a DCP load some other
    thread runs meanwhile keeps its collectives."""
    import threading

    local = load_metadata._planned_locally(_fake_load, _Dist(4, default=4), every_size=True)
    assert local({}, None) is True
    assert local({}, None, process_group=object()) is True
    assert local({}, None, no_dist=False) is False  # said: left as it is
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(local({}, None)))
    thread.start()
    thread.join()
    assert elsewhere == [False]


def test_a_deprecated_loads_warning_names_its_caller_not_the_wrapper():
    """torch's ``load_state_dict`` is ``@deprecated`` (FutureWarning), and megatron-core <= 0.16
    calls it: through the wrapper its warning still names the line that calls it (as without
    the wrapper), never load_metadata.py, and the call still plans locally. A function that is
    not deprecated warns nothing."""
    import warnings

    from typing_extensions import deprecated

    old = deprecated("old_load is going", category=FutureWarning)(_fake_load)
    local = load_metadata._planned_locally(old, _Dist(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert local({}, None) is True
        line = __import__("inspect").currentframe().f_lineno - 1
        assert load_metadata._planned_locally(_fake_load, _Dist(1))({}, None) is True
    assert [(str(w.message), w.category, w.filename, w.lineno) for w in caught] == [
        ("old_load is going", FutureWarning, __file__, line)]
    silent = deprecated("never said", category=None)(_fake_load)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_metadata._planned_locally(silent, _Dist(1))({}, None) is True
    assert caught == []
