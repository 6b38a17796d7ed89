"""Partner copies (staging/partner.py) between two links in one process, each with a
shared-memory directory of its own (two nodes): who partners whom, a copy that arrives sealed
and byte-exact, and every way a copy is refused without leaving anything sealed."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
import zlib

import pytest

from megatron_ckpt_ext.staging.partner import PartnerLink, _split, partners, replica_path
from megatron_ckpt_ext.staging.retained import (Seal, SealEntry, list_seals, read_seal,
                                                sealed_segments, seal_path, write_seal)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("nodes,want", [
    (["a", "a"], {}),  # one node: nothing to copy to
    (["a", "a", "b", "b"], {0: 2, 1: 3, 2: 0, 3: 1}),
    (["a", "b", "a", "b"], {0: 1, 2: 3, 1: 0, 3: 2}),
    (["a", "a", "a", "b"], {0: 3, 1: 3, 2: 3, 3: 0}),  # uneven: the next node's ranks wrap
    (["a", "a", "a", "b", "b"], {0: 3, 1: 4, 2: 3, 3: 0, 4: 1}),
    (["a", "b", "c"], {0: 1, 1: 2, 2: 0}),
])
def test_each_rank_is_partnered_with_the_next_node_at_its_own_index(nodes, want):
    assert partners(nodes) == want


@pytest.fixture
def two_nodes():
    base = f"/dev/shm/mcxtest_unit_partner_{uuid.uuid4().hex[:8]}"
    dirs = [os.path.join(base, "a"), os.path.join(base, "b")]
    for d in dirs:
        os.makedirs(d)
    links = [PartnerLink(d, r, job_id="unit") for r, d in enumerate(dirs)]
    for link in links:
        link.start()
    views = [(r, link.node, link.host, link.port, link.token) for r, link in enumerate(links)]
    for link in links:
        link._set_book(views)
    yield dirs, links
    for link in links:
        link.close()
    shutil.rmtree(base, ignore_errors=True)


ROOT = "/tmp/mcx_unit_partner_root"


def _sealed(shm_dir: str, iteration: int = 7, rank: int = 0) -> tuple[Seal, list[bytes]]:
    data = [os.urandom((3 << 20) + 5), os.urandom(17)]
    entries = []
    for i, d in enumerate(data):
        path = os.path.join(shm_dir, f"mcx_unit_{rank}_{os.getpid()}_{i}{iteration}")
        with open(path, "wb") as fh:
            fh.write(d)
        entries.append(SealEntry(key=f"t{i}", offset=[0], shape=[len(d)], dtype="torch.uint8",
                                 spec=f"t{i}", path=path, nbytes=len(d), crc32=zlib.crc32(d)))
    entries.append(SealEntry(key="empty", offset=[0], shape=[0], dtype="torch.uint8",
                             spec="empty", path=None, nbytes=0))
    seal = Seal(root=os.path.realpath(ROOT), rank=rank, world=2, iteration=iteration,
                manifest_crc32="00c0ffee", entries=entries)
    write_seal(seal, shm_dir)
    return read_seal(seal_path(shm_dir, ROOT, rank)), data


def _wait(link: PartnerLink, key: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while link.stats.get(key, 0) < count:
        assert time.monotonic() < deadline, link.stats
        time.sleep(0.01)


def test_a_copy_arrives_byte_exact_and_sealed_as_the_partners(two_nodes, capsys):
    from megatron_ckpt_ext import shm_cli

    dirs, (a, b) = two_nodes
    seal, data = _sealed(dirs[0])
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)
    copy = read_seal(replica_path(dirs[1], ROOT, 0))
    assert copy.replica_of == a.node and copy.iteration == 7 and copy.generation == seal.generation
    assert [e.crc32 for e in copy.entries] == [e.crc32 for e in seal.entries]
    for entry, want in zip(copy.entries, data):
        assert os.path.dirname(entry.path) == dirs[1]
        with open(entry.path, "rb") as fh:
            assert fh.read() == want
    assert copy.entries[-1].path is None
    # a seal like any other for the sweep, shm list and shm clean; not rank 0's own seal there
    assert {e.path for e in copy.entries if e.path} <= sealed_segments(dirs[1])
    assert [s.replica_of for s in list_seals(dirs[1])] == [a.node]
    assert read_seal(seal_path(dirs[1], ROOT, 0)) is None
    shm_cli.run("list", shm_dir=dirs[1])
    assert "rank 0/2" in capsys.readouterr().out.split("\n")[0]
    shm_cli.run("list", shm_dir=dirs[1])
    assert f"partner copy from {a.node}" in capsys.readouterr().out
    assert a.stats["partner_bytes"] == seal.nbytes
    sender = next(t for t in a._threads if t.name == "mcx-partner-send")
    assert os.getpriority(os.PRIO_PROCESS, sender.native_id) == 19  # training comes first
    # the next copy of rank 0 replaces it: one copy per rank, the old segments gone
    newer, _ = _sealed(dirs[0], iteration=8)
    a.replicate(newer, threading.Event())
    _wait(a, "partner_copies", 2)
    assert read_seal(replica_path(dirs[1], ROOT, 0)).iteration == 8
    assert not any(os.path.exists(e.path) for e in copy.entries if e.path)


def test_a_buffer_changed_after_its_seal_is_never_sealed_on_the_partner(two_nodes):
    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    with open(seal.entries[0].path, "r+b") as fh:  # as the next save staging into it would
        fh.write(b"\0" * 4096)
    a.replicate(seal, threading.Event())
    _wait(a, "partner_failures", 1)
    assert "CRC-32" in a.stats["partner_last_error"]
    assert os.listdir(dirs[1]) == []  # no seal, no segment left


def test_a_cancelled_copy_is_never_sealed(two_nodes):
    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    cancel = threading.Event()
    cancel.set()  # the next save started staging into the buffers
    a.replicate(seal, cancel)
    _wait(a, "partner_failures", 1)
    assert "staged into again" in a.stats["partner_last_error"]
    assert os.listdir(dirs[1]) == []


def test_another_jobs_rank_is_not_served(two_nodes):
    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    node, host, port, _ = a.book[1]
    a.book[1] = (node, host, port, "not-the-token")
    a.replicate(seal, threading.Event())
    _wait(a, "partner_failures", 1)
    assert "token" in a.stats["partner_last_error"] and os.listdir(dirs[1]) == []


def _reseed_both(links, iteration: int) -> list[dict]:
    """Both links' reseed, each on a thread, over an in-process gather."""
    barrier, box, calls = threading.Barrier(2), {}, [0, 0]
    details = [{}, {}]

    def gather_for(i):
        def gather(obj):
            n = calls[i]
            calls[i] += 1
            box[(n, i)] = obj
            barrier.wait()
            out = [box[(n, 0)], box[(n, 1)]]
            barrier.wait()
            return out
        return gather

    threads = [threading.Thread(target=link.reseed, kwargs=dict(
        root=ROOT, iteration=iteration, world=2, gather=gather_for(i), detail=details[i]))
        for i, link in enumerate(links)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return details


def test_a_node_that_lost_its_seal_fetches_the_copy_back(two_nodes):
    dirs, (a, b) = two_nodes
    seal, data = _sealed(dirs[0])
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)
    _sealed(dirs[1], rank=1)  # node b holds rank 1's own seal
    for name in os.listdir(dirs[0]):  # node a's memory is lost
        os.unlink(os.path.join(dirs[0], name))
    details = _reseed_both((a, b), iteration=7)
    assert details[0]["partner_fetch"]["ok"] and details[0]["partner_fetch"]["from"] == b.node
    assert details[1] == {}
    own = read_seal(seal_path(dirs[0], ROOT, 0))  # sealed again as rank 0's own, on node a
    assert own.iteration == 7 and own.replica_of == "" and own.generation == seal.generation
    for entry, want in zip(own.entries, data):
        assert os.path.dirname(entry.path) == dirs[0]
        with open(entry.path, "rb") as fh:
            assert fh.read() == want


