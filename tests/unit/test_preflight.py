"""Preflight: node-level admission (the sum of a node's ranks' staging against its memory and
/dev/shm) fails on every rank naming the node, the bytes and the fix; a disk with less room than
the last checkpoint warns once; the checkpointer runs the admission before its first staging."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import _runtime, backend, preflight
from megatron_ckpt_ext.errors import InsufficientHostMemory, InsufficientSharedMemory
from megatron_ckpt_ext.preflight import DiskUsage

SMALL_SHM = DiskUsage(2**30, 2**30 - 2**28, 2**28)  # 256 MiB free


GiB = 2**30


def _budget(shm_free: int = 64 * GiB, mem_available: int = 100 * GiB) -> tuple:
    return tuple(preflight.HostBudget(shm_free, mem_available, -1))


def _cluster(*ranks: tuple):
    """A gather that answers with these ranks' (host, bytes, budget[, held]), as the all-gather
    would (held: the sealed snapshots of ended runs in the rank's /dev/shm, none if left out)."""
    return lambda mine: [r if len(r) == 4 else (*r, (0, 0)) for r in ranks]


def test_a_node_whose_ranks_together_exceed_its_memory_fails_naming_node_bytes_and_fix():
    # 8 ranks of 16 GiB on node-b: each fits alone (16 < 100), the sum (128) does not
    gather = _cluster(*[("node-a", 2 * GiB, _budget())] * 8, *[("node-b", 16 * GiB, _budget())] * 8)
    with pytest.raises(InsufficientHostMemory) as e:
        preflight.admit_node(0, shm=False, gather=gather)
    msg = str(e.value)
    assert "node node-b (ranks 8-15): its 8 ranks stage 128.00 GiB" in msg, msg
    assert "at most 16.00 GiB" in msg and "MemAvailable" in msg and "100.00 GiB" in msg
    assert "node-a" not in msg  # the node that fits is not named
    assert "--async-save" in msg and "/dev/shm" not in msg  # no cpu-shm: no shm advice
    assert not isinstance(e.value, InsufficientSharedMemory)


def test_shm_short_alone_raises_the_shm_error_with_its_fix():
    gather = _cluster(*[("n", 3 * GiB, _budget(shm_free=10 * GiB))] * 4)
    with pytest.raises(InsufficientSharedMemory) as e:
        preflight.admit_node(0, shm=True, gather=gather)
    msg = str(e.value)
    assert "stage 12.00 GiB" in msg and "/dev/shm has 10.00 GiB" in msg
    assert "--shm-size" in msg and "drop --async-ckpt-use-cpu-shm" in msg
    # the same figures without cpu-shm: /dev/shm is not used, so it fits
    assert preflight.admit_node(0, shm=False, gather=gather)["node_staging_bytes"] == 12 * GiB


def test_a_node_that_fits_exactly_passes_and_reports_the_fullest_node():
    gather = _cluster(("a", 50 * GiB, _budget(mem_available=100 * GiB)),
                      ("a", 50 * GiB, _budget(mem_available=100 * GiB)),
                      ("b", 1 * GiB, _budget()))
    got = preflight.admit_node(0, shm=False, gather=gather)
    assert (got["nodes"], got["node"], got["node_ranks"]) == (2, "a", 2)
    assert got["node_staging_bytes"] == 100 * GiB and got["mem_available"] == 100 * GiB


def test_a_node_takes_the_tightest_figure_its_ranks_measured_and_unknown_is_no_limit():
    gather = _cluster(("a", 30 * GiB, _budget(mem_available=100 * GiB)),
                      ("a", 30 * GiB, _budget(mem_available=50 * GiB)))
    with pytest.raises(InsufficientHostMemory, match="leaves 50.00 GiB"):
        preflight.admit_node(0, shm=False, gather=gather)
    unknown = _cluster(("a", 30 * GiB, _budget(mem_available=-1)))
    assert preflight.admit_node(0, shm=False, gather=unknown)["mem_available"] == -1


def test_this_rank_sends_its_own_host_bytes_and_budget():
    sent = []
    preflight.admit_node(123, shm=False, gather=lambda mine: sent.append(mine) or [mine],
                         budget=preflight.HostBudget(1, 2 * GiB, 3), host="here")
    assert sent == [("here", 123, (1, 2 * GiB, 3), (0, 0), 0)]


def test_staging_a_restored_snapshot_holds_already_is_named_not_shown_as_nothing(caplog):
    """After a restore from memory the next saves stage into the adopted buffers: the node
    admits only what is new, and its line names what its ranks hold already, rather than
    reading "stages 0.00 GiB" as if nothing were staged."""
    caplog.set_level(logging.INFO, logger="megatron_ckpt_ext.preflight")
    roomy = preflight.HostBudget(100 * GiB, 100 * GiB, -1)
    got = preflight.admit_node(0, shm=True, budget=roomy, host="n", held=(0, 0), kept=3 * GiB,
                               gather=lambda mine: [mine, mine[:4]])  # a rank of an older form
    assert got["node_staging_bytes"] == 0 and got["node_kept_bytes"] == 3 * GiB
    assert "stages 0.00 GiB (0 bytes) more beside the 3.00 GiB" in caplog.text


def _reclaims(calls: list) -> callable:
    return lambda: calls.append("reclaim") or 3


def test_a_refusal_names_the_snapshots_that_ended_runs_left_in_the_nodes_shared_memory():
    """A node whose /dev/shm outlived a job: the sealed snapshots its ended runs left hold part of
    it; a node that does not fit even once they are freed is refused, saying how much they hold
    and how to free them (one node's ranks see one /dev/shm: the figure is the node's, not their
    sum), and nothing is freed; a node that fits is not refused for them."""
    held, calls = (3, 6 * GiB), []
    gather = _cluster(*[("n", 5 * GiB, _budget(shm_free=10 * GiB), held)] * 4)
    with pytest.raises(InsufficientSharedMemory) as e:
        preflight.admit_node(0, shm=True, gather=gather, reclaim=_reclaims(calls))
    msg = str(e.value)
    assert "/dev/shm has 10.00 GiB (10737418240 bytes) free (3 sealed snapshot(s) left by " \
           "runs that have ended hold 6.00 GiB" in msg, msg
    assert "shm list' shows whose, 'shm clean' frees them" in msg, msg
    assert calls == []
    fits = _cluster(*[("n", 2 * GiB, _budget(shm_free=10 * GiB), held)] * 4)
    got = preflight.admit_node(0, shm=True, gather=fits, reclaim=_reclaims(calls))
    assert got["node_staging_bytes"] == 8 * GiB and got["freed_snapshots"] == {} and calls == []
    none_held = _cluster(*[("n", 3 * GiB, _budget(shm_free=10 * GiB), (0, 0))] * 4)
    with pytest.raises(InsufficientSharedMemory) as e:
        preflight.admit_node(0, shm=True, gather=none_held, reclaim=_reclaims(calls))
    assert "sealed snapshot" not in str(e.value) and calls == []


def test_a_node_that_fits_once_the_ended_runs_snapshots_are_freed_frees_them_and_stages(caplog):
    """Their snapshots are a cache (a restart of those runs reads storage without them): a job
    whose staging fits only without them frees them on the short node's ranks, all ranks waiting
    (a second collective) before any stages, one rank-0 warning; a rank on a node that fits
    frees nothing; the memory limit still caps the node."""
    held = (3, 6 * GiB)
    sent: list = []

    def gather(mine):
        sent.append(mine)
        return [("a", 3 * GiB, _budget(shm_free=10 * GiB), held)] * 4 + [
            ("b", 1 * GiB, _budget(shm_free=10 * GiB), (0, 0))] if mine is not None else [None] * 5

    for host, expect in (("a", ["reclaim"]), ("b", [])):
        calls, sent[:] = [], []
        with caplog.at_level("WARNING", logger="megatron_ckpt_ext.preflight"):
            got = preflight.admit_node(3 * GiB, shm=True, gather=gather, host=host,
                                       budget=preflight.HostBudget(10 * GiB, 100 * GiB, -1),
                                       held=held, reclaim=_reclaims(calls))
        assert calls == expect and sent[-1] is None and len(sent) == 2
        assert got["freed_snapshots"] == {"a": 3} and got["node_staging_bytes"] == 12 * GiB
    assert "freed them" in caplog.text and "node a (3 snapshot(s), 6.00 GiB" in caplog.text
    calls = []
    capped = _cluster(*[("a", 3 * GiB, _budget(shm_free=10 * GiB), held)] * 4)
    with pytest.raises(InsufficientHostMemory):  # 11 GiB allowed: freeing would not help
        preflight.admit_node(0, shm=True, gather=capped, limit_bytes=11 * GiB,
                             reclaim=_reclaims(calls))
    assert calls == []


def test_the_node_memory_limit_lowers_the_measured_budget_and_the_refusal_names_it():
    """--ckpt-node-memory-limit-mib: a node that fits its measured figures is refused once the
    limit is below its staging (memory and /dev/shm alike), naming the flag; unset, the
    measured figures stand; a limit above them changes nothing."""
    gather = _cluster(*[("n", 3 * GiB, _budget(shm_free=64 * GiB))] * 4)  # 12 GiB of 100
    assert preflight.admit_node(0, shm=True, gather=gather)["mem_available"] == 100 * GiB
    with pytest.raises(InsufficientHostMemory) as e:
        preflight.admit_node(0, shm=True, gather=gather, limit_bytes=8 * GiB)
    msg = str(e.value)
    assert "leaves 8.00 GiB" in msg and "/dev/shm has 8.00 GiB" in msg, msg
    assert "--ckpt-node-memory-limit-mib 8192 caps" in msg and "raise --ckpt-node" in msg, msg
    sent = []
    got = preflight.admit_node(5, shm=True, gather=lambda mine: sent.append(mine) or [mine],
                               budget=preflight.HostBudget(-1, 50 * GiB, 3),
                               limit_bytes=10 * GiB, host="h", held=(0, 0))  # (not this node's)
    assert sent == [("h", 5, (-1, 50 * GiB, 3), (0, 0), 0)]  # measured; capped after the gather
    assert (got["shm_free"], got["mem_available"]) == (10 * GiB, 10 * GiB)  # unknown shm: limit
    assert got["limit_bytes"] == 10 * GiB
    roomy = preflight.admit_node(0, shm=True, gather=gather, limit_bytes=1000 * GiB)
    assert (roomy["mem_available"], roomy["shm_free"]) == (100 * GiB, 64 * GiB)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("one_rank_group")
def test_checkpointer_passes_the_node_memory_limit_to_admission(tmp_path):
    """The knob reaches the first save's admission: 4000 bytes staged, a 1 MiB limit admits
    them (and is reported); the same state with the limit below it is refused, naming it."""
    from megatron_ckpt_ext import Checkpointer, CkptOptions

    sharded_tensor = backend.sharded_tensor_cls()
    state = lambda n: {"w": sharded_tensor.from_rank_offsets("w", torch.ones(n))}  # noqa: E731
    opts = dict(async_save=True, async_ckpt_use_cpu_shm=True,
                ckpt_assume_constant_structure=True, ckpt_node_memory_limit_mib=1)
    with Checkpointer(CkptOptions(**opts)) as ck:
        ck.save(state(1000), tmp_path / "a", iteration=1)
        assert ck.admission["limit_bytes"] == 2**20
        assert ck.admission["mem_available"] <= 2**20
    with Checkpointer(CkptOptions(**opts)) as ck:
        with pytest.raises(InsufficientHostMemory, match="--ckpt-node-memory-limit-mib 1 caps"):
            ck.save(state(2**20), tmp_path / "b", iteration=1)  # 4 MiB


def test_host_budget_reads_meminfo_and_a_container_limit(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("0\n")
    b = preflight.host_budget(str(tmp_path), meminfo=str(tmp_path / "meminfo"), cgroup=str(cg))
    assert b.mem_available == 2048 * 1024 and b.shm_free > 0
    (cg / "memory.max").write_text("1500000\n")  # the container's limit is tighter
    (cg / "memory.current").write_text("500000\n")
    b = preflight.host_budget(str(tmp_path), meminfo=str(tmp_path / "meminfo"), cgroup=str(cg))
    assert b.mem_available == 1_000_000


def test_disk_warns_once_when_below_last_checkpoint(tmp_path, caplog):
    _runtime._reset_warnings_for_tests()
    tiny = lambda path: DiskUsage(10**9, 10**9 - 10**6, 10**6)
    with caplog.at_level("WARNING"):
        assert preflight.check_disk(tmp_path, 10**8, probe=tiny) is False
        assert preflight.check_disk(tmp_path, 10**8, probe=tiny) is False
    assert caplog.text.count("the last checkpoint took 0.09 GiB (100000000 bytes)") == 1
    assert preflight.check_disk(tmp_path, 10**5, probe=tiny) is True


def test_disk_probe_walks_up_to_an_existing_directory(tmp_path):
    asked = []
    preflight.check_disk(tmp_path / "not" / "yet", 1,
                         probe=lambda path: asked.append(path) or DiskUsage(10, 0, 10))
    assert asked == [str(tmp_path)]


@pytest.mark.timeout(120)
def test_checkpointer_fails_before_the_first_cpu_shm_save_when_shm_is_short(monkeypatch, tmp_path):
    """End to end in one process (no process group): the start of the first save raises."""
    from megatron_ckpt_ext import Checkpointer, CkptOptions

    from megatron_ckpt_ext.staging import retained

    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: DiskUsage(2**20, 2**20, 100))
    # a snapshot an ended run left in this machine's /dev/shm would be freed to make room
    monkeypatch.setattr(retained, "held_by_ended_runs", lambda *a, **k: (0, 0))
    sharded_tensor = backend.sharded_tensor_cls()
    opts = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                       ckpt_assume_constant_structure=True)
    with Checkpointer(opts) as ck:
        with pytest.raises(InsufficientSharedMemory,
                           match=r"stage .* \(4000 bytes\) .* /dev/shm has .* \(100 bytes\) free"):
            ck.save({"w": sharded_tensor.from_rank_offsets("w", torch.ones(1000))}, tmp_path,
                    iteration=1)


