"""SpoolQueue: the write-results queue with no server process (megatron_ckpt_ext/spool.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue

import pytest

from megatron_ckpt_ext.spool import SpoolQueue


def _put_from_child(q: SpoolQueue, items: list) -> None:
    for item in items:
        q.put(item)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_results_put_by_a_writer_process_are_read_in_order_once(method):
    q = SpoolQueue()
    try:
        with pytest.raises(queue.Empty):
            q.get_nowait()
        ctx = mp.get_context(method)
        p = ctx.Process(target=_put_from_child, args=(q, [{"bucket": 0}, ValueError("x"), 3]))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        # complete once put() returned in the writer: the trainer's get_nowait finds them all
        assert q.qsize() == 3 and not q.empty()
        assert q.get_nowait() == {"bucket": 0}
        err = q.get_nowait()
        assert isinstance(err, ValueError) and str(err) == "x"
        assert q.get(timeout=1) == 3
        with pytest.raises(queue.Empty):
            q.get(timeout=0.05)
        assert q.empty()
    finally:
        q.close()
    assert not os.path.exists(q.directory)


def test_only_the_creator_removes_the_directory():
    q = SpoolQueue()
    attached = pickle.loads(pickle.dumps(q))  # what a writer process holds
    assert attached.directory == q.directory
    attached.put("late")
    attached.close()  # a writer's close is a no-op
    assert os.path.isdir(q.directory) and q.get_nowait() == "late"
    q.close()
    assert not os.path.exists(q.directory)
    with pytest.raises(queue.Empty):  # a closed queue reads as empty, never stale
        q.get_nowait()


def test_a_put_in_progress_is_never_read_half_written():
    q = SpoolQueue()
    try:
        with open(os.path.join(q.directory, ".00000000000000000001_1_000000"), "wb") as fh:
            fh.write(b"\x80partial")  # a writer's temp file before its rename
        with pytest.raises(queue.Empty):
            q.get_nowait()
        q.put("whole")
        assert q.get_nowait() == "whole"
    finally:
        q.close()


def test_directories_of_dead_creators_are_swept_and_live_ones_kept(tmp_path):
    from megatron_ckpt_ext import spool

    ctx = mp.get_context("fork")
    child = ctx.Process(target=int)
    child.start()
    child.join(30)
    dead = tmp_path / f"mcx-results-{child.pid}-abc"
    live = tmp_path / f"mcx-results-{os.getpid()}-def"
    other = tmp_path / "mcx-results-notapid-x"
    for d in (dead, live, other):
        d.mkdir()
        (d / "000_1_000001").write_bytes(b"stale result")
    assert spool.sweep_stale(str(tmp_path)) == [dead.name]
    assert not dead.exists() and live.exists() and other.exists()
    q = SpoolQueue()
    try:  # a new queue's directory names its creator
        assert os.path.basename(q.directory).startswith(f"mcx-results-{os.getpid()}-")
    finally:
        q.close()
