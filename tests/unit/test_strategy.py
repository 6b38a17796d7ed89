"""strategy.py: what the options build, on the installed megatron-core."""

from __future__ import annotations

import collections
import dataclasses
from functools import partial

from megatron_ckpt_ext import backend, strategy
from megatron_ckpt_ext.options import CkptOptions


def test_save_strategy_threads_and_fully_parallel_wrapper():
    s = strategy.save_strategy(CkptOptions(dist_ckpt_workers=3))
    assert isinstance(s, backend.fully_parallel_save_wrapper_cls())
    assert s.base_strategy.thread_count == 3
    plain = strategy.save_strategy(CkptOptions(ckpt_fully_parallel_save=False))
    assert isinstance(plain, backend.torch_dist_save_strategy_cls()) and plain.thread_count == 1


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


def test_sequential_request_swaps_only_a_forking_writer():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    R = collections.namedtuple("R", "async_fn async_fn_args")
    other = R(async_fn=partial(print, 1), async_fn_args=())
    assert strategy.sequential_request(other, CkptOptions()) is other
    req = R(async_fn=partial(FileSystemWriterAsync.write_preloaded_data_multiproc, [], False), async_fn_args=())
    swapped = strategy.sequential_request(req, CkptOptions())
    assert swapped.async_fn.func is strategy.write_buckets_inline
    assert strategy.sequential_request(req, CkptOptions(dist_ckpt_workers=2)) is req