def test_the_disk_full_estimate_is_the_whole_checkpoint_on_disk(tmp_path):
    """A failed save's hint and the pre-save warning count every rank's files of the latest
    committed checkpoint, not the bytes one rank staged."""
    _runtime._reset_warnings_for_tests()
    latest = tmp_path / "iter_0000004"
    latest.mkdir()
    for name, size in (("__0_0.distcp", 3000), ("__1_0.distcp", 3000), (".metadata", 900),
                       ("common.pt", 100)):
        (latest / name).write_bytes(b"x" * size)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4\n")
    disk = lambda path: DiskUsage(10**9, 10**9 - 5000, 5000)  # noqa: E731
    hint = preflight.disk_full_hint(tmp_path, 3000, probe=disk)  # one rank's bytes fit
    assert "a checkpoint here takes about 0.00 GiB (7000 bytes)" in hint, hint
    assert preflight.check_disk(tmp_path, 3000, probe=disk) is False


def test_under_a_constant_structure_the_size_on_disk_is_not_walked_again(tmp_path, monkeypatch):
    def commit(iteration: int, size: int) -> None:
        folder = tmp_path / f"iter_{iteration:07d}"
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x" * size)
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")

    commit(1, 1000)
    assert preflight.checkpoint_bytes_on_disk(tmp_path) == 1000
    commit(2, 1500)
    walks: list = []
    real_rglob = type(tmp_path).rglob
    monkeypatch.setattr(type(tmp_path), "rglob", lambda self, p: walks.append(self) or real_rglob(self, p))
    assert preflight.checkpoint_bytes_on_disk(tmp_path, remeasure=False) == 1000 and walks == []
    assert preflight.checkpoint_bytes_on_disk(tmp_path) == 1500 and len(walks) == 1


