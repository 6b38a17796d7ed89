"""The pinned bounce pool a restore from memory copies through is built ahead, while the model
is built (Checkpointer.prepare_restore), where this node holds this rank's sealed snapshot of
the directory to load; the restore takes it, or the load (or close) releases it unused. On CPU
the pool is a stand-in that counts its builds and releases (the real one pins with CUDA). The
pool is the host sums' way (``MCX_RESTORE_SUMS=host``, the default, set here explicitly): where
the load sums on the device every buffer is pinned ahead and no pool is built
(test_restore_device_sums.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.staging import restore_copy, retained
from megatron_ckpt_ext.staging.retained import discard, read_seal

from tests._support.prepared_restore import (OPTIONS, _join_release, _like, _loaded_w,
                                             _memory_detail)
from tests._support.seals import flip_byte


@pytest.fixture(autouse=True)
def host_sums(monkeypatch):
    monkeypatch.setenv("MCX_RESTORE_SUMS", "host")


def test_a_warm_pool_is_built_in_the_background_and_taken_once(pool):
    assert restore_copy.warm_bounce(chunk=8, threads=2)
    assert not restore_copy.warm_bounce(chunk=8, threads=2)  # one at a time
    taken = restore_copy.take_warm_bounce(2, 8)
    assert taken is pool.built[0] and taken.thread == "mcx-warm-bounce" and not taken.closed
    assert restore_copy.take_warm_bounce(2, 8) is None  # taken: gone


def test_a_warm_pool_of_other_sizes_or_left_unused_is_released(pool):
    assert restore_copy.warm_bounce(chunk=8, threads=2)
    assert restore_copy.take_warm_bounce(4, 8) is None and pool.built[0].closed
    assert restore_copy.warm_bounce(chunk=8, threads=2)
    assert restore_copy.drop_warm_bounce() and pool.built[1].closed
    assert not restore_copy.drop_warm_bounce()


def test_prepare_restore_warms_only_for_a_sealed_snapshot_of_that_directory(pool, sealed,
                                                                             tmp_path):
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert not ck.prepare_restore(tmp_path / "other") and not pool.built  # nothing sealed
        assert ck.prepare_restore(root)
        assert len(pool.built) == 1 and not pool.built[0].closed
        assert ck.load(_like(), str(root)) is not None
        _join_release()  # no device to restore to on CPU: released unused, off the load's path
        assert pool.built[0].closed and pool.built[0].closed_by == "mcx-warm-bounce-release"
        assert not restore_copy.drop_warm_bounce()
    with Checkpointer(CkptOptions(**OPTIONS, ckpt_memory_restore=False)) as ck:
        assert not ck.prepare_restore(root)  # the memory tier off: nothing to warm


def test_a_load_the_snapshot_cannot_serve_releases_the_pool(pool, sealed):
    """The snapshot holds iteration 2; a load of iteration 1 reads storage, and releases the
    pool the restore would have taken."""
    root = sealed((1, 2))
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
        assert ck.load(_like(), str(root), iteration=1) is not None
        assert ck.load_reports[-1]["tier"] == "storage"
        _join_release()
        assert pool.built[0].closed


def test_close_releases_a_pool_no_load_took(pool, sealed):
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
    assert pool.built[0].closed


def test_a_restore_prepared_ahead_only_copies_what_was_summed(sealed):
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)  # no CUDA here: the summing thread alone starts
        state = ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["summed_ahead"] == 1
    assert detail["prepared_s"] > 0 and "prepare_wait_s" in detail
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_a_buffer_damaged_before_the_prepare_is_summed_again_and_refused(sealed):
    root = sealed()
    seal = read_seal(retained.seal_path("/dev/shm", root, 0))
    flip_byte(seal.entries[0].path, 100)  # one byte of the sealed buffer flipped
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
        state = ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "storage"
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_what_was_prepared_of_a_seal_replaced_since_is_not_taken(sealed):
    root = sealed()
    path = retained.seal_path("/dev/shm", root, 0)
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
        seal = read_seal(path)
        seal.generation = "another-commit"
        retained.write_seal(seal, "/dev/shm")  # sealed again after the prepare
        state = ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["summed_ahead"] == 0  # summed in the copy
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_a_seal_removed_while_the_snapshot_is_copied_sends_the_load_to_storage(sealed,
                                                                             monkeypatch):
    from megatron_ckpt_ext.load import memory

    root = sealed()
    path = retained.seal_path("/dev/shm", root, 0)
    real = memory.start_copy_verified

    def unsealed_meanwhile(*args, **kwargs):
        out = real(*args, **kwargs)
        seal = read_seal(path)
        os.unlink(path)  # as a writer does before it stages into the buffers
        retained.write_seal(seal, "/tmp")  # kept for the fixture's clean-up: moved aside
        return out

    monkeypatch.setattr(memory, "start_copy_verified", unsealed_meanwhile)
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        state = ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "storage"
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))
    aside = read_seal(retained.seal_path("/tmp", root, 0))
    os.unlink(aside.file)
    discard(aside, is_mapped=lambda p: False)


def test_a_prepared_snapshot_no_load_takes_is_unmapped_and_stays_sealed(sealed):
    from megatron_ckpt_ext.staging.segments import is_mapped

    root = sealed()
    path = retained.seal_path("/dev/shm", root, 0)
    before = read_seal(path)
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
    assert read_seal(path) == before  # a clean close frees its own snapshot, not this one
    segment = before.entries[0].path
    assert os.path.exists(segment) and not is_mapped(segment)


@pytest.fixture
def registered(monkeypatch) -> list[int]:
    """The bytes of each registration, the registration and CUDA's unregister stood in for."""
    from megatron_ckpt_ext.staging import sealing

    class _Cudart:
        def cudaHostUnregister(self, ptr):
            return 0

    done: list[int] = []
    monkeypatch.setattr(sealing, "_register", lambda t, n: done.append(n) or True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart())
    return done


