"""Direct reads (backend/direct_read.py): where a torch.save'd tensor's bytes lie, found without
unpickling the tensor, for every dtype and shape the reader takes, and refusals (with a reason)
for what it does not take."""

from __future__ import annotations

import io
import os

import pytest
import torch

from megatron_ckpt_ext.backend import direct_read


def _item(tmp_path, tensor, pad=123):
    """One file: ``pad`` junk bytes, then the tensor as torch DCP writes an item."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    path = tmp_path / "f.distcp"
    path.write_bytes(b"x" * pad + buf.getvalue() + b"tail")
    return os.open(path, os.O_RDONLY), pad, len(buf.getvalue())


def _read(fd, layout, offsets, lengths):
    start, nbytes = layout.span(offsets, lengths)
    out = torch.empty(nbytes, dtype=torch.uint8)
    direct_read.pread_into(fd, direct_read.tensor_bytes(out), start, "f.distcp")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.bool, torch.float64])
def test_the_bytes_found_are_the_tensor_bytes(tmp_path, dtype):
    t = (torch.randn(6, 5) * 10).to(dtype)
    fd, off, n = _item(tmp_path, t)
    try:
        layout, why = direct_read.item_layout(fd, off, n)
        assert layout is not None, why
        assert (layout.dtype, layout.size) == (dtype, (6, 5))
        got = _read(fd, layout, (0, 0), (6, 5)).view(dtype).view(6, 5)
        assert torch.equal(got, t)
        rows = _read(fd, layout, (2, 0), (3, 5)).view(dtype).view(3, 5)  # whole rows of dim 0
        assert torch.equal(rows, t[2:5])
        assert layout.span((0, 1), (6, 2)) is None  # columns are not one range
    finally:
        os.close(fd)


def test_a_view_with_a_storage_offset_and_a_scalar(tmp_path):
    base = torch.arange(20, dtype=torch.float32)
    fd, off, n = _item(tmp_path, base[7:])  # torch.save keeps the whole storage
    try:
        layout, why = direct_read.item_layout(fd, off, n)
        assert torch.equal(_read(fd, layout, (0,), (13,)).view(torch.float32), base[7:])
    finally:
        os.close(fd)
    fd, off, n = _item(tmp_path, torch.tensor(3.5))
    try:
        layout, why = direct_read.item_layout(fd, off, n)
        assert torch.equal(_read(fd, layout, (), ()).view(torch.float32), torch.tensor([3.5]))
    finally:
        os.close(fd)


def test_what_it_does_not_read_directly_is_refused_with_a_reason(tmp_path):
    fd, off, n = _item(tmp_path, torch.randn(4, 3).t())  # saved with transposed strides
    try:
        layout, _ = direct_read.item_layout(fd, off, n)
        assert layout is not None and layout.span((0, 0), (3, 4)) is None
    finally:
        os.close(fd)
    for obj, reason in [({"not": "a tensor"}, "not one tensor"),
                        (torch.nn.Parameter(torch.randn(3)), "plain tensor")]:
        fd, off, n = _item(tmp_path, obj)
        try:
            layout, why = direct_read.item_layout(fd, off, n)
            assert layout is None and reason in why, why
        finally:
            os.close(fd)
    fd, off, n = _item(tmp_path, torch.randn(4))
    try:  # a window cut short (a wrong length in the metadata, a truncated file)
        layout, why = direct_read.item_layout(fd, off, n - 30)
        assert layout is None and why
    finally:
        os.close(fd)


def test_a_short_file_is_an_error_naming_it(tmp_path):
    t = torch.randn(1000)
    fd, off, n = _item(tmp_path, t)
    try:
        layout, _ = direct_read.item_layout(fd, off, n)
        start, nbytes = layout.span((0,), (1000,))
        out = torch.empty(nbytes + (1 << 20), dtype=torch.uint8)  # past the end of the file
        with pytest.raises(OSError, match="f.distcp: the file ends"):
            direct_read.pread_into(fd, direct_read.tensor_bytes(out), start, "f.distcp")
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 3, 8, 64])
def test_stripes_cover_every_chunk_once_in_file_order(threads):
    """Each reading thread gets one run of consecutive chunks (a cold disk streams it); together
    they are every chunk, once, in order, and no more runs than threads."""
    from megatron_ckpt_ext.backend.load_reader import _stripes

    chunks = [("f", a, a + n) for a, n in zip(range(0, 10_000, 100), [7, 100, 33] * 34)]
    stripes = _stripes(chunks, threads)
    assert [c for s in stripes for c in s] == chunks
    assert 1 <= len(stripes) <= threads
    if threads > 1:
        assert len(stripes) > 1


def test_the_gaps_between_the_items_a_load_reads():
    """What a load must read besides its items to sum a whole file: the ranges between them;
    none when items overlap (one item read twice) or run past the file's end."""
    from megatron_ckpt_ext.backend.load_reader import _gaps

    assert _gaps([(10, 5), (0, 10)], 20) == [(15, 5)]
    assert _gaps([(5, 5)], 12) == [(0, 5), (10, 2)]
    assert _gaps([(0, 20)], 20) == []
    assert _gaps([(0, 10), (5, 10)], 20) is None
    assert _gaps([(0, 30)], 20) is None