def test_a_save_directory_that_is_a_file_is_named_as_such(tmp_path):
    from megatron_ckpt_ext.errors import CkptOptionsError

    blocker = tmp_path / "ckpt"
    blocker.write_text("")
    for target, culprit in ((blocker, "it"), (blocker / "sub", str(blocker))):
        with pytest.raises(CkptOptionsError) as e:
            preflight.check_writable(target)
        assert f"--save {target}: {culprit} is a file, not a directory. Fix:" in str(e.value)


def test_held_by_ended_runs_counts_the_seals_whose_sealing_process_has_ended(tmp_path):
    """What the refusal names: a seal written by a process that has ended (or on another host)
    counts with the bytes its segments hold in /dev/shm; a live process's seal does not."""
    import json
    import subprocess

    import fcntl
    import os

    from megatron_ckpt_ext.staging.retained import (Seal, SealEntry, held_by_ended_runs,
                                                    reclaim_ended_runs, write_seal)
    from megatron_ckpt_ext.staging.segments import is_mapped

    ended = subprocess.Popen(["true"])
    ended.wait()

    def seal(name: str, nbytes: int, pid: int | None = None, host: str | None = None) -> None:
        path = tmp_path / f"mcxseg_{name}"
        path.write_bytes(b"x" * nbytes)
        entry = SealEntry(key=name, offset=[0], shape=[nbytes], dtype="torch.uint8", spec=name,
                          path=str(path), nbytes=nbytes)
        file = write_seal(Seal(root=f"/ckpt/{name}", rank=0, world=1, iteration=1,
                               manifest_crc32=None, entries=[entry]), str(tmp_path))
        data = json.loads(open(file).read())
        data.update({k: v for k, v in (("pid", pid), ("host", host)) if v is not None})
        open(file, "w").write(json.dumps(data))

    seal("live", 1 << 20)  # this process's
    assert held_by_ended_runs(str(tmp_path)) == (0, 0)
    seal("dead", 3 << 20, pid=ended.pid)
    seal("elsewhere", 2 << 20, host="another-host")
    count, held = held_by_ended_runs(str(tmp_path))
    assert count == 2 and held >= 5 << 20 and held < 6 << 20, (count, held)
    # what admission frees when a job does not fit beside them: those, and not one a live
    # process maps (its flock), whoever sealed it
    seal("mapped", 1 << 20, pid=ended.pid)
    fd = os.open(tmp_path / "mcxseg_mapped", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert held_by_ended_runs(str(tmp_path))[0] == 3  # all three have ended
        assert held_by_ended_runs(str(tmp_path), is_mapped=is_mapped) == (2, held)  # not mapped
        assert reclaim_ended_runs(str(tmp_path), is_mapped=is_mapped) == 2
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("mcxseg_")) == [
        "mcxseg_live", "mcxseg_mapped"]
    assert held_by_ended_runs(str(tmp_path))[0] == 1  # the mapped one, left to its user


