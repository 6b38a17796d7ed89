"""SIGTERM to the whole process group while the first save's staging is being prepared (its
pages faulted in on several threads, then pinned): a trainer whose handler exits (as Megatron's
and ours do, through ``sys.exit``) leaves at once instead of waiting for the rest of the
fault-in, and the segments it leaves are swept at the next start on the node. CUDA's register
call is stood in for; each fault-in takes 2 s, so the whole preparation would take ~4 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_ckpt_ext.staging.segments import sweep_orphans

ROOT = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent('''
    import sys, signal, time, torch
    from megatron_ckpt_ext import _threads
    from megatron_ckpt_ext.staging import segments
    from megatron_ckpt_ext.staging.shm import ShmStager

    class Cudart:
        @staticmethod
        def cudaHostRegister(ptr, nbytes, flags): return 0
        @staticmethod
        def cudaHostUnregister(ptr): return 0

    torch.cuda.cudart = lambda: Cudart
    _threads.cores_per_local_rank = lambda: 4
    real = segments.populate

    def slow(address, nbytes, *, write=False):
        time.sleep(2.0)
        return real(address, nbytes, write=write)

    segments.populate = slow
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stager = ShmStager(job_id="sig", rank=0, reuse=True, pin=True, shm_dir=sys.argv[1],
                       sweep=False)
    stager.prepare([torch.zeros(1 << 18) for _ in range(8)], keys=[f"t{i}" for i in range(8)],
                   background=True)
    print("preparing", flush=True)
    time.sleep(60)
''')


@pytest.mark.timeout(60)
def test_sigterm_to_the_group_during_the_fault_in_exits_at_once_and_the_sweep_cleans(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(shm)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "preparing"
        time.sleep(0.5)  # inside the first fault-ins
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # every process of the job, as SLURM sends it
        rc = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143 and took < 2.0, (rc, took)  # not the ~3.5 s the fault-in had left
    left = sorted(os.listdir(shm))
    assert left, "the preparation had made no segment yet"
    assert sorted(os.path.basename(p) for p in sweep_orphans(shm_dir=str(shm))) == left
    assert not os.listdir(shm)
