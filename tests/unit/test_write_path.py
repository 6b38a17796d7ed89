"""save/write_path.py: the ordered changes made to megatron-core's save request."""

from __future__ import annotations

import collections
import os
import queue
from functools import partial

import pytest

from megatron_ckpt_ext.hooks import SaveHooks
from megatron_ckpt_ext.options import CkptOptions
from megatron_ckpt_ext.save import write_path
from megatron_ckpt_ext.save.report import SaveRecord
from megatron_ckpt_ext.staging import InPlaceStager


def _ctx(options: CkptOptions, *, stager=None, hooks=None, is_async=True,
         persistent=False) -> write_path.WriteContext:
    return write_path.WriteContext(
        options=options, is_async=is_async, persistent=persistent, cpu_shim=False,
        stager=stager or InPlaceStager(), hooks=hooks or SaveHooks(),
        record=SaveRecord(iteration=1, root=None, started=0.0), rank=0)


def test_sequential_request_swaps_only_a_forking_writer():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if not hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc"):
        pytest.skip("this megatron-core's writer has no forking multiproc write (0.16's shape)")

    R = collections.namedtuple("R", "async_fn async_fn_args")
    other = R(async_fn=partial(print, 1), async_fn_args=())
    assert write_path.sequential(other, _ctx(CkptOptions())) is other
    req = R(async_fn=partial(FileSystemWriterAsync.write_preloaded_data_multiproc, [], False), async_fn_args=())
    swapped = write_path.sequential(req, _ctx(CkptOptions()))
    assert swapped.async_fn.func is write_path.write_buckets_inline
    assert write_path.sequential(req, _ctx(CkptOptions(dist_ckpt_workers=2))) is req


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
    wrapped = write_path.crc_free(R(async_fn=partial(_save_bytes, t), async_fn_args=()))
    assert torch.serialization.get_crc32_options() is True
    blob = wrapped.async_fn()
    assert _record_crcs(blob) == [0]                       # the writer skipped it
    assert torch.serialization.get_crc32_options() is True   # and left the process as it was
    assert _record_crcs(_save_bytes(t)) != [0]
    assert pickle.loads(pickle.dumps(wrapped.async_fn)).func is write_path.call_without_crc32
    monkeypatch.setenv("MCX_KEEP_CRC32", "1")
    plain = R(async_fn=partial(_save_bytes, t), async_fn_args=())
    assert write_path.crc_free(plain) is plain


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

    from tests._support.pagecache import can_drop_pages, resident_pages

    if not can_drop_pages(str(tmp_path)):
        pytest.skip(f"{tmp_path} is memory-backed: its pages cannot be dropped")
    monkeypatch.delenv("MCX_KEEP_PAGE_CACHE", raising=False)
    R = collections.namedtuple("R", "async_fn async_fn_args")
    results: queue.Queue = queue.Queue()
    kept = [(str(tmp_path / "kept.distcp"), "k", ([], []))]
    _write_buckets(0, kept, results)
    assert resident_pages(kept[0][0]) > 0  # control: a written file stays cached
    buckets = [(tmp_path / f"__0_{i}.distcp", "k", ([], [])) for i in range(2)]  # Path or str
    request = write_path.page_cache_free(R(async_fn=_write_buckets, async_fn_args=()))
    assert request.async_fn(0, buckets, results) == "written"  # the write's own result
    assert [resident_pages(str(b[0])) for b in buckets] == [0, 0]
    assert results.get_nowait() == 0 and results.get_nowait() == 0
    assert pickle.loads(pickle.dumps(request.async_fn)).func is write_path.call_then_drop_written_pages

    monkeypatch.setenv("MCX_KEEP_PAGE_CACHE", "1")
    plain = R(async_fn=_write_buckets, async_fn_args=())
    assert write_path.page_cache_free(plain) is plain


def test_bucket_files_are_found_among_the_write_arguments(tmp_path):
    buckets = [(tmp_path / "a", "k", ([], [])), ("b", "k", ([], []))]
    assert write_path.bucket_files((0, buckets, queue.Queue())) == [str(tmp_path / "a"), "b"]
    assert write_path.bucket_files((0, None, queue.Queue())) == []   # nvrx 0.7 before preload
    assert write_path.bucket_files(([], [("a", "k")])) == []          # not buckets
    write_path.drop_page_cache(str(tmp_path / "missing"))             # best effort: no error


# -- the order of the steps ----------------------------------------------------------------------
class _GateStager(InPlaceStager):
    def gate(self, write, *, timeout_s):
        return partial(_gate_marker, write), 7


class _WrapHooks(SaveHooks):
    def wrap_request(self, request, record):
        return request._replace(async_fn=partial(_hook_marker, request.async_fn))


def _gate_marker(fn, *args):
    return fn(*args)


def _hook_marker(fn, *args):
    return fn(*args)