def test_another_users_ended_snapshot_is_neither_counted_as_freeable_nor_touched(tmp_path,
                                                                                 monkeypatch):
    """On a node shared by users (/dev/shm is sticky: a user removes only their own files), a
    job does not plan on freeing another user's snapshots nor fail trying: admission's freeable
    figure leaves them out, reclaiming and ``shm clean`` leave them; a removal refused anyway
    is skipped, not raised."""
    import os
    import subprocess

    from megatron_ckpt_ext.staging import retained
    from megatron_ckpt_ext.staging.retained import (Seal, SealEntry, clean, held_by_ended_runs,
                                                    reclaim_ended_runs, write_seal)

    ended = subprocess.Popen(["true"])
    ended.wait()

    def seal(name: str, uid: int) -> str:
        path = tmp_path / f"mcxseg_{name}"
        path.write_bytes(b"x" * 8192)
        entry = SealEntry(key=name, offset=[0], shape=[8192], dtype="torch.uint8", spec=name,
                          path=str(path), nbytes=8192)
        file = write_seal(Seal(root=f"/ckpt/{name}", rank=0, world=1, iteration=1,
                               manifest_crc32=None, entries=[entry]), str(tmp_path))
        text = open(file).read().replace(f'"pid": {os.getpid()}', f'"pid": {ended.pid}')
        open(file, "w").write(text)
        for p in (file, path):
            os.chown(p, uid, uid)
        return file

    me = 4242
    monkeypatch.setattr(retained.os, "geteuid", lambda: me)
    mine, theirs = seal("mine", me), seal("theirs", me + 1)
    not_mapped = lambda path: False  # noqa: E731
    assert held_by_ended_runs(str(tmp_path))[0] == 2  # both named in a refusal
    assert held_by_ended_runs(str(tmp_path), is_mapped=not_mapped)[0] == 1  # only mine freeable
    assert reclaim_ended_runs(str(tmp_path), is_mapped=not_mapped) == 1
    assert not os.path.exists(mine) and os.path.exists(theirs)
    assert clean(str(tmp_path), is_mapped=not_mapped) == ([], [], [])
    assert os.path.exists(theirs) and (tmp_path / "mcxseg_theirs").exists()
    real_unlink = os.unlink

    def refused(path, *a, **k):  # the kernel's answer for another user's file in /dev/shm
        if str(path) in (theirs, str(tmp_path / "mcxseg_theirs")):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(retained.os, "unlink", refused)
    monkeypatch.setattr(retained.os, "geteuid", lambda: 0)  # (root may; the kernel refuses)
    assert retained.discard(retained.read_seal(theirs), is_mapped=not_mapped) == []
    assert os.path.exists(theirs)


