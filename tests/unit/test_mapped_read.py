"""The zero-copy half of a warm load (backend/mapped_read.py), driven on the CPU: the device side
(registration, the copy, its event) is a stand-in that records what it was asked; the mapping,
the residency check, the segments and the two halves' sharing of the work are the real ones."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_ckpt_ext.backend import mapped_read
from megatron_ckpt_ext.backend.load_reader import _ItemPlan
from megatron_ckpt_ext.backend.mapped_read import Mapping, ZeroCopy, segments

SEG = 64 << 10  # small segments: a few KiB-sized items cross their boundaries


class Pages:
    """Registration and copies on the CPU, recorded; ``refuse_from``: the Nth registration and
    every later one fail."""

    def __init__(self, refuse_from: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.refuse_from = refuse_from
        self.refused = threading.Event()
        self.lock = threading.Lock()

    def register(self, addr: int, n: int) -> str:
        with self.lock:
            if self.refuse_from is not None and len(self.registered) >= self.refuse_from:
                self.refused.set()
                return "cudaErrorHostMemoryAlreadyRegistered"
            assert addr % mapped_read._PAGE == 0
            for a, m in self.registered:
                assert addr >= a + m or addr + n <= a, "overlapping registrations"
            self.registered.append((addr, n))
            return ""

    def unregister(self, addr: int) -> None:
        with self.lock:
            self.unregistered.append(addr)

    def copy(self, target, source) -> None:
        target.copy_(source)

    def event(self, device):
        class Done:
            def synchronize(self) -> None:
                pass
        return Done()


class Sums:
    def __init__(self) -> None:
        self.pieces = []

    def device_chunk(self, plan, offset, landed, copied, view) -> None:
        self.pieces.append((plan.what, offset, bytes(landed.numpy()), view[0:len(view)]))


class Busy:
    def add(self, name, since):
        import time
        return time.perf_counter()


@pytest.fixture
def files(tmp_path):
    """Two files of items at unaligned offsets (as torch.save's records lie), read once so
    every page is cached; plans reading every item whole, in file order."""
    g = torch.Generator().manual_seed(3)
    plans, fds = [], {}
    for name, sizes in (("a.distcp", [5000, 70000, 123, 200000]), ("b.distcp", [90000, 7])):
        data = torch.randint(0, 256, (sum(sizes) + 64 * len(sizes) + 100,), generator=g,
                             dtype=torch.uint8)
        path = tmp_path / name
        path.write_bytes(data.numpy().tobytes())
        path.read_bytes()
        fds[name] = os.open(path, os.O_RDONLY)
        at = 37
        for n in sizes:
            plans.append(_ItemPlan(None, target=torch.zeros(n, dtype=torch.uint8), span=(at, n),
                                   fd=fds[name], what=name))
            at += n + 64
    yield plans, fds, tmp_path
    for fd in fds.values():
        os.close(fd)


def _chunks(plans, chunk=50000):
    return [(p, a, min(a + chunk, p.span[1])) for p in plans for a in range(0, p.span[1], chunk)]


def _want(plan, tmp_path):
    raw = (tmp_path / plan.what).read_bytes()
    return raw[plan.span[0]:plan.span[0] + plan.span[1]]


def _run(plans, fds, pages, *, zero_threads=2, bounce_threads=2, sums=None, hold=None):
    """``hold``: an event the bounce reads wait for before their first segment."""
    maps = {name: Mapping(fd) for name, fd in fds.items()}
    zero = ZeroCopy(maps, fds, zero_threads, pages)
    bounced = []

    def read_pieces(pieces):  # the bounce reads, as load_reader's (pread into the target)
        if hold is not None:
            assert hold.wait(timeout=30)
        for plan, a, b in pieces:
            view = memoryview(plan.target.numpy())[a:b]
            os.preadv(plan.fd, [view], plan.span[0] + a)
            bounced.append(b - a)

    work = segments(_chunks(plans), zero.sizes(), seg=SEG)
    with ThreadPoolExecutor(max(1, bounce_threads)) as pool:
        jobs = zero.submit(work, read_pieces, lambda: None, pool, bounce_threads,
                           sums=sums, busy=Busy())
        for j in jobs:
            j.result()
    zero.close()
    return zero, work, sum(bounced)


def test_segments_cut_pieces_at_their_boundaries_and_cover_every_byte(files):
    plans, fds, _ = files
    sizes = {name: os.fstat(fd).st_size for name, fd in fds.items()}
    work = segments(_chunks(plans), sizes, seg=SEG)
    for s in work:
        assert s.start % SEG == 0 and s.end <= s.start + SEG
        assert s.end <= -(-sizes[s.what] // mapped_read._PAGE) * mapped_read._PAGE
        for plan, a, b in s.pieces:
            assert plan.what == s.what and s.start <= plan.span[0] + a < plan.span[0] + b <= s.end
    covered = {}
    for s in work:
        for plan, a, b in s.pieces:
            covered.setdefault(id(plan), []).append((a, b))
    for plan in plans:
        spans = sorted(covered[id(plan)])
        assert spans[0][0] == 0 and spans[-1][1] == plan.span[1]
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert any(len(s.pieces) > 1 for s in work) and len(work) > len(fds)


def test_both_halves_load_every_byte_and_every_registration_is_undone(files):
    plans, fds, tmp_path = files
    pages = Pages()
    zero, work, bounced = _run(plans, fds, pages)
    for plan in plans:
        assert bytes(plan.target.numpy()) == _want(plan, tmp_path)
    assert sorted(pages.unregistered) == sorted(a for a, _ in pages.registered)
    assert zero.segments == len(pages.registered) > 0
    assert zero.bytes + bounced == sum(p.span[1] for p in plans)
    assert not zero.failed


def test_a_refused_registration_leaves_the_rest_to_the_bounce_reads(files):
    plans, fds, tmp_path = files
    pages = Pages(refuse_from=1)  # the second registration fails: the bounce reads wait for it
    zero, _, bounced = _run(plans, fds, pages, zero_threads=1, bounce_threads=1,
                            hold=pages.refused)
    assert zero.failed == "cudaErrorHostMemoryAlreadyRegistered"
    assert len(pages.registered) == 1 and pages.unregistered == [pages.registered[0][0]]
    for plan in plans:
        assert bytes(plan.target.numpy()) == _want(plan, tmp_path)
    assert zero.bytes + bounced == sum(p.span[1] for p in plans)


def test_summed_pieces_go_to_the_device_sums_with_the_host_share_read_by_pread(files):
    plans, fds, tmp_path = files
    for p in plans:
        p.summed = True
    sums = Sums()
    zero, _, _ = _run(plans, fds, Pages(), zero_threads=2, bounce_threads=0, sums=sums)
    assert zero.bytes == sum(p.span[1] for p in plans)
    raw = {name: (tmp_path / name).read_bytes() for name in fds}
    assert sum(len(landed) for *_, landed, _ in sums.pieces) == zero.bytes
    for what, offset, landed, host in sums.pieces:
        assert landed == host == raw[what][offset:offset + len(landed)]


def test_residency_is_the_page_cache_s(files, tmp_path):
    plans, fds, _ = files
    m = Mapping(fds["a.distcp"])
    try:
        assert m.resident()
    finally:
        m.close()
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(8 << 20)  # a hole: no page of it was ever in the cache
    fd = os.open(sparse, os.O_RDONLY)
    try:
        m = Mapping(fd)
        assert not m.resident()
        m.close()
    finally:
        os.close(fd)


def test_a_load_onto_the_cpu_is_not_taken(files):
    plans, fds, _ = files

    class Files:
        def fd(self, what):
            return fds[what]

    assert ZeroCopy.open(Files(), plans, threads=2, summed_on_device=lambda p: True,
                         pages_factory=Pages) is None


def test_zero_copy_threads_are_half_the_reading_ones():
    assert [mapped_read.zero_copy_threads(n) for n in (1, 2, 8, 16)] == [1, 1, 4, 8]
