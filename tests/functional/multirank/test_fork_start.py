"""A forked writer that never starts (CPython 3.11 can leave a fork blocked in its after-fork
start when another thread held the interpreter's thread-state lock; CI saw a 2-rank save hang on
it) is noticed within the start timeout: a temporal writer is forked again and the save commits;
a persistent worker with nothing but its start-up request is replaced and the save commits; one
that already holds a save (started after an abandoned save) is stopped and every rank raises,
and the next save commits. Nothing waits for --ckpt-timeout.

What makes such a fork: a torch.distributed worker thread creating a Python thread state (to free
a collective's tensor) at the instant of the fork; our forks wait until those threads are idle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ckpt_ext import manifest
from tests._support.dist import run_ranks, world

from . import _fork_start_workers as fw


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["temporal", "persistent-shm", "persistent-shm-abandoned"])
def test_a_writer_stuck_in_its_fork_is_restarted_or_reported_never_waited_for(tmp_path, mode):
    marker = tmp_path / "stuck_pid"
    root = tmp_path / "ckpt"
    stuck_rank = world() - 1
    run_ranks(fw.stuck_writer_fork, timeout=90,
              args=(str(root), mode, stuck_rank, str(marker)))
    assert marker.exists(), "the stuck fork was never made: the test checked nothing"
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state_of(pid), f"pid {pid} leaked"
    assert manifest.MANIFEST in os.listdir(root / "iter_0000001")


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_a_fork_of_ours_waits_until_torch_worker_threads_are_idle():
    """A thread named as torch.distributed's workers, running outside the GIL (a long hash, as a
    gloo worker freeing a collective's tensors runs): a fork inside forks_die_with_this_process
    goes ahead only once it is idle. Seen by a before-fork hook registered first, so it runs
    after the plugin's, at the fork; in a fresh interpreter, where that order is known."""
    out = subprocess.run([sys.executable, "-c", _FORK_PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "worker busy at the fork: [False]" in out.stdout, out.stdout + out.stderr[-2000:]


_FORK_PROBE = """
import ctypes, hashlib, os, threading, time
from megatron_ckpt_ext import _runtime
_runtime.FORK_QUIET_BOUND_S = 60.0  # the hash below must end within the wait, however loaded
at_fork = []
os.register_at_fork(before=lambda: at_fork.append(_runtime._torch_workers_busy()))
def work():
    ctypes.CDLL(None).prctl(15, b"pt_test_worker", 0, 0, 0)  # PR_SET_NAME, as torch names
    hashlib.sha256(bytes(64 << 20)).digest()  # tens of ms or more without the GIL: running
worker = threading.Thread(target=work)
worker.start()
deadline = time.monotonic() + 60
while not _runtime._torch_workers_busy():  # seen running while this thread holds the GIL
    assert worker.is_alive() and time.monotonic() < deadline, "the worker never ran"
with _runtime.forks_die_with_this_process():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
os.waitpid(pid, 0)
worker.join()
print("worker busy at the fork:", at_fork)
"""
