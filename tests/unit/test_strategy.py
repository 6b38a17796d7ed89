"""strategy.py: what the options build, on the installed megatron-core."""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
from functools import partial

import pytest

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


def _write_buckets(rank, buckets, results_queue, nbytes=4 << 20):
    """A writer like megatron-core's: every bucket file written and fsync'd."""
    for path, _key, _data in buckets:
        with open(path, "wb") as f:
            f.write(os.urandom(nbytes))
            f.flush()
            os.fsync(f.fileno())
    results_queue.put(rank)
    return "written"


def test_written_checkpoint_files_leave_the_page_cache(tmp_path, monkeypatch):
    import pickle

    from tests._pagecache import can_drop_pages, resident_pages

    if not can_drop_pages(str(tmp_path)):
        pytest.skip(f"{tmp_path} is memory-backed: its pages cannot be dropped")
    monkeypatch.delenv("MCX_KEEP_PAGE_CACHE", raising=False)
    R = collections.namedtuple("R", "async_fn async_fn_args")
    results: queue.Queue = queue.Queue()
    kept = [(str(tmp_path / "kept.distcp"), "k", ([], []))]
    _write_buckets(0, kept, results)
    assert resident_pages(kept[0][0]) > 0  # control: a written file stays cached
    buckets = [(tmp_path / f"__0_{i}.distcp", "k", ([], [])) for i in range(2)]  # Path or str
    request = strategy.page_cache_free_request(R(async_fn=_write_buckets, async_fn_args=()))
    assert request.async_fn(0, buckets, results) == "written"  # the write's own result
    assert [resident_pages(str(b[0])) for b in buckets] == [0, 0]
    assert results.get_nowait() == 0 and results.get_nowait() == 0
    assert pickle.loads(pickle.dumps(request.async_fn)).func is strategy.call_then_drop_written_pages

    monkeypatch.setenv("MCX_KEEP_PAGE_CACHE", "1")
    plain = R(async_fn=_write_buckets, async_fn_args=())
    assert strategy.page_cache_free_request(plain) is plain


def test_bucket_files_are_found_among_the_write_arguments(tmp_path):
    buckets = [(tmp_path / "a", "k", ([], [])), ("b", "k", ([], []))]
    assert strategy.bucket_files((0, buckets, queue.Queue())) == [str(tmp_path / "a"), "b"]
    assert strategy.bucket_files((0, None, queue.Queue())) == []   # nvrx 0.7 before preload
    assert strategy.bucket_files(([], [("a", "k")])) == []          # not buckets
    strategy.drop_page_cache(str(tmp_path / "missing"))             # best effort: no error
