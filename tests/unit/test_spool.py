"""SpoolQueue: the write-results queue with no server process (megatron_ckpt_ext/spool.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time

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


def _dead_pid() -> int:
    """A pid that no process has in our namespace (a reaped child's)."""
    child = mp.get_context("fork").Process(target=int)
    child.start()
    child.join(30)
    return child.pid


def _create_queue_and_wait(base: str, conn, fork_writer: bool) -> None:
    """A trainer: creates a queue under ``base``, optionally forks a writer that outlives it,
    reports, then waits to be told to die as a killed trainer does (no clean-up)."""
    from megatron_ckpt_ext import spool

    spool._base_dir = lambda: base
    q = SpoolQueue()
    q.put("in flight")
    writer = None
    if fork_writer:  # a forked writer inherits the creator's lock with the descriptor
        writer = mp.get_context("fork").Process(target=_wait_for_word, args=(conn,))
        writer.start()
    conn.send((q.directory, None if writer is None else writer.pid))
    if writer is None:
        _wait_for_word(conn)
    os._exit(0)  # killed: no finalizer, no rmtree


def _wait_for_word(conn) -> None:
    conn.recv()


def _start_creator(base, *, fork_writer=False):
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_create_queue_and_wait,
                                          args=(str(base), child, fork_writer))
    proc.start()
    child.close()  # so that the pipe reads EOF once the creator and its writer are gone
    directory, writer_pid = parent.recv()
    return proc, parent, directory, writer_pid


def _wait_gone(conn, pid: int | None = None) -> None:
    """Until every process holding the other end closed it, and the writer ``pid`` exited: its
    pipe end can close before its other descriptors (the queue's lock) do, at its exit. An
    orphaned writer's pid may linger as a zombie nobody reaps; its descriptors are gone then."""
    assert conn.poll(60), "the writer did not exit"
    with pytest.raises(EOFError):
        conn.recv()
    deadline = time.monotonic() + 60
    while pid is not None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # reaped
            return
        if state in "ZX":  # exited, descriptors closed
            return
        time.sleep(0.01)
    assert pid is None, f"writer {pid} still runs"


def test_a_live_queue_of_another_pid_namespace_is_never_swept(tmp_path):
    """Containers on one node share /dev/shm, not pids: the name's pid is dead here, but the
    creator lives and holds the queue's lock. Kept; swept once the creator is gone."""
    from megatron_ckpt_ext import spool

    proc, conn, directory, _ = _start_creator(tmp_path)
    try:
        # what the other container's trainer's directory looks like from ours
        foreign = tmp_path / f"mcx-results-{_dead_pid()}-foreign"
        os.rename(directory, foreign)  # the lock file (and the creator's lock on it) go along
        assert spool.sweep_stale(str(tmp_path)) == []
        assert (foreign / ".lock").is_file() and len(list(foreign.iterdir())) == 2
        assert SpoolQueue._attach(str(foreign)).get_nowait() == "in flight"
    finally:
        conn.send("die")
        proc.join(30)
    assert spool.sweep_stale(str(tmp_path)) == [foreign.name]
    assert not foreign.exists()


def test_a_killed_creators_directory_is_kept_while_its_writers_live(tmp_path):
    from megatron_ckpt_ext import spool

    proc, conn, directory, writer_pid = _start_creator(tmp_path, fork_writer=True)
    deadline = time.monotonic() + 60  # not join(): the writer inherited its sentinel pipe
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.exitcode == 0  # the trainer was killed; its forked writer still runs
    name = os.path.basename(directory)
    try:
        assert spool.sweep_stale(str(tmp_path)) == [] and os.path.isdir(directory)
        # a writer that unpickled the queue (spawned, persistent) holds it too
        attached = pickle.loads(pickle.dumps(SpoolQueue(directory, owner=False)))
    finally:
        conn.send("die")
    _wait_gone(conn, writer_pid)
    assert spool.sweep_stale(str(tmp_path)) == [] and os.path.isdir(directory)
    attached.close()  # the last holder lets go
    assert spool.sweep_stale(str(tmp_path)) == [name]
    assert not os.path.exists(directory)


def test_liveness_is_the_lock_not_the_pid_in_the_name(tmp_path, monkeypatch):
    from megatron_ckpt_ext import spool

    monkeypatch.setattr(spool, "_base_dir", lambda: str(tmp_path))
    ours = SpoolQueue()
    try:
        # a killed trainer's directory whose pid now belongs to a live process (ours): unheld
        reused = tmp_path / f"mcx-results-{os.getpid()}-reused"
        reused.mkdir()
        (reused / ".lock").touch()
        (reused / "000_1_000001").write_bytes(b"stale result")
        assert spool.sweep_stale(str(tmp_path)) == [reused.name]
        assert not reused.exists() and os.path.isdir(ours.directory)  # ours is held
        assert os.path.basename(ours.directory).startswith(f"mcx-results-{os.getpid()}-")
    finally:
        ours.close()
    assert not os.path.exists(ours.directory)


def test_directories_without_a_lock_are_swept_only_when_dead_and_old(tmp_path):
    """Left by a version before the lock (or a creator before it took its lock)."""
    from megatron_ckpt_ext import spool

    dead_pid = _dead_pid()
    old = time.time() - spool.LEGACY_MIN_AGE_S - 60
    dead_old = tmp_path / f"mcx-results-{dead_pid}-abc"
    dead_new = tmp_path / f"mcx-results-{dead_pid}-new"
    live_old = tmp_path / f"mcx-results-{os.getpid()}-def"
    other = tmp_path / "mcx-results-notapid-x"
    for d in (dead_old, dead_new, live_old, other):
        d.mkdir()
        (d / "000_1_000001").write_bytes(b"stale result")
        if d != dead_new:
            os.utime(d, (old, old))
    assert spool.sweep_stale(str(tmp_path)) == [dead_old.name]
    assert not dead_old.exists() and dead_new.exists() and live_old.exists() and other.exists()


@pytest.mark.parametrize("cpu_shm", [True, False], ids=["cpu-shm", "plain"])
def test_every_checkpointer_start_up_sweeps_stale_spool_directories(tmp_path, monkeypatch,
                                                                    cpu_shm):
    """The one start-up sweep runs in every mode (with cpu-shm staging too, whose stager used
    to sweep only its segments)."""
    from megatron_ckpt_ext import Checkpointer, CkptOptions, spool

    monkeypatch.setattr(spool, "_base_dir", lambda: str(tmp_path))
    stale = tmp_path / "mcx-results-1-stale"
    stale.mkdir()
    (stale / ".lock").touch()  # nobody holds it: a killed run's
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=cpu_shm)
    with Checkpointer(options):
        assert not stale.exists()


def test_unheld_is_false_while_another_process_holds_the_file(tmp_path):
    import fcntl

    from megatron_ckpt_ext._runtime import unheld

    path = tmp_path / "held"
    path.touch()
    with unheld(str(path)) as free:
        assert free
    parent, child = mp.get_context("fork").Pipe()

    def hold(conn) -> None:
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        conn.send("held")
        conn.recv()

    proc = mp.get_context("fork").Process(target=hold, args=(child,))
    proc.start()
    try:
        assert parent.recv() == "held"
        with unheld(str(path)) as free:
            assert not free
    finally:
        parent.send("go")
        proc.join(30)
    with unheld(str(path)) as free:
        assert free
    with pytest.raises(OSError):
        with unheld(str(tmp_path / "missing")):
            pass