def test_another_users_snapshot_is_left_by_the_kernel_and_by_us(request_cleanup):
    """The same with real users: a directory like /dev/shm (sticky, world-writable), a
    snapshot left there by user A's ended run; user B's node admission counts none of it as
    freeable and freeing leaves it (the kernel would refuse: EPERM), without an error; user A
    frees it. Forked children take the two uids (needs root)."""
    import os
    import subprocess

    from megatron_ckpt_ext.staging.retained import (Seal, SealEntry, held_by_ended_runs,
                                                    reclaim_ended_runs, write_seal)
    from megatron_ckpt_ext.staging.segments import is_mapped

    if os.geteuid() != 0:
        pytest.skip("switching users needs root")
    import shutil
    import tempfile

    shm = Path(tempfile.mkdtemp(prefix="mcxtest_users_", dir="/dev/shm"))  # every user reaches it
    os.chmod(shm, 0o1777)
    request_cleanup.append(lambda: shutil.rmtree(shm, ignore_errors=True))
    ended = subprocess.Popen(["true"])
    ended.wait()

    def as_user(uid: int, fn) -> object:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: another user
            try:
                os.setgid(uid)
                os.setuid(uid)
                out = repr(fn())
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = f"error {type(e).__name__}: {e}"
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as fh:
            return fh.read()

    def leave_a_snapshot():
        path = shm / "mcxseg_a"
        path.write_bytes(b"x" * 8192)
        entry = SealEntry(key="w", offset=[0], shape=[8192], dtype="torch.uint8", spec="w",
                          path=str(path), nbytes=8192)
        seal = Seal(root="/ckpt/a", rank=0, world=1, iteration=1, manifest_crc32=None,
                    entries=[entry])
        file = write_seal(seal, str(shm))
        text = open(file).read().replace(f'"pid": {os.getpid()}', f'"pid": {ended.pid}')
        open(file, "w").write(text)
        return file

    user_a, user_b = 54321, 54322
    seal_file = as_user(user_a, leave_a_snapshot).strip("'")
    assert os.stat(seal_file).st_uid == user_a
    b_sees = as_user(user_b, lambda: (held_by_ended_runs(str(shm)),
                                      held_by_ended_runs(str(shm), is_mapped=is_mapped),
                                      reclaim_ended_runs(str(shm), is_mapped=is_mapped)))
    assert b_sees == "((1, 8192), (0, 0), 0)", b_sees
    assert os.path.exists(seal_file) and (shm / "mcxseg_a").exists()
    a_frees = as_user(user_a, lambda: reclaim_ended_runs(str(shm), is_mapped=is_mapped))
    assert a_frees == "1", a_frees
    assert sorted(os.listdir(shm)) == []


@pytest.fixture
def request_cleanup():
    done: list = []
    yield done
    for fn in done:
        fn()