def test_the_host_chunks_are_made_as_asked_and_never_more_than_the_count():
    """A load's host chunks are made when a thread asks and none is free (not all up front,
    where every reading thread waited for the pinning of all of them), at most ``count``; past
    that a thread waits for one given back."""
    import threading

    pool = direct_read.PinnedChunks(3, 1 << 10, pin=False)
    assert pool.made == 0
    a = pool.take()
    assert pool.made == 1 and a.numel() == 1 << 10
    pool.give(a)
    assert pool.take() is a and pool.made == 1  # a free one is lent again, none made
    b, c = pool.take(), pool.take()
    assert pool.made == 3 and len({id(a), id(b), id(c)}) == 3
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and pool.made == 3  # at the count: waits, makes none
    pool.give(b)
    waiter.join(5)
    assert got == [b] and pool.made == 3


@pytest.mark.parametrize("tensor", [torch.randn(100), torch.arange(7), torch.zeros(0),
                                    torch.randn(3, 5).to(torch.bfloat16), torch.randn(1 << 16),
                                    torch.randn(6, 4).t()],
                         ids=["f32", "i64", "empty", "bf16", "256KiB", "transposed"])
def test_the_short_directory_parse_finds_what_zipfile_finds(tmp_path, monkeypatch, tensor):
    """The item's zip directory parsed from its end records gives the same layout as zipfile's
    reading of it (the fallback), for the archives torch.save writes."""
    fd, pad, n = _item(tmp_path, tensor)
    window = direct_read._Window(fd, pad, n)
    assert direct_read._central_directory(window, n) is not None  # the short path is taken
    short = direct_read.item_layout(fd, pad, n)
    monkeypatch.setattr(direct_read, "_central_directory", lambda window, length: None)
    assert direct_read.item_layout(fd, pad, n) == short


def test_an_archive_the_short_parse_does_not_take_is_read_by_zipfile(tmp_path):
    """A zip comment (not what torch.save writes) sends the item to zipfile, which reads it."""
    import zipfile

    buf = io.BytesIO()
    torch.save(torch.arange(10, dtype=torch.float32), buf)
    with zipfile.ZipFile(buf, "a") as z:
        z.comment = b"added"
    data = buf.getvalue()
    path = tmp_path / "c.distcp"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    assert direct_read._central_directory(direct_read._Window(fd, 0, len(data)), len(data)) is None
    layout, why = direct_read.item_layout(fd, 0, len(data))
    assert layout is not None, why
    got = torch.empty(10, dtype=torch.float32)
    direct_read.pread_into(fd, direct_read.tensor_bytes(got.view(torch.uint8)), layout.start, "c")
    assert torch.equal(got, torch.arange(10, dtype=torch.float32))


def test_chunks_made_ahead_are_lent_made_and_never_more_than_the_count():
    """``make_ahead`` (a thread before the load) makes every chunk not made yet; the load's
    threads then take made ones, and a thread asking meanwhile never takes the count past it."""
    pool = direct_read.PinnedChunks(4, 1 << 10, pin=False)
    first = pool.take()  # a reading thread that came first
    pool.make_ahead()
    assert pool.made == 4
    lent = [pool.take() for _ in range(3)]
    assert pool.made == 4 and len({id(t) for t in [first, *lent]}) == 4
    pool.give(first)
    pool.make_ahead()  # all made: nothing more
    assert pool.made == 4 and pool.take() is first


