"""ShmStager: stale-data and dirty-data trials at the stager level, in-flight isolation, reuse,
named segments handed to a spawned writer without a copy, close/unlink, orphan sweep.

Source tensors live on MCX_TEST_DEVICE (``cpu`` in CI, ``cuda`` on the GPU machine)."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
import torch.multiprocessing as mp

from megatron_ckpt_ext.staging import segments
from megatron_ckpt_ext.errors import InsufficientSharedMemory, StagingFailed
from megatron_ckpt_ext.staging import ShmStager, sweep_orphans
from tests._support.dist import device

DEVICE = device()


def new_stager(*, reuse: bool = True, job: str | None = None) -> ShmStager:
    return ShmStager(job_id=job or f"t{uuid.uuid4().hex[:8]}", rank=0, reuse=reuse)


def ours(job: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"mcx_{job}_")}


class StructureKeyedStager(ShmStager):
    """The NeMo-RL #3312 bug, on purpose: remembers the source tensors of the first save and,
    while the structure (keys, shapes, dtypes) is unchanged, copies from them instead of from the
    tensors it is given."""

    def stage(self, tensors, *, keys=None):
        structure = tuple((k, tuple(t.shape), t.dtype) for k, t in zip(keys, tensors))
        if getattr(self, "_remembered", None) is None or self._remembered[0] != structure:
            self._remembered = (structure, list(tensors))
        return super().stage(self._remembered[1], keys=keys)


def stale_data_trial(stager: ShmStager, steps: int = 10) -> list[int]:
    """Steps whose staged batch differs from that step's state. Between steps: values change in
    place, some tensors are reallocated (same shape, new storage), once an entry is added."""
    state = {"a": torch.zeros(64, device=DEVICE), "b": torch.zeros(8, 8, device=DEVICE),
             "c": torch.zeros(5, dtype=torch.int32, device=DEVICE)}
    bad = []
    for step in range(1, steps + 1):
        state["a"].fill_(step)  # in place
        if step % 3 == 0:
            state["b"] = torch.full((8, 8), float(step), device=DEVICE)  # reallocated
        else:
            state["b"].fill_(step)
        state["c"].fill_(step)
        if step == 6:
            state["d"] = torch.zeros(3, device=DEVICE)  # a new entry
        if "d" in state:
            state["d"].fill_(step)
        keys = sorted(state)
        batch = stager.stage([state[k] for k in keys], keys=keys)
        if any(not torch.equal(s, state[k].cpu()) for s, k in zip(batch.tensors, keys)):
            bad.append(step)
        batch.release()
    return bad


def test_stale_data_trial_every_batch_equals_its_own_step(caplog):
    with new_stager() as stager, caplog.at_level("INFO", logger="megatron_ckpt_ext.staging.shm"):
        assert stale_data_trial(stager) == []
        # steps 3, 6 and 9 changed the state's storage/structure: each one rebuild, with a reason
        assert stager.stats["rebuilds"] == 3
        assert stager.stats["last_rebuild_reason"] == "reallocated ['b']"
        assert "added ['d']; reallocated ['b']" in caplog.text
        assert stager.stats["allocations"] == 4  # a, b, c at the first save; d when added


def test_stale_data_trial_fails_on_a_structure_keyed_cache():
    stager = StructureKeyedStager(job_id="structure", rank=0, reuse=True)
    with stager:
        assert stale_data_trial(stager) == [3, 4, 5, 9, 10]


def test_added_entry_keeps_the_other_buffers():
    with new_stager() as stager:
        first = stager.stage([torch.ones(4), torch.ones(2)], keys=["a", "b"])
        ptrs = [t.data_ptr() for t in first.tensors]
        first.release()
        second = stager.stage([torch.ones(4), torch.ones(2), torch.ones(3)], keys=["a", "b", "c"])
        assert [t.data_ptr() for t in second.tensors[:2]] == ptrs
        assert stager.stats["allocations"] == 3
        second.release()


def test_reshaped_entry_gets_a_new_buffer_and_the_old_one_is_unlinked(caplog):
    with new_stager() as stager:
        stager.stage([torch.ones(4)], keys=["a"]).release()
        old = set(stager.segments())
        with caplog.at_level("INFO", logger="megatron_ckpt_ext.staging.shm"):
            batch = stager.stage([torch.ones(6)], keys=["a"])
        assert torch.equal(batch.tensors[0], torch.ones(6))
        assert "reshaped ['a']" in caplog.text
        assert not any(os.path.exists(p) for p in old)
        batch.release()


def test_dirty_data_staged_batch_equals_the_state_at_stage_time():
    with new_stager() as stager:
        src = [torch.arange(1000, dtype=torch.float32, device=DEVICE),
               torch.full((256,), 3.0, device=DEVICE)]
        want = [t.cpu().clone() for t in src]
        batch = stager.stage(src, keys=["x", "y"])
        for t in src:
            t.fill_(-1)
        del src
        junk = [torch.full((1000,), 9.0, device=DEVICE) for _ in range(50)]  # reuse freed memory
        assert all(torch.equal(b, w) for b, w in zip(batch.tensors, want))
        assert float(junk[-1][0]) == 9.0
        batch.release()


def test_two_batches_in_flight_never_share_buffers():
    with new_stager() as stager:
        first = stager.stage([torch.ones(16)], keys=["w"])
        first_ptr, first_segments = first.tensors[0].data_ptr(), set(stager.segments())
        second = stager.stage([torch.full((16,), 2.0)], keys=["w"])
        assert second.tensors[0].data_ptr() != first_ptr
        assert set(stager.segments()) - first_segments, "the second batch needs its own segment"
        assert torch.equal(first.tensors[0], torch.ones(16))  # not overwritten by the second
        first.release()
        third = stager.stage([torch.full((16,), 3.0)], keys=["w"])
        assert third.tensors[0].data_ptr() == first_ptr  # the released set is reused
        assert torch.equal(second.tensors[0], torch.full((16,), 2.0))
        second.release(), third.release()
        assert stager.stats["allocations"] == 2


def test_release_is_idempotent_and_empties_the_batch():
    with new_stager() as stager:
        batch = stager.stage([torch.ones(8)], keys=["w"])
        batch.release()
        batch.release()
        assert batch.tensors == []
        assert stager.stage([torch.ones(8)], keys=["w"]).tensors[0].sum() == 8
        assert stager.stats["allocations"] == 1


def test_without_reuse_buffers_are_freed_and_unlinked_at_release():
    with new_stager(reuse=False) as stager:
        batch = stager.stage([torch.ones(1024)], keys=["w"])
        (path,) = stager.segments()
        assert stager.host_bytes() == 4096 and os.path.exists(path)
        batch.release()
        assert stager.host_bytes() == 0 and not os.path.exists(path)


def test_prepare_allocates_ahead_so_the_first_stage_allocates_nothing():
    with new_stager() as stager:
        state = [torch.ones(32), torch.zeros(3, 3)]
        stager.prepare(state, keys=["a", "b"])
        assert stager.stats["allocations"] == 3  # the two buffers and the writer's ready flag
        stager.stage(state, keys=["a", "b"]).release()
        stager.gate(lambda: None, timeout_s=1.0)  # an async save's gate uses the flag
        assert stager.stats["allocations"] == 3


def test_background_prepare_is_waited_for_by_stage():
    with new_stager() as stager:
        state = [torch.ones(2**20)]
        stager.prepare(state, keys=["a"], background=True)
        batch = stager.stage(state, keys=["a"])
        assert stager.stats["allocations"] == 2 and torch.equal(batch.tensors[0], state[0])
        batch.release()


def test_wait_prepared_reports_whether_the_background_allocation_is_done(monkeypatch):
    with new_stager() as stager:
        gate = __import__("threading").Event()
        real = stager._prepare_locked
        monkeypatch.setattr(stager, "_prepare_locked", lambda specs: (gate.wait(30), real(specs)))
        stager.prepare([torch.ones(8)], keys=["a"], background=True)
        assert stager.wait_prepared(0.05) is False  # still allocating
        gate.set()
        assert stager.wait_prepared(30) is True and stager.stats["allocations"] == 2


class _InFlight:
    """A device copy still running until synchronize() (CPU stand-in for a CUDA event pair)."""

    def __init__(self) -> None:
        self.start = self.end = self
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, other: object) -> float:
        return 1.0


def test_sources_stay_referenced_until_their_copies_are_waited_for(monkeypatch):
    """A source freed while its device copy still reads it could be handed out again by the
    caching allocator: the batch keeps it alive until wait(); copies_in_flight() lists the copies
    until then (the overlapped snapshot orders the trainer's stream after them)."""
    import weakref

    copy = _InFlight()
    monkeypatch.setattr(ShmStager, "_copy", lambda self, staged, tensors: [copy])
    with new_stager() as stager:
        source = torch.ones(16)
        alive = weakref.ref(source)
        batch = stager.stage([source], keys=["a"], wait=False)
        del source
        assert alive() is not None and batch.copies_in_flight() == [copy]
        batch.wait()
        assert copy.waited and alive() is None and batch.copies_in_flight() == []
        batch.release()


def test_segments_are_named_for_job_rank_and_pid_and_close_unlinks_them():
    job = f"name{uuid.uuid4().hex[:6]}"
    stager = ShmStager(job_id=job, rank=3, reuse=True)
    batch = stager.stage([torch.ones(8), torch.ones(0)], keys=["w", "empty"])
    (name,) = ours(job)  # one segment: a zero-size tensor needs none
    assert name.startswith(f"mcx_{job}_3_{os.getpid()}_")
    assert batch.tensors[0].is_shared() and batch.tensors[1].shape == (0,)
    batch.release()
    stager.close()
    stager.close()
    assert ours(job) == set()
    with pytest.raises(RuntimeError, match="closed"):
        stager.stage([torch.ones(8)], keys=["w"])


def _writer(tensor, queue):
    queue.put((float(tensor[0]), tensor.is_shared()))
    tensor[1] = 42.0  # visible to the parent only if the buffer was not copied on the way


@pytest.mark.timeout(120)
def test_spawned_writer_receives_the_staged_buffer_without_a_copy():
    ctx = mp.get_context("spawn")
    with new_stager() as stager:
        batch = stager.stage([torch.full((1024,), 7.0)], keys=["w"])
        ptr = batch.tensors[0].data_ptr()
        queue = ctx.Queue()
        proc = ctx.Process(target=_writer, args=(batch.tensors[0], queue))
        proc.start()
        got = queue.get(timeout=90)
        proc.join(timeout=30)
        assert proc.exitcode == 0 and got == (7.0, True)
        assert float(batch.tensors[0][1]) == 42.0
        assert batch.tensors[0].data_ptr() == ptr  # torch did not move it to a segment of its own
        batch.release()


def test_a_staged_tensor_is_pickled_by_segment_name_and_any_other_storage_as_torch_does():
    # By name: no file descriptor through the resource sharer (one socket round trip per storage
    # in the receiver; docs/notes/benchmarks.md). Others: torch's reducer.
    from multiprocessing.reduction import ForkingPickler

    with new_stager() as stager:
        batch = stager.stage([torch.full((256,), 3.0)], keys=["w"])
        path = stager.segments()[0]
        payload = bytes(ForkingPickler.dumps(batch.tensors[0]))
        assert path.encode() in payload and b"rebuild_storage_fd" not in payload
        assert b"_open_segment" in payload
        other = bytes(ForkingPickler.dumps(torch.ones(4).share_memory_()))
        assert b"rebuild_storage_fd" in other and b"_open_segment" not in other
        storage_ptr = batch.tensors[0].untyped_storage().data_ptr()
        assert storage_ptr in segments._SEGMENTS
        batch.release()
    assert storage_ptr not in segments._SEGMENTS  # closed: forgotten, never pickled by a dead name


def _receive(tensor: torch.Tensor) -> torch.Tensor:
    """What a writer process gets for ``tensor``: pickled as the trainer sends it, then loaded."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    return pickle.loads(bytes(ForkingPickler.dumps(tensor)))


def test_a_writer_keeps_its_mappings_for_reused_buffers_until_the_owner_frees_one():
    segments.drop_kept_mappings()
    with new_stager() as stager:
        batch = stager.stage([torch.full((256,), 1.0)], keys=["w"])
        first = _receive(batch.tensors[0])
        batch.release()  # the writer is done with save 1: its buffers are reused by save 2
        batch = stager.stage([torch.full((256,), 2.0)], keys=["w"])
        second = _receive(batch.tensors[0])
        # the same mapping handed back, and it shows the bytes staged for this save
        assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        assert torch.equal(second, torch.full((256,), 2.0))
        assert len(segments._MAPPED["storages"]) == 1
        batch.release()
        # a structure change frees the old buffer: the next reference drops the kept mapping
        moved = _receive(stager.stage([torch.full((512,), 3.0)], keys=["w"]).tensors[0])
        assert list(segments._MAPPED["storages"]) == stager.segments()
        assert torch.equal(moved, torch.full((512,), 3.0))
    assert segments.drop_kept_mappings() == 1


def test_a_writer_maps_again_each_time_without_reuse():
    segments.drop_kept_mappings()
    with new_stager(reuse=False) as stager:
        staged = stager.stage([torch.full((256,), 1.0)], keys=["w"]).tensors[0]
        a, b = _receive(staged), _receive(staged)
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert torch.equal(a, b) and not segments._MAPPED["storages"]


def test_full_shm_is_an_error_naming_the_fix_and_leaves_no_segment(monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segments.os, "posix_fallocate", no_space)
    job = f"full{uuid.uuid4().hex[:6]}"
    with ShmStager(job_id=job, rank=0, reuse=True) as stager:
        with pytest.raises(InsufficientSharedMemory, match=r"cannot reserve 4096 bytes .* 'w'.*--shm-size"):
            stager.stage([torch.ones(1024)], keys=["w"])
    assert ours(job) == set()


def test_too_few_file_descriptors_is_an_error_naming_ulimit(monkeypatch):
    monkeypatch.setattr(segments.resource, "getrlimit", lambda what: (64, 64))
    with new_stager() as stager:
        with pytest.raises(OSError, match="ulimit -n"):
            stager.stage([torch.ones(1) for _ in range(10)])


def test_keys_must_match_tensors():
    with new_stager() as stager:
        with pytest.raises(ValueError, match="2 keys for 1 tensors"):
            stager.stage([torch.ones(1)], keys=["a", "b"])


HOLDER = textwrap.dedent("""
    import sys, time, torch
    from megatron_ckpt_ext.staging import ShmStager
    s = ShmStager(job_id=sys.argv[1], rank=0, reuse=True)
    b = s.stage([torch.ones(2**20), torch.ones(16)], keys=["w", "b"])
    print("ready", flush=True)
    time.sleep(120)
""")


def _holder(job: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, job], stdout=subprocess.PIPE, text=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


@pytest.mark.timeout(120)
def test_sweep_removes_a_killed_runs_segments_and_keeps_a_live_ones():
    dead_job, live_job = f"dead{uuid.uuid4().hex[:6]}", f"live{uuid.uuid4().hex[:6]}"
    dead, live = _holder(dead_job), _holder(live_job)
    try:
        assert dead.stdout.readline().strip() == "ready"
        assert live.stdout.readline().strip() == "ready"
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        left = ours(dead_job)
        assert len(left) == 2, "kill -9 leaves the named segments behind"
        assert {os.path.basename(p) for p in sweep_orphans(dry_run=True)} >= left
        assert ours(dead_job) == left  # dry run removes nothing
        removed = {os.path.basename(p) for p in sweep_orphans()}
        assert left <= removed and ours(dead_job) == set()
        assert len(ours(live_job)) == 2 and not removed & ours(live_job)
    finally:
        for proc in (dead, live):
            proc.kill()
            proc.wait(timeout=30)
    sweep_orphans(prefix=f"mcx_{live_job}_")
    assert ours(live_job) == set()


def test_sweep_keeps_a_dead_owners_segment_that_is_still_mapped_and_ignores_others():
    job = f"mapped{uuid.uuid4().hex[:6]}"
    pid = _dead_pid()
    mapped = f"/dev/shm/mcx_{job}_0_{pid}_0"
    unlocked = f"/dev/shm/mcx_{job}_0_{pid}_1"
    foreign = f"/dev/shm/other_{job}_0_{pid}_0"
    fds = [os.open(p, os.O_CREAT | os.O_RDWR, 0o600) for p in (mapped, unlocked, foreign)]
    try:
        fcntl.flock(fds[0], fcntl.LOCK_SH)  # as a live writer holding the mapping would
        removed = sweep_orphans(prefix=f"mcx_{job}_")
        assert removed == [unlocked]
        assert os.path.exists(mapped) and os.path.exists(foreign)
    finally:
        for fd in fds:
            os.close(fd)
        for p in (mapped, unlocked, foreign):
            if os.path.exists(p):
                os.unlink(p)


def test_the_sweep_removes_a_killed_sealers_half_written_seal_file_only(tmp_path):
    """A process killed between a seal's write and its rename leaves ``<seal>.json.tmp<pid>``:
    the sweep (start-up, ``shm clean``) removes it once its pid is gone and it is older than a
    seal's write could take; a live writer's, a fresh one and a dry run keep theirs."""
    from megatron_ckpt_ext.staging.retained import PARTIAL_AGE_S, SEAL_PREFIX

    dead, old = _dead_pid(), time.time() - 2 * PARTIAL_AGE_S
    files = {"dead_old": f"{SEAL_PREFIX}ab_0.json.tmp{dead}",
             "dead_replica_old": f"{SEAL_PREFIX}ab_1.replica.json.tmp{dead}",
             "dead_fresh": f"{SEAL_PREFIX}cd_0.json.tmp{dead}",
             "live_old": f"{SEAL_PREFIX}ef_0.json.tmp{os.getpid()}"}
    for key, name in files.items():
        (tmp_path / name).write_text("{")
        if key.endswith("old"):
            os.utime(tmp_path / name, (old, old))
    sweep_orphans(shm_dir=str(tmp_path), dry_run=True)
    assert {p.name for p in tmp_path.iterdir()} == set(files.values())
    sweep_orphans(shm_dir=str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {files["dead_fresh"], files["live_old"]}


def test_a_new_stager_sweeps_orphans_at_start():
    job = f"start{uuid.uuid4().hex[:6]}"
    orphan = f"/dev/shm/mcx_{job}_0_{_dead_pid()}_0"
    open(orphan, "wb").close()
    with new_stager():
        assert not os.path.exists(orphan)


# -- the ready flag a writer waits on ------------------------------------------------------------
def test_writer_runs_only_once_its_save_is_published(tmp_path):
    import threading

    from megatron_ckpt_ext.staging import run_when_staged

    with ShmStager(job_id="flag", rank=0, reuse=True, shm_dir=str(tmp_path), pin=False) as st:
        flag = st.ready_flag()
        assert flag.dtype == torch.int64 and int(flag[0]) == 0 and st.ready_flag() is flag
        ran = []
        timer = threading.Timer(0.2, lambda: flag.fill_(3))
        t0 = time.monotonic()
        timer.start()
        assert run_when_staged(flag, 3, 10.0, lambda x: ran.append(x) or "done", "w") == "done"
        assert ran == ["w"] and time.monotonic() - t0 >= 0.19
        assert run_when_staged(flag, 2, 10.0, lambda: "older") == "older"  # already published
        flag.fill_(-4)
        with pytest.raises(StagingFailed, match="save 4"):
            run_when_staged(flag, 4, 10.0, ran.append, "never")
        with pytest.raises(TimeoutError, match="--ckpt-timeout"):
            run_when_staged(flag, 5, 0.05, ran.append, "never")
        assert ran == ["w"]
        assert len(os.listdir(tmp_path)) == 1  # the flag is a segment of ours
    assert os.listdir(tmp_path) == []  # and close() removes it


def test_a_save_whose_tensors_the_prepared_set_does_not_fit_says_which(caplog):
    import logging

    with new_stager() as stager:
        stager.prepare([torch.ones(32), torch.zeros(3, 3)], keys=["a", "b"])
        with caplog.at_level(logging.INFO, logger="megatron_ckpt_ext.staging.shm"):
            stager.stage([torch.ones(32), torch.zeros(4)], keys=["a", "c"]).release()
        assert stager.stats["sets_built_at_stage"] == 1
        (line,) = [r.getMessage() for r in caplog.records if "have no buffer" in r.getMessage()]
        assert "1 of 2 tensors" in line and "'c'" in line and "'b'" in line
        stager.stage([torch.ones(32), torch.zeros(4)], keys=["a", "c"]).release()
        assert stager.stats["sets_built_at_stage"] == 1  # the set built then fits from now on
        assert stager.stats["prepare_wait_s"] == 0.0  # nothing ran in the background


class _Timed:
    """A CUDA event stand-in: elapsed_time() to any other is ``ms``."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: object) -> float:
        return self.ms

    def synchronize(self) -> None:
        pass


def test_a_batch_reports_the_copies_and_their_wait_for_work_queued_on_the_device(monkeypatch):
    """copy_s is the copies alone (start -> end on the copy stream); queue_wait_s how long the
    copy stream waited, before them, for the work queued on the device's current stream
    (queued -> start): a save's stage_detail reports it as copy_queue_wait_s."""
    import types

    copy = types.SimpleNamespace(start=_Timed(35.0), end=_Timed(0.0), queued=_Timed(12.0))
    monkeypatch.setattr(ShmStager, "_copy", lambda self, staged, tensors: [copy])
    with new_stager() as stager:
        batch = stager.stage([torch.ones(16)], keys=["a"], wait=False)
        batch.wait()
        assert (batch.copy_s, batch.queue_wait_s) == (0.035, 0.012)
        batch.release()


def test_a_saves_report_names_the_copies_wait_for_the_device(one_rank_group, monkeypatch,
                                                           tmp_path):
    import types

    from megatron_ckpt_ext import Checkpointer, CkptOptions
    from tests._support.dist import sharded

    copy = types.SimpleNamespace(start=_Timed(35.0), end=_Timed(0.0), queued=_Timed(12.0))
    monkeypatch.setattr(ShmStager, "_copy", lambda self, staged, tensors: [copy])
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True)
    with Checkpointer(options) as ck:
        ck.save(sharded(0, 1, {"w": torch.ones(64)}), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
        assert ck.reports[-1]["stage_detail"]["copy_queue_wait_s"] == 0.012
