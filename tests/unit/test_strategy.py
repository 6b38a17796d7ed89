"""strategy.py: what the options build, on the installed megatron-core."""

from __future__ import annotations

import collections
import dataclasses
from functools import partial

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


def test_sequential_request_swaps_only_a_forking_writer():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    R = collections.namedtuple("R", "async_fn async_fn_args")
    other = R(async_fn=partial(print, 1), async_fn_args=())
    assert strategy.sequential_request(other, CkptOptions()) is other
    req = R(async_fn=partial(FileSystemWriterAsync.write_preloaded_data_multiproc, [], False), async_fn_args=())
    swapped = strategy.sequential_request(req, CkptOptions())
    assert swapped.async_fn.func is strategy.write_buckets_inline
    assert strategy.sequential_request(req, CkptOptions(dist_ckpt_workers=2)) is req


# -- torch.save's CRC-32 in the writer -----------------------------------------------------------
def _record_crcs(blob: bytes) -> list[int]:
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return [i.CRC for i in z.infolist() if "/data/" in i.filename]


def _save_bytes(tensor):
    import io

    import torch

    b = io.BytesIO()
    torch.save(tensor, b)
    return b.getvalue()


def test_request_write_runs_without_crc32_and_restores_it(monkeypatch):
    import pickle

    import torch

    monkeypatch.delenv("MCX_KEEP_CRC32", raising=False)
    R = collections.namedtuple("R", "async_fn async_fn_args")
    t = torch.arange(4096, dtype=torch.float32)
    wrapped = strategy.crc_free_request(R(async_fn=partial(_save_bytes, t), async_fn_args=()))
    assert torch.serialization.get_crc32_options() is True
    blob = wrapped.async_fn()
    assert _record_crcs(blob) == [0]                       # the writer skipped it
    assert torch.serialization.get_crc32_options() is True   # and left the process as it was
    assert _record_crcs(_save_bytes(t)) != [0]
    assert pickle.loads(pickle.dumps(wrapped.async_fn)).func is strategy.call_without_crc32
    monkeypatch.setenv("MCX_KEEP_CRC32", "1")
    plain = R(async_fn=partial(_save_bytes, t), async_fn_args=())
    assert strategy.crc_free_request(plain) is plain


def test_torch_load_reads_records_without_crc_and_never_checks_it():
    """Why skipping the CRC loses nothing: torch.load (which megatron-core and DCP read every
    tensor record with) loads a CRC-free record, and loads a record whose bytes changed after
    its CRC was written without noticing."""
    import io

    import torch

    t = torch.arange(1000, dtype=torch.float32)
    torch.serialization.set_crc32_options(False)
    try:
        free = _save_bytes(t)
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.equal(torch.load(io.BytesIO(free)), t)
    raw = bytearray(_save_bytes(t))
    raw[raw.find(t.numpy().tobytes()[400:408]) + 1] ^= 0xFF
    assert not torch.equal(torch.load(io.BytesIO(bytes(raw))), t)
