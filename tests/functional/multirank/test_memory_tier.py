"""The memory tier: a job killed after a committed save leaves its sealed snapshot in /dev/shm;
the restarted job restores from it (bit-exact, told apart from storage in the load report), and
refuses it for storage whenever it is not provably the checkpoint being loaded."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

from megatron_ckpt_ext.staging import sweep_orphans
from megatron_ckpt_ext.staging.retained import read_seal, seal_path

from . import _memory_workers as w
from tests._support.dist import device, run_ranks, world
from tests._support.seals import flip_byte

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]

CPU_SHM = {"async_save": True, "async_ckpt_use_cpu_shm": True}
MODES = {
    "temporal": CPU_SHM,
    "persistent": {**CPU_SHM, "use_persistent_ckpt_worker": True},
    "persistent-constant": {**CPU_SHM, "use_persistent_ckpt_worker": True,
                            "ckpt_assume_constant_structure": True},
}


def _cleanup(root: Path) -> None:
    for r in range(world()):
        seal = read_seal(seal_path("/dev/shm", root, r))
        if seal is not None:
            for e in seal.entries:
                if e.path and os.path.exists(e.path):
                    os.unlink(e.path)
            os.unlink(seal.file)


@pytest.fixture
def root(tmp_path):
    yield tmp_path / "ckpt"
    _cleanup(tmp_path / "ckpt")


def _reports(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"restore{r}.json").read_text()) for r in range(world())]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_job_restarts_from_memory_bit_exact(mode, root, tmp_path):
    run_ranks(w.save_and_die, args=(str(root), MODES[mode], 2))
    swept = sweep_orphans()  # the start-up sweep of any run: the dead run's snapshot stays
    assert not [p for p in swept if "mcx_" in p and str(os.getpid()) not in p
                and any(p == e.path for r in range(world())
                        for e in read_seal(seal_path("/dev/shm", root, r)).entries)]
    run_ranks(w.restore, args=(str(root), MODES[mode], None, 2, "memory", str(tmp_path)))
    for rep in _reports(tmp_path):
        assert rep["report"]["tier"] == "memory" and rep["report"]["verified"]
        if mode == "persistent-constant":  # the save after the restore staged into the snapshot
            assert rep["allocated_before_save"] <= 8  # the writer's one-word ready flag alone
            assert rep["allocated_after_save"] == rep["allocated_before_save"]
            # admitted: nothing new, the adopted buffers named as held (not "stages 0 bytes")
            admission = rep["admission"]
            assert admission["node_staging_bytes"] == 0, admission
            assert admission["node_kept_bytes"] >= world() * rep["report"]["memory_bytes"]


@pytest.mark.parametrize("prefetch,sums", [(True, "host"), (False, "host"), (False, "device")])
def test_a_restart_prepared_while_the_model_is_built_only_copies(root, tmp_path, prefetch, sums,
                                                                monkeypatch):
    """prepare_restore (as the launcher calls it) maps and sums the snapshot ahead on every rank;
    with CUDA it pins it too and the load copies the pinned buffers whole, or with
    --ckpt-restore-prefetch it copies it to the device, summing on the way, and the load copies
    device to device, or with MCX_RESTORE_SUMS=device (CUDA only; on CPU it sums ahead) it pins
    every buffer unsummed and the load sums the copies on the device, or on the host where the
    kernel is not built yet (scripts/gpu_tests.sh)."""
    import torch

    cuda = torch.cuda.is_available() and device() == "cuda"
    if sums == "device" and not cuda:
        pytest.skip("sums on the device need CUDA (on CPU: "
                    "test_sums_taken_on_the_device_are_agreed_by_every_rank stands it in)")
    monkeypatch.setenv("MCX_RESTORE_SUMS", sums)
    options = {**MODES["persistent-constant"], "ckpt_restore_prefetch": prefetch}
    run_ranks(w.save_and_die, args=(str(root), options, 2))
    buffers = len(read_seal(seal_path("/dev/shm", root, 0)).entries)
    run_ranks(w.restore_prepared, args=(str(root), options, 2, 1.0, str(tmp_path)))
    for rep in _reports(tmp_path):
        report, detail = rep["report"], rep["report"]["memory_detail"]
        assert report["tier"] == "memory" and report["verified"]
        if sums == "device":
            assert detail["summed_ahead"] == 0 and detail["pinned_ahead"] == buffers
            assert detail["device_summed"] in (0, buffers)  # (0: the kernel not built yet)
            continue
        assert detail["summed_ahead"] == buffers and detail["prepare_wait_s"] < 1.0
        if cuda:
            ahead = buffers if prefetch else 0
            assert detail["pinned_ahead"] == buffers - ahead  # (pinned after a copy ahead)
            assert detail["device_ahead"] == ahead and detail["direct"] == buffers - ahead
            if prefetch:  # the saving run's device peak is in its seal, and fits beside: the
                assert detail["device_ahead_block"] == "cached"  # block is torch's own


@pytest.mark.parametrize("flipped", [False, True])
def test_sums_taken_on_the_device_are_agreed_by_every_rank(root, tmp_path, flipped):
    """MCX_RESTORE_SUMS=device (the device stood in for by the CPU): every rank's snapshot is
    pinned ahead unsummed and each copy summed after it landed; a byte flipped in the last
    rank's snapshot is found there only after the copies, and every rank then reads storage
    (never a mix), the damaged snapshot removed."""
    options = MODES["persistent-constant"]
    run_ranks(w.save_and_die, args=(str(root), options, 2))
    seal = read_seal(seal_path("/dev/shm", root, world() - 1))
    if flipped:
        flip_byte(next(e for e in seal.entries if e.nbytes > 64).path, 37, 0x10)
    run_ranks(w.restore_summed_on_the_device, args=(str(root), options, 2, str(tmp_path)))
    reports = _reports(tmp_path)
    assert len(reports) == world()
    for rep in reports:
        report = rep["report"]
        assert report["tier"] == ("storage" if flipped else "memory"), report
        if not flipped:
            detail = report["memory_detail"]
            assert detail["summed_ahead"] == 0 and detail["device_summed"] == len(seal.entries)
            assert "device_sums_s" in report["memory_steps"]
    if flipped:
        assert not os.path.exists(seal.file)  # damaged: removed, not offered again


@pytest.mark.parametrize("sets,tier", [(2, "memory"), (1, "storage")])
def test_a_job_killed_in_the_middle_of_a_save_restores_memory_only_with_two_sets(
        sets, tier, root, tmp_path):
    """--ckpt-memory-snapshot-sets 2: the committed snapshot stays sealed while the next save
    stages into the other set, so a job dying inside that save restores the tracker's iteration
    from memory; with one set those buffers hold the uncommitted save: storage."""
    options = {**MODES["persistent-constant"], "ckpt_memory_snapshot_sets": sets}
    run_ranks(w.die_in_the_next_save, args=(str(root), options, 2))
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    run_ranks(w.restore, args=(str(root), options, None, 2, tier, str(tmp_path)))
    for rep in _reports(tmp_path):
        assert rep["report"]["tier"] == tier and rep["report"]["iteration"] == 2


@pytest.mark.parametrize("case", ["same", "one_seal_names_another_structure",
                                  "every_rank_leaves_out_an_object", "one_rank_loads_it"])
def test_a_restore_from_memory_does_not_validate_the_sharding_again(root, tmp_path, case):
    """The seal names the structure megatron-core validated in the run that saved it: a
    restore whose every rank has that structure runs no sharding validation, neither in the
    load, nor in the prepare() after the load, nor in one the launcher makes after the first
    step, nor in the first save; nor where every rank leaves out the same whole object the
    save held (as Megatron-LM's load leaves out its rerun state machine's). Where one rank's
    seal names another structure, or one rank loads the object the others leave out, every
    rank validates (once in the load, once in prepare())."""
    if case == "one_rank_loads_it" and world() < 2:  # one rank: its load is every rank's
        pytest.skip("one rank loading what the others leave out needs two ranks")
    rerun = case in ("every_rank_leaves_out_an_object", "one_rank_loads_it")
    run_ranks(w.save_and_die, args=(str(root), MODES["persistent-constant"], 2, False, rerun))
    if case == "one_seal_names_another_structure":
        path = seal_path("/dev/shm", root, world() - 1)
        data = json.loads(Path(path).read_text())
        assert data["structure"]  # the save named its structure
        data["structure"] = "0" * 40
        data["objects"].append(["ShardedObject", "gone", [1], [0], "", []])
        Path(path).write_text(json.dumps(data))
    loading = (0,) if case == "one_rank_loads_it" else ()
    run_ranks(w.restore_and_count_validations,
              args=(str(root), MODES["persistent-constant"], str(tmp_path), loading))
    reports = _reports(tmp_path)
    if case == "one_seal_names_another_structure":  # that rank's report says what differs
        assert "removed [['ShardedObject', 'gone'" in reports[-1]["report"]["memory_detail"][
            "structure_differs"]
    proven = case in ("same", "every_rank_leaves_out_an_object")
    for r, rep in enumerate(reports):
        detail = rep["report"]["memory_detail"]
        assert rep["report"]["tier"] == "memory"
        assert detail["structure_proven"] is proven
        if rerun and r not in loading:
            assert detail["objects_not_loaded"] == ["rerun_state_machine_state"]
        assert rep["load_validated"] == [not proven]
        assert rep["prepare_validations"] == (0 if proven else 1)
        # validated by the seal or by prepare() (None: planned ahead, not a new structure)
        assert rep["first_save_validated"] is not True


def test_a_flipped_byte_in_a_snapshot_reads_storage(root, tmp_path, caplog):
    run_ranks(w.save_and_die, args=(str(root), MODES["persistent"], 2))
    seal = read_seal(seal_path("/dev/shm", root, world() - 1))
    target = next(e for e in seal.entries if e.nbytes > 64)
    flip_byte(target.path, 37, 0x10)
    run_ranks(w.restore, args=(str(root), MODES["persistent"], None, 2, "storage", str(tmp_path)))
    assert not os.path.exists(seal.file)  # a damaged snapshot is removed, not offered again


def test_another_iteration_or_the_switch_off_reads_storage(root, tmp_path):
    run_ranks(w.save_and_die, args=(str(root), MODES["persistent"], 2))
    # iteration 1 asked for: the snapshot holds 2; nobody will adopt it, so its memory is freed
    stale = [read_seal(seal_path("/dev/shm", root, r)) for r in range(world())]
    run_ranks(w.restore, args=(str(root), MODES["persistent"], 1, 1, "storage", str(tmp_path)))
    assert not [e.path for s in stale for e in s.entries if e.path and os.path.exists(e.path)]
    run_ranks(w.save_and_die, args=(str(root), MODES["persistent"], 2))
    off = {**MODES["persistent"], "ckpt_memory_restore": False}
    stale = [read_seal(seal_path("/dev/shm", root, r)) for r in range(world())]
    run_ranks(w.restore, args=(str(root), off, None, 2, "storage", str(tmp_path)))
    assert not [e.path for s in stale for e in s.entries if e.path and os.path.exists(e.path)]


def test_shm_clean_removes_a_sealed_snapshot(root):
    run_ranks(w.save_and_die, args=(str(root), MODES["temporal"], 1))
    seal = read_seal(seal_path("/dev/shm", root, 0))
    assert seal is not None and all(os.path.exists(e.path) for e in seal.entries if e.path)
    listed = subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", "shm", "list"],
                            capture_output=True, text=True, check=True).stdout
    assert f"{os.path.realpath(root)}  iteration 1  rank 0/{world()}" in listed
    subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", "shm", "clean"], check=True,
                   capture_output=True)
    assert not os.path.exists(seal.file)
    assert not [e.path for e in seal.entries if e.path and os.path.exists(e.path)]


@pytest.mark.parametrize("prepared", [False, True])
def test_a_fresh_start_into_the_same_save_frees_the_old_snapshot_before_staging(root, prepared):
    run_ranks(w.save_and_die, args=(str(root), MODES["persistent"], 2))
    stale = [read_seal(seal_path("/dev/shm", root, r)) for r in range(world())]
    run_ranks(w.fresh_start, args=(str(root), MODES["persistent"], prepared))
    assert not [e.path for s in stale for e in s.entries if e.path and os.path.exists(e.path)]


def test_another_job_loading_a_running_jobs_checkpoint_never_takes_its_snapshot(root, tmp_path):
    """A second job on the node loads the latest checkpoint of a job that is still running (an
    evaluation, a fine-tune starting from it): the running job's sealed snapshot is mapped by
    that job, so the second reads storage (adopting it would make the second job's saves stage
    into the first job's buffers); the running job's seal stays, its buffers unchanged; `shm
    list` shows it in use and `shm clean` (a node's prolog) leaves it."""
    import threading
    import zlib

    flags = tmp_path / "flags"
    flags.mkdir()
    options = MODES["persistent-constant"]
    failed: list = []

    def running_job() -> None:
        try:
            run_ranks(w.save_and_hold, args=(str(root), options, 2, str(flags)), timeout=120)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failed.append(e)

    first = threading.Thread(target=running_job)
    first.start()
    try:
        deadline = time.monotonic() + 90
        while not all((flags / f"ready{r}").exists() for r in range(world())):
            if failed:  # the running job's own failure, whole
                raise failed[0]
            assert time.monotonic() < deadline, "the running job never got to its seal"
            time.sleep(0.05)
        seals = [read_seal(seal_path("/dev/shm", root, r)) for r in range(world())]
        # a node's prolog cleaning /dev/shm meanwhile leaves the running job's snapshot alone
        cli = [sys.executable, "-m", "megatron_ckpt_ext", "shm"]
        listed = subprocess.run(cli + ["list"], capture_output=True, text=True, check=True).stdout
        assert listed.count("in use (a running job maps it)") >= world(), listed
        cleaned = subprocess.run(cli + ["clean"], capture_output=True, text=True,
                                 check=True).stdout
        assert "sealed snapshot(s) of running jobs" in cleaned, cleaned  # (others' too, if any)
        assert os.path.realpath(root) in cleaned, cleaned
        # with the memory tier, and without it (which frees a snapshot of the load's root that
        # it will not adopt, but not one a live job maps)
        for n, opts in enumerate((options, {**options, "ckpt_memory_restore": False})):
            run_ranks(w.load_anothers_and_save, args=(str(root), opts, 2,
                                                      str(tmp_path / f"other{n}"), str(tmp_path)))
            reports = [json.loads((tmp_path / f"other{r}.json").read_text())
                       for r in range(world())]
            assert all(rep["tier"] == "storage" for rep in reports), (n, reports)
            for r, seal in enumerate(seals):
                assert read_seal(seal_path("/dev/shm", root, r)) == seal, n  # left as it was
                for e in seal.entries:
                    if e.path:
                        with open(e.path, "rb") as fh:
                            assert zlib.crc32(fh.read(e.nbytes)) == e.crc32, (n, e.key)
    finally:
        (flags / "done").touch()
        first.join(150)
    assert not failed, failed
