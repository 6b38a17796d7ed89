"""``python -m megatron_ckpt_ext shm list``: for each sealed snapshot the node holds, whose it is
(save root, iteration, rank layout, the sealing process and host), how large and how old, how
many of its segments are there, and whether a running job maps it; then the totals. And the
sweep's age bound: a snapshot older than MAX_AGE_S no longer protects its segments."""

from __future__ import annotations

import gc
import os
import re
import socket

import torch

from megatron_ckpt_ext import shm_cli
from megatron_ckpt_ext.staging.retained import read_seal, seal_path
from megatron_ckpt_ext.staging.shm import ShmStager


def _seal(tmp_path, root) -> None:
    """A snapshot of iteration 3 (1.25 M float32 + 300 bfloat16: 5.0 MB), sealed and left by a
    stager closed for a planned restart (its segments unmapped, the seal kept)."""
    stager = ShmStager(job_id="lister", rank=1, reuse=True, pin=False, shm_dir=str(tmp_path),
                       sweep=False)
    state = [torch.arange(1_250_000, dtype=torch.float32), torch.ones(300, dtype=torch.bfloat16)]
    batch = stager.stage(state, keys=["w", "b"])
    layout = [("w", [0], [1_250_000], "torch.float32"), ("b", [0], [300], "torch.bfloat16")]
    stager.seal(batch, root=str(root), iteration=3, world=2, layout=layout, manifest_crc32="1")
    stager._seal_thread.join()
    del batch
    stager.close(keep_sealed=True)
    gc.collect()


def test_shm_list_names_owner_size_age_segments_and_use(tmp_path, capsys):
    root = tmp_path / "ckpt"
    _seal(tmp_path, root)
    assert shm_cli.run("list", shm_dir=str(tmp_path)) == 0
    line, total = capsys.readouterr().out.splitlines()[:2]
    want = (rf"^{re.escape(os.path.realpath(root))}  iteration 3  rank 1/2  5\.0 MB  age \d+ s  "
            rf"sealed by pid {os.getpid()} on {re.escape(socket.gethostname())}  segments 2/2$")
    assert re.match(want, line), line
    assert total.startswith("1 sealed snapshot(s), 5.0 MB; 0 other segment(s) of ours"), total

    seal = read_seal(seal_path(str(tmp_path), root, 1))
    os.unlink(seal.entries[1].path)  # a segment lost (a /dev/shm cleaned by hand)
    other = ShmStager(job_id="reader", rank=1, reuse=True, pin=False, shm_dir=str(tmp_path),
                      sweep=False)
    held = other._map(seal.entries[0])  # a running job maps the other one
    shm_cli.run("list", shm_dir=str(tmp_path))
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("segments 1/2  in use (a running job maps it)"), line
    del held
    other.close()


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _seal_of_dead_run(shm_dir: str, root: str, rank: int, pid: int, *, age_s: float,
                      monkeypatch) -> list[str]:
    """A snapshot of a run that has ended (its segments named after ``pid``, gone), sealed
    ``age_s`` ago; its segment paths."""
    import time
    import zlib

    from megatron_ckpt_ext.staging import retained
    from megatron_ckpt_ext.staging.retained import Seal, SealEntry, write_seal
    from megatron_ckpt_ext.staging.segments import SEGMENT_PREFIX

    entries, paths = [], []
    for i in range(2):
        path = os.path.join(shm_dir, f"{SEGMENT_PREFIX}old_{rank}_{pid}_{i}")
        data = os.urandom(4096)
        with open(path, "wb") as fh:
            fh.write(data)
        paths.append(path)
        entries.append(SealEntry(key=f"t{i}", offset=[0], shape=[4096], dtype="torch.uint8",
                                 spec=f"t{i}", path=path, nbytes=4096, crc32=zlib.crc32(data)))
    then = time.time() - age_s
    with monkeypatch.context() as m:
        m.setattr(retained.time, "time", lambda: then)
        write_seal(Seal(root=root, rank=rank, world=2, iteration=5, manifest_crc32="1",
                        entries=entries), shm_dir)
    return paths


def test_the_start_up_sweep_frees_a_snapshot_older_than_the_age_bound(tmp_path, monkeypatch):
    """A node whose /dev/shm outlives its jobs: a sealed snapshot protects its segments from the
    sweep for MAX_AGE_S; an older one is swept with its seal, a younger one stays."""
    from megatron_ckpt_ext.staging import sweep_orphans
    from megatron_ckpt_ext.staging.retained import MAX_AGE_S, list_seals

    pid, shm = _dead_pid(), str(tmp_path)
    old = _seal_of_dead_run(shm, "/ckpt/a", 0, pid, age_s=MAX_AGE_S + 60, monkeypatch=monkeypatch)
    young = _seal_of_dead_run(shm, "/ckpt/b", 1, pid, age_s=MAX_AGE_S - 60,
                              monkeypatch=monkeypatch)
    assert len(list_seals(shm)) == 2
    removed = sweep_orphans(shm_dir=shm)
    assert sorted(removed) == sorted(old)
    assert [s.root for s in list_seals(shm)] == ["/ckpt/b"]
    assert all(os.path.exists(p) for p in young) and not any(os.path.exists(p) for p in old)
