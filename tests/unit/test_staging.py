"""ShmStager: stale-data and dirty-data trials at the stager level, in-flight isolation, reuse,
no shared memory left behind by a killed process; preflight messages."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple

import pytest
import torch

from megatron_ckpt_ext import preflight
from megatron_ckpt_ext.options import CkptOptionsError
from megatron_ckpt_ext.staging import ShmStager


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
    state = {"a": torch.zeros(64), "b": torch.zeros(8, 8), "c": torch.zeros(5, dtype=torch.int32)}
    bad = []
    for step in range(1, steps + 1):
        state["a"].fill_(step)  # in place
        if step % 3 == 0:
            state["b"] = torch.full((8, 8), float(step))  # reallocated, same shape
        else:
            state["b"].fill_(step)
        state["c"].fill_(step)
        if step == 6:
            state["d"] = torch.full((3,), float(step))  # a new entry
        if "d" in state:
            state["d"].fill_(step)
        keys = sorted(state)
        batch = stager.stage([state[k] for k in keys], keys=keys)
        if any(not torch.equal(s, state[k]) for s, k in zip(batch.tensors, keys)):
            bad.append(step)
        batch.release()
    return bad


def test_stale_data_trial_passes_with_reuse(caplog):
    stager = ShmStager(job_id="t", rank=0, reuse=True)
    with caplog.at_level("INFO", logger="megatron_ckpt_ext.staging"):
        assert stale_data_trial(stager) == []
    assert stager.stats["allocations"] == 2  # first save, and once when the entry was added
    assert stager.stats["rebuilds"] == 3  # steps 3, 6 and 9 changed the state's storage/structure
    assert "added ['d']" in caplog.text and "reallocated ['b']" in caplog.text
    stager.close()


def test_stale_data_trial_catches_a_structure_keyed_cache():
    assert stale_data_trial(StructureKeyedStager(job_id="t", rank=0, reuse=True)) != []


def test_rebuild_reason_names_reallocated_tensors(caplog):
    stager = ShmStager(job_id="t", rank=0, reuse=True)
    a = torch.ones(4)
    stager.stage([a], keys=["a"]).release()
    with caplog.at_level("INFO", logger="megatron_ckpt_ext.staging"):
        stager.stage([torch.ones(4)], keys=["a"]).release()
    assert "reallocated ['a']" in caplog.text


def test_dirty_data_staged_batch_is_independent_of_the_sources():
    stager = ShmStager(job_id="t", rank=0, reuse=True)
    src = [torch.arange(1000, dtype=torch.float32), torch.full((256,), 3.0)]
    want = [t.clone() for t in src]
    batch = stager.stage(src, keys=["x", "y"])
    for t in src:
        t.fill_(-1)
    del src
    junk = [torch.full((1000,), 9.0) for _ in range(50)]  # provoke allocator reuse
    assert all(torch.equal(b, w) for b, w in zip(batch.tensors, want))
    assert junk[0][0] == 9.0
    batch.release()


def test_two_batches_in_flight_never_share_buffers():
    stager = ShmStager(job_id="t", rank=0, reuse=True)
    first = stager.stage([torch.ones(16)], keys=["w"])
    second = stager.stage([torch.full((16,), 2.0)], keys=["w"])
    assert first.tensors[0].data_ptr() != second.tensors[0].data_ptr()
    assert torch.equal(first.tensors[0], torch.ones(16))
    first.release()
    third = stager.stage([torch.full((16,), 3.0)], keys=["w"])
    assert third.tensors[0].data_ptr() == first_ptr(stager, exclude=second)  # the idle set is reused
    second.release(), third.release()
    assert stager.stats["allocations"] == 2


def first_ptr(stager, exclude):
    return next(s.buffers[0].data_ptr() for s in stager._sets
                if s.buffers[0].data_ptr() != exclude.tensors[0].data_ptr())


def test_without_reuse_buffers_are_freed_at_release():
    stager = ShmStager(job_id="t", rank=0, reuse=False)
    batch = stager.stage([torch.ones(1024)], keys=["w"])
    assert stager.host_bytes() == 4096
    batch.release()
    assert stager.host_bytes() == 0


def test_staged_buffers_are_shared_memory():
    batch = ShmStager(job_id="t", rank=0, reuse=True).stage([torch.ones(8)], keys=["w"])
    assert batch.tensors[0].is_shared()


HOLDER = textwrap.dedent("""
    import sys, time, torch
    from megatron_ckpt_ext.staging import ShmStager
    s = ShmStager(job_id="kill", rank=0, reuse=True)
    b = s.stage([torch.ones(64 * 2**20 // 4)], keys=["w"])
    print("ready", flush=True)
    time.sleep(60)
""")


def test_killed_process_leaves_no_shared_memory_behind():
    before_names, before_used = set(os.listdir("/dev/shm")), shutil.disk_usage("/dev/shm").used
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        held = shutil.disk_usage("/dev/shm").used - before_used
        assert held >= 60 * 2**20, "the staged 64 MiB should be in /dev/shm while held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    time.sleep(0.5)
    assert set(os.listdir("/dev/shm")) - before_names == set()
    assert shutil.disk_usage("/dev/shm").used - before_used < 8 * 2**20


Usage = namedtuple("Usage", "total used free")


def test_preflight_shm_shortfall_names_needed_available_and_fix():
    small = lambda path: Usage(2**30, 2**30 - 2**28, 2**28)  # 256 MiB free
    with pytest.raises(CkptOptionsError) as e:
        preflight.check_shm(2**28, ranks=4, probe=small)
    msg = str(e.value)
    assert "needs 1.00 GiB" in msg and "0.25 GiB is free" in msg and "4 ranks" in msg
    assert "--shm-size" in msg and "drop --async-ckpt-use-cpu-shm" in msg
    preflight.check_shm(2**26, ranks=4, probe=small)  # 256 MiB needed: fits


def test_preflight_disk_warns_when_below_last_checkpoint(tmp_path, caplog):
    from megatron_ckpt_ext import backend

    backend._reset_warnings_for_tests()
    tiny = lambda path: Usage(10**9, 10**9 - 10**6, 10**6)
    with caplog.at_level("WARNING"):
        assert preflight.check_disk(tmp_path / "ckpt", 10**8, probe=tiny) is False
    assert "the last checkpoint took" in caplog.text
    assert preflight.check_disk(tmp_path, 10**5, probe=tiny) is True


def test_checkpointer_fails_before_first_cpu_shm_save_when_shm_is_short(monkeypatch, tmp_path):
    """End to end in one process (no process group): the start of the first save raises."""
    from megatron_ckpt_ext import Checkpointer, CkptOptions
    from megatron.core.dist_checkpointing import ShardedTensor

    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: Usage(2**20, 2**20, 100))
    opts = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True)
    with Checkpointer(opts) as ck:
        with pytest.raises(CkptOptionsError, match=r"needs 0\.00 GiB of shared memory .* 0\.00 GiB is free"):
            ck.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1000))}, tmp_path, iteration=1)