def test_the_prepare_pins_buffers_until_the_load_comes_and_not_twice(pool, sealed, registered):
    """With a device (stood in for), the prepare pins the summed buffers; the load takes them as
    pinned, and the pinning after the load does not register them again."""
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True  # as with a device
        assert ck.prepare_restore(root)
        deadline = time.monotonic() + 30
        while not registered:  # the model is built meanwhile (a while, in a real job)
            assert time.monotonic() < deadline, "nothing pinned ahead"
            time.sleep(0.01)
        state = ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["pinned_ahead"] == 1
    assert registered == [4096 * 4]  # once: before the load, not again after it
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_a_load_told_not_to_pin_leaves_the_pinning_to_the_next_prepare(pool, sealed, registered):
    """``pin_at_load`` False (the launcher's MCX_PIN_ADOPTED=step): the load restores from
    memory without pinning the adopted buffers; the next prepare() (the launcher's after the
    first training step) pins them before the first save stages into them."""
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True  # as with a device
        ck.prepare_at_load = ck.pin_at_load = False
        state = ck.load(_like(), str(root))
        assert _memory_detail(ck)["tier"] == "memory"
        time.sleep(0.2)  # a pinning started by the load would have begun by now
        assert registered == []
        ck.prepare(_like())
        assert ck.wait_prepared(30)
        assert registered == [4096 * 4]
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_pinning_ahead_stops_when_the_load_comes(sealed):
    import threading

    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        seal = read_seal(retained.seal_path("/dev/shm", root, 0))
        tensors = ck._stager.adopt(seal)
        ck._stager.pin = True
        stop = threading.Event()
        stop.set()
        assert ck._stager.pin_adopted_now(tensors, stop) == set()
        ck._stager.drop_adopted(unlink=False)


def test_waiting_for_the_preparation_leaves_the_load_nothing_to_wait_for(sealed, monkeypatch):
    """prepared.wait() (the restore benchmark's "built" case: a model build outlasting the
    preparation) returns once the summing is done, without stopping it; the load then waits
    for nothing and copies what was summed."""
    import time

    from megatron_ckpt_ext.load import prepared

    real = prepared.presum_pieces

    def slow(*a, **k):
        time.sleep(0.5)
        return real(*a, **k)

    monkeypatch.setattr(prepared, "presum_pieces", slow)
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        assert ck.prepare_restore(root)
        t0 = time.perf_counter()
        assert prepared.wait(timeout_s=30)
        assert time.perf_counter() - t0 >= 0.4  # it waited for the summing
        ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["summed_ahead"] == 1
    assert detail["prepare_wait_s"] < 0.1, detail


def test_prepare_restore_pins_the_storage_reads_chunks_unless_memory_serves(pool, sealed,
                                                                          tmp_path, monkeypatch):
    """Where a directory has a checkpoint but no sealed snapshot of it, a CUDA process's
    prepare_restore makes the storage read's host chunks ahead (one thread, the load's own
    counts); where there is nothing to load, or the memory tier will restore it, it does not."""
    from megatron_ckpt_ext import backend
    from megatron_ckpt_ext._threads import thread_counts

    asked = []
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if on a GPU
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(backend, "pin_chunks_ahead", lambda *counts: asked.append(counts))
        monkeypatch.setattr("megatron_ckpt_ext._crc_device.warm_up_current", lambda o: None)
        assert not ck.prepare_restore(tmp_path / "empty") and asked == []  # nothing to load
        other = tmp_path / "other"
        other.mkdir()
        (other / "latest_checkpointed_iteration.txt").write_text("1")
        assert not ck.prepare_restore(other)  # a checkpoint, no snapshot of it: pinned ahead
        counts = thread_counts(load_read=ck.options.ckpt_load_threads)
        assert asked == [(counts.load_read, counts.checksum)]
        assert ck.prepare_restore(root)  # the memory tier will restore it: nothing pinned
        assert len(asked) == 1
        restore_copy.drop_warm_bounce()


def test_a_commit_releases_the_storage_reads_kept_chunks(one_rank_group, tmp_path):
    """The host chunks a load kept (pinned, for a later load) go once the job saves."""
    import threading

    from megatron_ckpt_ext.backend import direct_read

    pool = direct_read.PinnedChunks.shared(2, 1 << 10, pin=False)  # as a load leaves them
    pool.give(pool.take())
    with Checkpointer(CkptOptions()) as ck:
        ck.save(_like(), tmp_path / "ckpt", iteration=1)
        ck.maybe_finalize(blocking=True)
    for t in threading.enumerate():
        if t.name == "mcx-release-read-chunks":
            t.join(10)
    assert not direct_read.PinnedChunks.kept()


def test_an_async_save_releases_the_read_chunks_once_its_copies_landed(one_rank_group, tmp_path):
    """Before its commit: the release holds every CUDA call of the process, and a commit that
    Megatron-LM finalizes at the next save's entry would start it beside that save's copies."""
    import threading

    from megatron_ckpt_ext.backend import direct_read

    pool = direct_read.PinnedChunks.shared(2, 1 << 10, pin=False)  # as a load leaves them
    pool.give(pool.take())
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck.save(_like(), tmp_path / "ckpt", iteration=1)  # returns with the copies landed
        for t in threading.enumerate():
            if t.name == "mcx-release-read-chunks":
                t.join(10)
        assert not direct_read.PinnedChunks.kept()
        assert ck.reports == []  # not committed yet
        ck.maybe_finalize(blocking=True)