def test_a_copy_of_another_iteration_is_not_fetched(two_nodes):
    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0], iteration=7)
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)
    for name in os.listdir(dirs[0]):
        os.unlink(os.path.join(dirs[0], name))
    details = _reseed_both((a, b), iteration=8)  # the load asks for a newer one
    assert details == [{}, {}] and os.listdir(dirs[0]) == []


@pytest.mark.parametrize("keep", [False, True])
def test_close_frees_the_copies_held_unless_kept(two_nodes, keep):
    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)
    b.close(keep=keep)
    assert bool(os.listdir(dirs[1])) is keep


def test_close_frees_the_copies_an_earlier_killed_run_left_on_this_node(two_nodes):
    """A holder killed with a copy sealed: the next run's link on that node, once it has dealt
    with that save root (here its restart's reseed), frees it at a clean close."""
    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)
    b._roots.clear()  # as a killed holder: nothing of its own close runs
    reborn = PartnerLink(dirs[1], 1, job_id="unit")
    try:
        _reseed_both((a, reborn), iteration=7)  # both nodes hold their seal / the copy
        assert read_seal(replica_path(dirs[1], ROOT, 0)) is not None
    finally:
        reborn.close()
    assert os.listdir(dirs[1]) == []


def test_nothing_is_fetched_where_another_rank_has_no_snapshot_anywhere(two_nodes):
    """Rank 1 holds no seal of the iteration and no node a copy of it: every rank reads storage
    anyway, so rank 0 does not fetch its copy (no network copy for nothing)."""
    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)
    for name in os.listdir(dirs[0]):
        os.unlink(os.path.join(dirs[0], name))
    assert _reseed_both((a, b), iteration=7) == [{}, {}] and os.listdir(dirs[0]) == []