def test_a_chunk_that_cannot_be_made_ahead_is_left_to_the_load(monkeypatch):
    pool = direct_read.PinnedChunks(3, 1 << 10, pin=False)
    real, calls = torch.empty, []

    def failing(*a, **k):  # noqa: ANN002, ANN003
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("cudaHostAlloc failed")
        return real(*a, **k)

    monkeypatch.setattr(torch, "empty", failing)
    pool.make_ahead()  # one made, then the failure stops it without raising
    assert pool.made == 1
    monkeypatch.setattr(torch, "empty", real)
    got = [pool.take(), pool.take(), pool.take()]  # the load makes the other two
    assert pool.made == 3 and len({id(t) for t in got}) == 3


def test_the_kept_chunks_are_released_once_and_a_later_load_makes_new_ones():
    direct_read.PinnedChunks.release_shared()
    assert not direct_read.PinnedChunks.release_shared()  # nothing kept
    pool = direct_read.PinnedChunks.shared(2, 1 << 10, pin=False)
    pool.give(pool.take())
    assert direct_read.PinnedChunks.kept()
    assert direct_read.PinnedChunks.release_shared() and not direct_read.PinnedChunks.kept()
    assert pool._free.empty()  # its chunks dropped, not lent again
    again = direct_read.PinnedChunks.shared(2, 1 << 10, pin=False)
    assert again is not pool and again.made == 0
    direct_read.PinnedChunks.release_shared()


def test_an_items_header_pages_are_asked_of_the_kernel_at_both_ends(monkeypatch):
    """prefetch_edges (the load's metadata step, and the layouts parsed ahead) asks for the
    EDGE bytes at each end of the item, once for an item shorter than that."""
    asked = []
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, at, n, advice: asked.append((at, n, advice)))
    edge = direct_read.EDGE
    direct_read.prefetch_edges(3, 1000, 10 * edge)
    assert sorted(asked) == [(1000, edge, os.POSIX_FADV_WILLNEED),
                             (1000 + 9 * edge, edge, os.POSIX_FADV_WILLNEED)]
    asked.clear()
    direct_read.prefetch_edges(3, 1000, edge // 2)
    assert asked == [(1000, edge, os.POSIX_FADV_WILLNEED)]


def test_pinned_chunks_released_one_at_a_time_when_paced(monkeypatch):
    """Freeing pinned memory holds every CUDA call of the process: paced, torch's cache is
    emptied after each chunk (a copy beside it waits for one chunk's free, not all of them)."""
    calls = []
    monkeypatch.setattr(direct_read, "_host_cache_emptier",
                        lambda: lambda: calls.append(len(pool._free.queue)))  # chunks left
    direct_read.PinnedChunks.release_shared()
    pool = direct_read.PinnedChunks.shared(3, 1 << 10, pin=True)
    for _ in range(3):
        pool.give(object())  # stand-ins for pinned chunks (no CUDA here)
    assert direct_read.PinnedChunks.release_shared(pace_s=0.001)
    assert calls == [2, 1, 0, 0]  # after each chunk went, then once more
    calls.clear()
    pool = direct_read.PinnedChunks.shared(3, 1 << 10, pin=True)
    for _ in range(3):
        pool.give(object())
    assert direct_read.PinnedChunks.release_shared()  # unpaced: all at once
    assert calls == [0]


def test_chunks_pinned_ahead_are_the_reading_threads_two_each(monkeypatch):
    """A summing thread's chunk is made only when a load sums on the host and asks for it."""
    from megatron_ckpt_ext.backend import load_reader

    pool = direct_read.PinnedChunks(2 * 3 + 2, 1 << 10, pin=False)
    monkeypatch.setattr(load_reader, "host_chunks",
                        lambda threads, checksum: pool if (threads, checksum) == (3, 2) else None)
    load_reader.pin_chunks_ahead(3, 2).join(10)
    assert pool.made == 6
    held = [pool.take() for _ in range(8)]  # a load that sums on the host makes the rest
    assert pool.made == 8 and len({id(t) for t in held}) == 8


def test_the_shared_pool_takes_the_read_piece_size_set_at_run_time(monkeypatch):
    """The pinned chunks follow ``DEFAULT_CHUNK`` as it is when the load asks (a benchmark's
    --chunk-mib sets it): a piece larger than its chunk would be read short."""
    direct_read.PinnedChunks.release_shared()
    monkeypatch.setattr(direct_read, "DEFAULT_CHUNK", 3 << 10)
    assert direct_read.PinnedChunks.shared(2, pin=False).chunk == 3 << 10
    direct_read.PinnedChunks.release_shared()
