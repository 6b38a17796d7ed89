"""strategy.py: what the options build, on the installed megatron-core."""

from __future__ import annotations

import dataclasses

from megatron_ckpt_ext import backend, strategy
from megatron_ckpt_ext.options import CkptOptions


def test_save_strategy_threads_and_fully_parallel_wrapper(monkeypatch):
    monkeypatch.setattr(strategy, "_group_size", lambda group: 2)
    s = strategy.save_strategy(CkptOptions(dist_ckpt_workers=3))
    assert isinstance(s, backend.fully_parallel_save_wrapper_cls())
    assert s.base_strategy.thread_count == 3
    plain = strategy.save_strategy(CkptOptions(ckpt_fully_parallel_save=False))
    assert isinstance(plain, backend.torch_dist_save_strategy_cls()) and plain.thread_count == 1


def test_one_rank_data_parallel_group_gets_no_fully_parallel_wrapper(monkeypatch):
    """Nothing to spread over one replica, and the wrapper would re-validate every save."""
    sizes = []
    monkeypatch.setattr(strategy, "_group_size", lambda group: sizes.append(group) or 1)
    s = strategy.save_strategy(CkptOptions(dist_ckpt_workers=3), dp_group="DP")
    assert isinstance(s, backend.torch_dist_save_strategy_cls()) and s.thread_count == 3
    assert sizes == ["DP"]
    assert strategy._group_size(None) == 1  # no process group here


def test_constant_structure_turns_on_cached_metadata():
    s = strategy.save_strategy(CkptOptions(ckpt_fully_parallel_save=False, ckpt_assume_constant_structure=True))
    assert s.use_cached_ckpt_structure is True


def test_load_strategy_fully_parallel_only_with_cuda():
    caps = backend.detect()
    opts = CkptOptions(ckpt_fully_parallel_load=True)
    assert strategy.load_strategy(opts, caps=dataclasses.replace(caps, cuda_available=False)) is None
    wrapped = strategy.load_strategy(opts, caps=dataclasses.replace(caps, cuda_available=True))
    assert isinstance(wrapped, backend.fully_parallel_load_wrapper_cls())
    assert strategy.load_strategy(CkptOptions(), caps=caps) is None