def test_a_fetch_splits_the_buffers_into_streams_of_about_equal_bytes():
    sizes = [100, 5, 60, 40, 0, 55, 1]
    groups = _split(sizes, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))  # each once
    assert all(g == sorted(g) for g in groups)
    assert max(sum(sizes[i] for i in g) for g in groups) <= 100  # the largest alone
    assert _split([7], 4) == [[0]] and _split([], 4) == []


def test_a_malformed_request_ends_that_connection_and_the_server_goes_on(two_nodes,
                                                                        monkeypatch):
    import json
    import socket
    import struct

    died = []  # a connection's thread that ends on an exception (a traceback on stderr)
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    dirs, (a, b) = two_nodes
    for body in (b"[1, 2]", b"{not json", json.dumps({"token": b.token, "op": "get"}).encode(),
                 json.dumps({"token": b.token, "op": "put", "seal": {}}).encode()):
        with socket.create_connection((b.host, b.port), timeout=5) as sock:
            sock.sendall(struct.pack("!Q", len(body)) + body)
            sock.settimeout(5)
            try:
                sock.recv(1 << 16)  # a reply or the connection closed, never a hang
            except OSError:
                pass
    seal, _ = _sealed(dirs[0])
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)  # still served
    assert all(t.is_alive() for t in b._threads if t.name == "mcx-partner-serve")
    assert died == []


def test_a_copy_replaced_while_it_is_fetched_is_refused(two_nodes):
    """The fetch asks for the copy's seal, then for its buffers over several connections: a
    connection that finds another generation (a newer copy sealed meanwhile) fails the fetch."""
    from megatron_ckpt_ext.staging.partner_wire import PartnerError

    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    a.replicate(seal, threading.Event())
    _wait(a, "partner_copies", 1)
    copy = read_seal(replica_path(dirs[1], ROOT, 0))
    got, entries = a._get(1, os.path.realpath(ROOT), 7, [0], copy.generation, [])
    assert got.generation == copy.generation and len(entries) == 1
    made: list[str] = []
    with pytest.raises(PartnerError, match="replaced while it was fetched"):
        a._get(1, os.path.realpath(ROOT), 7, [0], "another-generation", made)
    assert made == []


def test_a_partner_whose_shared_memory_is_full_refuses_the_copy_and_keeps_nothing(
        two_nodes, monkeypatch):
    """The partner says why before any byte comes (the sender's warning names the room); one
    that runs out while writing (the room taken meanwhile) keeps nothing either."""
    import errno
    import types

    from megatron_ckpt_ext.staging import partner, partner_wire

    dirs, (a, b) = two_nodes
    seal, _ = _sealed(dirs[0])
    monkeypatch.setattr(partner.os, "statvfs",
                        lambda path: types.SimpleNamespace(f_bavail=1, f_frsize=4096))
    a.replicate(seal, threading.Event())
    _wait(a, "partner_failures", 1)
    assert "GB free, the copy needs" in a.stats["partner_last_error"], a.stats
    assert os.listdir(dirs[1]) == []
    monkeypatch.undo()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(partner_wire.os, "posix_fallocate", full)
    a.replicate(seal, threading.Event())
    _wait(a, "partner_failures", 2)
    assert os.listdir(dirs[1]) == []
    monkeypatch.undo()
    # the bytes fit but the seal does not (the last few KB taken meanwhile): nothing kept
    from megatron_ckpt_ext.staging import retained

    def no_room(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(retained.json, "dump", no_room)
    a.replicate(seal, threading.Event())
    _wait(a, "partner_failures", 3)
    assert "No space left" in a.stats["partner_last_error"], a.stats
    assert os.listdir(dirs[1]) == []
