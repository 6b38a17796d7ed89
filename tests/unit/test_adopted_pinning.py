"""A restore from memory adopts the snapshot's segments unpinned (the restore copies through
pinned bounce chunks) and pins them afterwards on a background thread, before the next save
stages into them: the next stage() waits for the pinning, a prepare() meanwhile runs after it,
and close() waits for it before unpinning. CUDA's register calls are stood in for (CPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_ckpt_ext.staging import sealing
from megatron_ckpt_ext.staging.retained import read_seal, seal_path
from megatron_ckpt_ext.staging.shm import ShmStager


@pytest.fixture
def pins(monkeypatch):
    """A fake cudaHostRegister that takes a while, recording what it pinned and when."""
    done: list[tuple[int, float]] = []
    unpinned: list[int] = []

    def register(tensor: torch.Tensor, nbytes: int) -> bool:
        time.sleep(0.15)
        done.append((tensor.data_ptr(), time.monotonic()))
        return True

    class _Cudart:
        @staticmethod
        def cudaHostUnregister(ptr: int) -> int:
            unpinned.append(ptr)
            return 0

    monkeypatch.setattr(sealing, "_register", register)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart)
    return done, unpinned


def _sealed_snapshot(tmp_path, root) -> list[torch.Tensor]:
    """A snapshot sealed by a first stager (then abandoned, as by a crash)."""
    state = [torch.arange(1000, dtype=torch.float32), torch.ones(300, dtype=torch.bfloat16)]
    first = ShmStager(job_id="first", rank=0, reuse=True, pin=False, shm_dir=str(tmp_path),
                      sweep=False)
    batch = first.stage(state, keys=["w", "b"])
    layout = [("w", [0], [1000], "torch.float32"), ("b", [0], [300], "torch.bfloat16")]
    first.seal(batch, root=str(root), iteration=1, world=1, layout=layout, manifest_crc32="1")
    first._seal_thread.join()
    first._closed = True  # gone as by a crash: no cleanup runs (tmp_path holds the segments)
    return state


def _adopted(tmp_path) -> tuple[list[torch.Tensor], ShmStager, list[torch.Tensor]]:
    """A second stager (the restarted job's, pinning) that adopted that snapshot: the state, the
    stager, the adopted buffers."""
    state = _sealed_snapshot(tmp_path, tmp_path / "ckpt")
    stager = ShmStager(job_id="second", rank=0, reuse=True, pin=True, shm_dir=str(tmp_path),
                       sweep=False)
    return state, stager, stager.adopt(read_seal(seal_path(str(tmp_path), tmp_path / "ckpt", 0)))


def test_the_adopted_snapshot_is_pinned_in_the_background_before_the_next_save(tmp_path, pins):
    done, unpinned = pins
    root = tmp_path / "ckpt"
    state = _sealed_snapshot(tmp_path, root)
    seal = read_seal(seal_path(str(tmp_path), root, 0))
    stager = ShmStager(job_id="second", rank=0, reuse=True, pin=True, shm_dir=str(tmp_path),
                       sweep=False)
    adopted = stager.adopt(seal)
    assert done == []  # adopting maps, it does not pin (the restore's bounce copy is faster)
    assert all(torch.equal(a, s) for a, s in zip(adopted, state))

    t0 = time.monotonic()
    stager.pin_adopted()
    assert time.monotonic() - t0 < 0.1  # off the restore's path
    prepared = threading.Event()
    stager.prepare(state, keys=["w", "b"], background=True, then=lambda _: prepared.set())
    assert time.monotonic() - t0 < 0.1  # a prepare() meanwhile does not wait either
    assert not prepared.is_set()

    batch = stager.stage([s + 1 for s in state], keys=["w", "b"])  # waits for the pinning
    assert sorted(p for p, _ in done) == sorted(a.data_ptr() for a in adopted)
    assert prepared.is_set()
    # what the pinning took (the next report's)
    assert stager.stats["pinned_adopted"]["pin_adopted_s"] >= 0.14
    assert [t.data_ptr() for t in batch.tensors] == [a.data_ptr() for a in adopted]
    assert stager.stats["sets_built_at_stage"] == 0  # staged into the adopted, pinned, buffers
    stager.close()
    assert sorted(unpinned) == sorted(a.data_ptr() for a in adopted)


def test_close_waits_for_the_pinning_before_unpinning(tmp_path, pins):
    done, unpinned = pins
    root = tmp_path / "ckpt"
    _sealed_snapshot(tmp_path, root)
    stager = ShmStager(job_id="second", rank=0, reuse=True, pin=True, shm_dir=str(tmp_path),
                       sweep=False)
    adopted = stager.adopt(read_seal(seal_path(str(tmp_path), root, 0)))
    stager.pin_adopted()
    stager.close()  # while the pinning runs
    assert len(done) == len(adopted) and sorted(unpinned) == sorted(p for p, _ in done)


def test_a_prepare_allocating_the_ready_flag_meanwhile_does_not_skip_the_pinning(tmp_path, pins,
                                                                                  monkeypatch):
    """As Checkpointer.load calls them: prepare() in the background (its thread allocates the
    writer's unpinned ready flag), then pin_adopted() on the loading thread while that
    allocation runs. The flag's allocation once turned the stager's ``pin`` off for its
    duration, so the pinning found it off and never ran (found on an H200: the adopted buffers
    staged the next saves unpinned)."""
    from megatron_ckpt_ext.staging import shm

    done, _ = pins
    state, stager, adopted = _adopted(tmp_path)
    inside, go = threading.Event(), threading.Event()
    segment = shm._shared_segment

    def held_flag(path: str, nbytes: int, *, key: str):  # the flag's allocation, held open
        if key == "mcx-ready-flag":
            inside.set()
            assert go.wait(10)
        return segment(path, nbytes, key=key)

    monkeypatch.setattr(shm, "_shared_segment", held_flag)
    stager.prepare(state, keys=["w", "b"], background=True)
    assert inside.wait(10)  # the prepare's thread is allocating the flag now
    stager.pin_adopted()
    go.set()
    stager.stage([s + 1 for s in state], keys=["w", "b"])  # waits for prepare and pinning
    assert sorted(p for p, _ in done) == sorted(a.data_ptr() for a in adopted)
    stager.close()


def test_pinning_asked_by_the_load_and_by_prepare_registers_each_buffer_once(tmp_path, pins):
    """The load asks for the pinning as it returns and prepare() asks again (the first save's
    staging): one pinning thread, each buffer registered once, its time kept in the stats."""
    done, _ = pins
    state, stager, adopted = _adopted(tmp_path)
    stager.pin_adopted()
    stager.pin_adopted()  # while the first runs
    stager.prepare(state, keys=["w", "b"], background=True)
    stager.stage([s + 1 for s in state], keys=["w", "b"])  # waits for both
    assert sorted(p for p, _ in done) == sorted(a.data_ptr() for a in adopted)
    # the one pinning's time, not a no-op's
    assert stager.stats["pinned_adopted"]["pin_adopted_s"] >= 0.14
    stager.close()


def test_prepare_pins_an_adopted_snapshot_the_load_left_unpinned(tmp_path, pins):
    """A load told not to pin (the launcher's MCX_PIN_ADOPTED=step): the first save's prepare()
    pins the adopted buffers before its own work, so that save stages into pinned memory."""
    done, _ = pins
    state, stager, adopted = _adopted(tmp_path)
    t0 = time.monotonic()
    stager.prepare(state, keys=["w", "b"], background=True)
    assert time.monotonic() - t0 < 0.1  # in the background
    batch = stager.stage([s + 1 for s in state], keys=["w", "b"])
    assert sorted(p for p, _ in done) == sorted(a.data_ptr() for a in adopted)
    assert [t.data_ptr() for t in batch.tensors] == [a.data_ptr() for a in adopted]
    assert stager.stats["sets_built_at_stage"] == 0
    stager.close()


def test_a_blocking_prepare_of_another_structure_waits_for_the_pinning_it_takes_over(tmp_path,
                                                                                     pins,
                                                                                     monkeypatch):
    """prepare() without ``background`` for a state the adopted snapshot does not fit: the new
    set takes over the adopted buffers that match and frees the rest, only once the pinning
    prepare() started is done, so no buffer is registered after it was freed (every
    registration is undone exactly once by the end)."""
    from megatron_ckpt_ext.staging import shm

    done, unpinned = pins  # (a new buffer's registration recorded alike)
    monkeypatch.setattr(shm, "_register", lambda t, n, faulted_in=None: bool(
        done.append((t.data_ptr(), time.monotonic())) or True))
    state, stager, adopted = _adopted(tmp_path)
    other = [state[0], torch.zeros(50, dtype=torch.float64)]  # "w" kept, "b" freed, "c" new
    stager.prepare(other, keys=["w", "c"])
    stager.stage(other, keys=["w", "c"])
    stager.close()
    assert sorted(unpinned) == sorted(p for p, _ in done), (done, unpinned)
    assert adopted[0].data_ptr() in unpinned and adopted[1].data_ptr() in unpinned


@pytest.mark.parametrize("pace, gap", [(None, 0.58), ("0.5", 0.28), ("1", None)])
def test_paced_pinning_pauses_between_buffers(tmp_path, pins, monkeypatch, pace, gap):
    """By default (MCX_PIN_PACE=0.25) each buffer's pinning (0.15 s here) is followed by a pause
    three times as long, one buffer at a time (0.5: as long); nothing waits, so the second is
    pinned that much later. 1: no pauses, the buffers at once on several threads."""
    if pace is not None:
        monkeypatch.setenv("MCX_PIN_PACE", pace)
    done, _ = pins
    _, stager, adopted = _adopted(tmp_path)
    t0 = time.monotonic()
    stager.pin_adopted()
    stager._prepare_thread.join()  # (not wait_prepared: that would hurry it)
    took = time.monotonic() - t0
    assert len(done) == len(adopted) == 2
    if pace is None:  # 0.15 + 0.45 + 0.15 s: no pause after the last (which would be 1.2 s)
        assert took < 1.0
    first, second = sorted(t for _, t in done)
    if gap is None:
        # (on several threads at once; one thread where the rank has one core: 0.15 s apart)
        assert second - first < 0.25 and "pin_paused_s" not in stager.stats["pinned_adopted"]
    else:
        assert second - first >= gap  # the pause after the first, then the second's 0.15 s
        assert stager.stats["pinned_adopted"]["pin_paused_s"] >= gap - 0.15
    stager.close()


@pytest.mark.parametrize("waiter", ["stage", "close"])
def test_a_save_or_close_hurries_paced_pinning(tmp_path, pins, monkeypatch, waiter):
    """Pacing that would pause 15 s after the first buffer (MCX_PIN_PACE=0.01): a stage() or
    close() that waits for the pinning ends the pauses, so it waits about one pinning only."""
    monkeypatch.setenv("MCX_PIN_PACE", "0.01")
    done, _ = pins
    state, stager, adopted = _adopted(tmp_path)
    stager.pin_adopted()
    time.sleep(0.05)
    t0 = time.monotonic()
    if waiter == "stage":
        stager.stage([s + 1 for s in state], keys=["w", "b"])
    else:
        stager.close()
    assert time.monotonic() - t0 < 2.0
    assert len(done) == len(adopted)
    stager.close()


def test_the_next_save_reports_the_pinning_and_its_pauses_once(one_rank_group, tmp_path):
    """What the background pinning of a restored snapshot took and how much of it was pauses
    (the stager's counters, stood in for here) are in the next save's stage_detail, and only
    in that one."""
    from megatron_ckpt_ext import Checkpointer, CkptOptions, backend

    st = backend.sharded_tensor_cls()
    state = {"w": torch.randn(64, 32), "b": torch.randn(512)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          ckpt_assume_constant_structure=True)
    with Checkpointer(options, save_dir=str(tmp_path)) as ck:
        for it in (1, 2, 3):
            if it == 2:
                ck._stager.stats["pinned_adopted"] = {"pin_adopted_s": 0.25,
                                                      "pin_paused_s": 0.125}
            ck.save({k: st.from_rank_offsets(k, t, replica_id=0) for k, t in state.items()},
                    tmp_path, iteration=it)
            ck.maybe_finalize(blocking=True)
        details = [r["stage_detail"] for r in ck.reports]
    assert [(d.get("pin_adopted_s"), d.get("pin_paused_s")) for d in details] == [
        (None, None), (0.25, 0.125), (None, None)]


@pytest.mark.parametrize("value, pace", [(None, 0.25), ("0.5", 0.5), ("1", 1.0), ("2", 1.0),
                                         ("0", 1.0), ("-1", 1.0), ("fast", 1.0), ("nan", 1.0)])
def test_a_pace_outside_0_to_1_or_not_a_number_pins_without_pauses(monkeypatch, value, pace):
    """MCX_PIN_PACE is a share of the time: above 1 is 1; zero, negative or not a number never
    stops the pinning (no pauses) and never raises."""
    if value is not None:
        monkeypatch.setenv("MCX_PIN_PACE", value)
    assert sealing._pin_pace() == pace


def test_a_save_during_paced_pinning_reports_none_of_it_until_it_is_over(tmp_path, pins,
                                                                         monkeypatch):
    """The pinning's figures appear once it is over, whole: a save that takes the stager's
    counters while the pinning still pauses (after its first pause, before its last buffer)
    finds nothing of it, and the save after the pinning finds the pauses and the wall time
    together (the pauses used to be added up where a save could take part of them)."""
    monkeypatch.setenv("MCX_PIN_PACE", "0.5")
    done, _ = pins
    _, stager, adopted = _adopted(tmp_path)
    stager.pin_adopted()
    deadline = time.monotonic() + 5.0
    while len(done) < 1 and time.monotonic() < deadline:  # the first buffer pinned
        time.sleep(0.005)
    time.sleep(0.22)  # its pause (0.15 s) over, the second buffer's pinning (0.15 s) under way
    assert len(done) == 1
    during = dict(stager.stats)
    stager._prepare_thread.join()
    assert "pinned_adopted" not in during and "pin_paused_s" not in during, during
    figures = stager.stats["pinned_adopted"]
    assert figures["pin_paused_s"] >= 0.1 and figures["pin_adopted_s"] >= 0.4, figures
    stager.close()