def test_the_staging_gate_is_outermost_and_the_hooks_inside_it(monkeypatch):
    """Nothing of the write (hooks, CRC, page cache) may run before the copies landed; the
    gate's ticket goes to the save's record; the provider shape is applied last."""
    monkeypatch.delenv("MCX_KEEP_CRC32", raising=False)
    R = collections.namedtuple("R", "async_fn async_fn_args preload_fn")
    shaped = []
    monkeypatch.setattr(write_path.backend, "adapt_async_request",
                        lambda r: shaped.append(r.async_fn.func) or r)
    monkeypatch.setattr(write_path.backend, "without_host_preload", lambda r: r)
    ctx = _ctx(CkptOptions(dist_ckpt_workers=2), stager=_GateStager(), hooks=_WrapHooks())
    request = write_path.build(R(async_fn=partial(print), async_fn_args=(), preload_fn=None), ctx)
    chain, fn = [], request.async_fn
    while isinstance(fn, partial):
        chain.append(fn.func)
        fn = next((a for a in fn.args if callable(a)), None)
    assert chain[:2] == [_gate_marker, _hook_marker], chain
    assert write_path.call_without_crc32 in chain[2:] and chain[-1] is print
    assert ctx.record.held.seq == 7 and shaped == [_gate_marker]
    sync = _ctx(CkptOptions(), stager=_GateStager(), is_async=False)
    plain = write_path.build(R(async_fn=partial(print), async_fn_args=(), preload_fn=None), sync)
    assert plain.async_fn.func is not _gate_marker and sync.record.held.seq == 0


def test_a_persistent_worker_gets_a_write_for_a_rank_with_nothing_to_write():
    R = collections.namedtuple("R", "async_fn async_fn_args async_fn_kwargs")
    idle = R(async_fn=None, async_fn_args=None, async_fn_kwargs=None)
    noop = write_path.idle_worker_noop(idle, _ctx(CkptOptions(), persistent=True))
    assert noop.async_fn is write_path._nothing_to_write and noop.async_fn() is None
    assert write_path.idle_worker_noop(idle, _ctx(CkptOptions(), persistent=False)) is idle


def test_a_writer_that_bound_open_when_built_is_summed_too(tmp_path, monkeypatch):
    """nvrx 0.7's writer takes ``open_file=open`` when it is built and passes it to its write
    function (a partial): the checksum wrapper must reach that ``open`` too, or every data file
    of the newest stack goes into the manifest unverified."""
    import functools
    import zlib

    from megatron_ckpt_ext.save import write_path

    recorded = []
    monkeypatch.setattr(write_path, "record_sum", lambda *a: recorded.append(a))

    def write(transform_list, use_msc, open_file, path):
        with open_file(path, "wb") as fh:
            fh.write(b"abc" * 1000)

    path = str(tmp_path / "__0_0.distcp")
    write_path.call_with_checksums(functools.partial(write, [], False, open), path)
    assert recorded == [(path, 3000, zlib.crc32(b"abc" * 1000))]


class _OwnCopies(InPlaceStager):
    owns_copies = True  # as the shared-memory and host-copy stagers: the save owns its copies


def test_the_providers_preload_runs_in_the_writer_when_the_save_owns_its_copies(monkeypatch):
    """The trainer does not wait for the writer to run the preload (nvrx builds the write buckets
    there): the write runs it first, inside the gate, and passes its result as the provider
    would, as the write's second argument."""
    monkeypatch.delenv("MCX_KEEP_PRELOAD", raising=False)
    R = collections.namedtuple("R", "async_fn async_fn_args preload_fn")
    calls: list = []
    request = R(async_fn=lambda rank, buckets, q: calls.append(("write", rank, buckets, q)),
                async_fn_args=[3, None, "results"], preload_fn=lambda: calls.append("preload") or "B")
    moved = write_path.preload_in_writer(request, _ctx(CkptOptions(), stager=_OwnCopies()))
    assert moved.preload_fn is None and calls == []  # nothing runs in the trainer
    moved.async_fn(*moved.async_fn_args)
    assert calls == ["preload", ("write", 3, "B", "results")]
    # a step of every save's write path, applied before the gate: so it runs inside the gate,
    # once the staged copies it reads have landed
    steps = write_path.TRANSFORMS
    assert steps.index(write_path.preload_in_writer) < steps.index(write_path.gated)
    # left to the provider: tensors not copied by this save, a sync save, the debug switch
    assert write_path.preload_in_writer(request, _ctx(CkptOptions())) is request
    assert write_path.preload_in_writer(request, _ctx(CkptOptions(), stager=_OwnCopies(),
                                                      is_async=False)) is request
    monkeypatch.setenv("MCX_KEEP_PRELOAD", "1")
    assert write_path.preload_in_writer(request, _ctx(CkptOptions(), stager=_OwnCopies())) is request


def test_a_persistent_writers_write_collects_the_garbage_it_left(monkeypatch):
    """The persistent worker's loop keeps Python's collector off for its whole life (nvrx 0.4
    never collects): its write is followed by a collection there, once the write returned; not
    where the collector runs (the trainer), nor for a writer that exits after one save."""
    import gc

    R = collections.namedtuple("R", "async_fn async_fn_args preload_fn")
    collected: list = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append("collect") or 0)
    request = R(async_fn=lambda x: collected.append(("write", x)), async_fn_args=[1],
                preload_fn=None)
    wrapped = write_path.collected_in_worker(request, _ctx(CkptOptions(), persistent=True))
    was = gc.isenabled()
    gc.disable()  # as in the worker's loop
    try:
        wrapped.async_fn(7)
    finally:
        if was:
            gc.enable()
    assert collected == [("write", 7), "collect"]
    collected.clear()
    gc.enable()
    try:
        wrapped.async_fn(8)  # the collector runs here: nothing to add
    finally:
        if not was:
            gc.disable()
    assert collected == [("write", 8)]
    for ctx in (_ctx(CkptOptions()), _ctx(CkptOptions(), is_async=False, persistent=True)):
        assert write_path.collected_in_worker(request, ctx) is request
    steps = write_path.TRANSFORMS  # outermost but the provider's shape: after the whole write
    assert steps.index(write_path.gated) < steps.index(write_path.collected_in_worker) \
        < steps.index(write_path.provider_shaped)
