"""--ckpt-memory-snapshot-sets 2: a save stages into a set other than the sealed snapshot's, so
the last committed snapshot stays sealed (and intact) while the next save stages, writes and
commits; the sets alternate, and prepare() allocates both. With 1 set the next save unseals the
snapshot before it stages (the contrast)."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext.staging.retained import buffer_crc32, read_seal, seal_path
from megatron_ckpt_ext.staging.shm import ShmStager

KEYS = ["w", "b"]
LAYOUT = [("w", [0], [1000], "torch.float32"), ("b", [0], [300], "torch.bfloat16")]


def _state(step: int) -> list[torch.Tensor]:
    return [torch.arange(1000, dtype=torch.float32) + step,
            torch.full((300,), float(step), dtype=torch.bfloat16)]


def _save_and_seal(stager: ShmStager, root, step: int):
    batch = stager.stage(_state(step), keys=KEYS)
    stager.seal(batch, root=str(root), iteration=step, world=1, layout=LAYOUT, manifest_crc32="1")
    stager._seal_thread.join()
    stager._release(batch._set)  # the save's writer is done with it
    return batch


def _sealed(tmp_path, root):
    return read_seal(seal_path(str(tmp_path), root, 0))


@pytest.fixture
def make(tmp_path):
    made = []

    def build(sets: int) -> ShmStager:
        made.append(ShmStager(job_id=f"s{sets}", rank=0, reuse=True, pin=False,
                              shm_dir=str(tmp_path), sweep=False, snapshot_sets=sets))
        return made[-1]

    yield build
    for s in made:
        s.close()


def test_the_snapshot_stays_sealed_and_intact_while_the_next_save_stages(tmp_path, make):
    root = tmp_path / "ckpt"
    stager = make(2)
    stager.prepare(_state(0), keys=KEYS)
    assert len(stager._sets) == 2  # both sets allocated ahead of the first save
    first = _save_and_seal(stager, root, 1)
    seal = _sealed(tmp_path, root)
    assert seal.iteration == 1

    second = stager.stage(_state(2), keys=KEYS)  # a save in flight (not yet committed)
    still = _sealed(tmp_path, root)
    assert still is not None and still.iteration == 1 and still.generation == seal.generation
    assert {t.data_ptr() for t in second.tensors}.isdisjoint(t.data_ptr() for t in first.tensors)
    for entry, buffer, want in zip(still.entries, first.tensors, _state(1)):
        assert torch.equal(buffer, want) and buffer_crc32(buffer) == entry.crc32

    stager.seal(second, root=str(root), iteration=2, world=1, layout=LAYOUT, manifest_crc32="1")
    stager._seal_thread.join()
    stager._release(second._set)
    assert _sealed(tmp_path, root).iteration == 2
    third = stager.stage(_state(3), keys=KEYS)  # back into the first set: no allocation
    assert [t.data_ptr() for t in third.tensors] == [t.data_ptr() for t in first.tensors]
    assert stager.stats["sets_built_at_stage"] == 0 and len(stager._sets) == 2


def test_with_one_set_the_next_save_unseals_the_snapshot_first(tmp_path, make):
    root = tmp_path / "ckpt"
    stager = make(1)
    stager.prepare(_state(0), keys=KEYS)
    assert len(stager._sets) == 1
    first = _save_and_seal(stager, root, 1)
    second = stager.stage(_state(2), keys=KEYS)
    assert _sealed(tmp_path, root) is None  # its buffers now hold the uncommitted save
    assert [t.data_ptr() for t in second.tensors] == [t.data_ptr() for t in first.tensors]


def test_an_adopted_snapshot_counts_as_one_of_the_two_sets(tmp_path, make):
    root = tmp_path / "ckpt"
    _save_and_seal(make(2), root, 1)
    restarted = make(2)
    adopted = restarted.adopt(_sealed(tmp_path, root))
    restarted.prepare(_state(0), keys=KEYS)
    assert len(restarted._sets) == 2  # the adopted set and one more
    nxt = restarted.stage(_state(2), keys=KEYS)
    assert {t.data_ptr() for t in nxt.tensors}.isdisjoint(a.data_ptr() for a in adopted)
    assert _sealed(tmp_path, root).iteration == 1  # still restorable while this save runs


@pytest.mark.parametrize("sets,admitted", [(1, True), (2, False)])
def test_node_admission_counts_both_sets(one_rank_group, tmp_path, sets, admitted):
    """3 MiB staged per set against a 4 MiB node budget: one set fits, two do not."""
    from megatron_ckpt_ext import Checkpointer, CkptOptions, backend
    from megatron_ckpt_ext.errors import InsufficientHostMemory

    st = backend.sharded_tensor_cls()
    state = {"w": st.from_rank_offsets("w", torch.zeros(3 << 18), replica_id=0)}  # 3 MiB fp32
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True, ckpt_node_memory_limit_mib=4,
                          ckpt_memory_snapshot_sets=sets)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        if admitted:
            ck.prepare(state)
            assert ck.wait_prepared(timeout_s=60)
        else:
            with pytest.raises(InsufficientHostMemory):
                ck.prepare(state)


def test_staging_does_not_wait_for_the_summing_of_the_seal_it_cancels(tmp_path, make, monkeypatch):
    """A save that stages right after the previous one committed (Megatron-LM's end-of-training
    save can come a few milliseconds after the commit) cancels that seal's summing and stages
    at once; the cancelled summing, when it ends, writes no seal naming buffers that changed."""
    import threading

    from megatron_ckpt_ext.staging import sealing

    held, started = threading.Event(), threading.Event()

    def slow_sums(tensors, *, cancelled=None, threads=None):
        started.set()
        held.wait(30)  # the summing of a large snapshot, still running
        return [buffer_crc32(t) for t in tensors]  # (finished: not cancelled by itself)

    monkeypatch.setattr(sealing, "crc32_all", slow_sums)
    root = tmp_path / "ckpt"
    stager = make(1)
    batch = stager.stage(_state(1), keys=KEYS)
    stager.seal(batch, root=str(root), iteration=1, world=1, layout=LAYOUT, manifest_crc32="1")
    summing = stager._seal_thread
    stager._release(batch._set)
    assert started.wait(10)

    staged = threading.Event()
    worker = threading.Thread(target=lambda: (stager.stage(_state(2), keys=KEYS), staged.set()),
                              daemon=True)
    worker.start()
    try:
        assert staged.wait(10), "the next staging waited for the cancelled seal's summing"
    finally:
        held.set()
    summing.join(10)
    assert not summing.is_alive()
    assert _sealed(tmp_path, root) is None  # the cancelled seal was never written


@pytest.mark.parametrize("threads", [1, 3])
def test_a_cancelled_seal_sums_no_further_buffer(monkeypatch, threads):
    """Once a seal is cancelled its summing threads take no further buffer: they would run
    beside the next save's staging, and their churn over hundreds of buffers took the GIL from
    it (the end-of-training save's planning on the H100: 52 ms instead of 24)."""
    import threading

    from megatron_ckpt_ext.staging import retained

    cancel, seen, lock = threading.Event(), [], threading.Lock()
    original = retained.buffer_crc32

    def counting(tensor, cancelled=None):
        with lock:
            seen.append(tensor)
            if len(seen) == threads:
                cancel.set()  # the next save unseals while these are summed
        return original(tensor, cancelled)

    monkeypatch.setattr(retained, "buffer_crc32", counting)
    buffers = [torch.full((1000,), float(i)) for i in range(200)]
    assert retained.crc32_all(buffers, threads=threads, cancelled=cancel) is None
    assert len(seen) <= 2 * threads, len(seen)
    uncancelled = retained.crc32_all(buffers[:5], threads=threads)
    assert uncancelled == [original(b) for b in buffers[:5]]


def test_a_seal_that_cannot_be_written_is_said_once_and_leaves_no_file(tmp_path, make,
                                                                        monkeypatch, caplog):
    """/dev/shm full after the buffers were made (another job filled it): every save's seal
    fails alike; the process says so once (not at every save), leaves no half-written seal,
    and a later seal that fits is written."""
    import errno
    import json
    import logging

    from megatron_ckpt_ext.staging import retained

    real_dump = json.dump

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    root = tmp_path / "ckpt"
    stager = make(1)
    monkeypatch.setattr(retained.json, "dump", full)
    with caplog.at_level(logging.WARNING, logger="megatron_ckpt_ext.staging.sealing"):
        _save_and_seal(stager, root, 1)
        _save_and_seal(stager, root, 2)
    said = [r for r in caplog.records if "could not seal" in r.getMessage()]
    assert len(said) == 1 and "No space left" in said[0].getMessage(), caplog.text
    assert _sealed(tmp_path, root) is None
    assert not [p for p in tmp_path.iterdir() if ".json.tmp" in p.name]
    monkeypatch.setattr(retained.json, "dump", real_dump)
    _save_and_seal(stager, root, 3)
    assert _sealed(tmp_path, root).iteration == 3
