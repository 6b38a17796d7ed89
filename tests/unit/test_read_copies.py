"""A load's reading threads and their copies to the device (backend/read_copies.py): a thread
reads its next chunk while its last one's copy runs, waits only where more than ``IN_FLIGHT``
of its copies are in flight, gives each chunk back once its copy has landed, and ends a stripe
with every chunk back and every copy landed. Copies and events are stood in for (no device)."""

from __future__ import annotations

import threading

import pytest

from megatron_ckpt_ext.backend import direct_read, load_reader, read_copies


class _Copy:
    """An event for one issued copy: ``query`` is whether it has landed, ``synchronize`` waits
    for it (it has landed after)."""

    def __init__(self, log: list, name: str, landed: bool = False) -> None:
        self.log, self.name, self.landed = log, name, landed

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        if not self.landed:  # a wait only where the copy still runs
            self.log.append(("waited", self.name))
        self.landed = True


class _Busy:
    def __init__(self) -> None:
        self.h2d = 0

    def add(self, name: str, since: float) -> float:
        assert name == "h2d"
        self.h2d += 1
        return since


@pytest.fixture
def pool():
    return direct_read.PinnedChunks(4, 16, pin=False)


def test_a_thread_waits_for_a_copy_only_past_the_one_in_flight(pool):
    log, busy = [], _Busy()
    a, b, c = pool.take(), pool.take(), pool.take()
    read_copies.in_flight(_Copy(log, "a"), pool, a, busy)
    assert log == [] and pool._free.qsize() == 0  # a's copy runs while the next chunk is read
    read_copies.in_flight(_Copy(log, "b"), pool, b, busy)
    assert log == [("waited", "a")] and pool._free.get_nowait() is a  # at most one in flight
    read_copies.in_flight(_Copy(log, "c", landed=True), pool, c, busy)
    # b had not landed: waited for; c had, and goes back without a wait
    assert log == [("waited", "a"), ("waited", "b")]
    read_copies.copies_landed(busy, keep=0)
    assert log == [("waited", "a"), ("waited", "b")]  # c needed no wait
    assert {id(pool._free.get_nowait()) for _ in range(2)} == {id(b), id(c)}
    assert busy.h2d == 3


def test_a_landed_copy_goes_back_before_the_thread_would_wait(pool):
    log, busy = [], _Busy()
    a, b = pool.take(), pool.take()
    first = _Copy(log, "a")
    read_copies.in_flight(first, pool, a, busy)
    first.landed = True
    read_copies.copies_landed(busy, keep=read_copies.IN_FLIGHT)
    assert log == [] and pool._free.get_nowait() is a
    read_copies.in_flight(_Copy(log, "b"), pool, b, busy)
    read_copies.copies_landed(busy, keep=0)
    assert log == [("waited", "b")]


def test_a_stripe_ends_with_every_copy_landed_and_every_chunk_back(monkeypatch, pool):
    """The reading loop (load_reader._read_stripe) over chunks whose copies never land by
    themselves: when it returns, and when it raises, each was waited for and given back."""
    log, seen = [], []

    def read_chunk(plan, a, b, settings, busy, sums):
        if plan == "bad":
            raise OSError("short read")
        buf = pool.take()
        seen.append(buf)
        read_copies.in_flight(_Copy(log, f"{plan}{a}"), pool, buf, busy)

    monkeypatch.setattr(load_reader, "_read_chunk", read_chunk)
    stripe = [("x", 0, 1), ("x", 1, 2), ("y", 0, 1)]
    load_reader._read_stripe(stripe, None, _Busy(), None)
    assert sorted(log) == [("waited", "x0"), ("waited", "x1"), ("waited", "y0")]
    assert pool._free.qsize() == pool.made <= 2  # never more than two a thread
    log.clear()
    with pytest.raises(OSError):
        load_reader._read_stripe([("x", 0, 1), ("bad", 0, 1)], None, _Busy(), None)
    assert log == [("waited", "x0")] and pool._free.qsize() == pool.made


def test_threads_keep_their_own_copies_in_flight(pool):
    """Each reading thread waits for its own copies only (another's landing late holds it not)."""
    log, busy = [], _Busy()
    mine = pool.take()
    read_copies.in_flight(_Copy(log, "main"), pool, mine, busy)

    def other():
        buf = pool.take()
        read_copies.in_flight(_Copy(log, "other"), pool, buf, busy)
        read_copies.copies_landed(busy, keep=0)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(5)
    assert log == [("waited", "other")]
    read_copies.copies_landed(busy, keep=0)
    assert log == [("waited", "other"), ("waited", "main")]
