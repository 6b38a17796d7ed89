"""A sealed snapshot another live process maps is "in use": never adopted by another job (the
memory tier) nor freed by it. Who maps a segment is told by its shared flock; a dead sealer's
writer, killed with it, gets a short time to let go before the snapshot counts as in use."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_ckpt_ext.staging.retained import Seal, SealEntry
from megatron_ckpt_ext.staging.sealing import mapped_elsewhere

pytestmark = pytest.mark.timeout(60)

_HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); "
         "time.sleep(float(sys.argv[2]))")


def _holder(path: str, seconds: float) -> subprocess.Popen:
    """A process that maps (flocks) ``path`` for ``seconds``, as a writer holds a segment."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path, str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _seal(tmp_path, pid: int) -> Seal:
    path = tmp_path / "mcx_segment"
    path.write_bytes(b"\0" * 4096)
    import socket

    return Seal(root="/ckpt", rank=0, world=1, iteration=1, manifest_crc32=None,
                entries=[SealEntry(key="w", offset=[0], shape=[4096], dtype="torch.uint8",
                                   spec="w", path=str(path), nbytes=4096)],
                host=socket.gethostname(), pid=pid)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_running_sealers_snapshot_is_in_use_at_once(tmp_path):
    seal = _seal(tmp_path, pid=0)
    holder = _holder(seal.entries[0].path, 30)
    try:
        seal.pid = holder.pid  # the job that sealed it still runs (and maps it)
        t = time.monotonic()
        assert mapped_elsewhere(seal, settle_s=5.0)
        assert time.monotonic() - t < 1.0  # no wait for a live job
        seal.pid = os.getpid()  # a seal of this process is its own (an in-process restart)
        assert not mapped_elsewhere(seal, settle_s=5.0)
    finally:
        holder.kill()
        holder.wait()
    seal.pid = _dead_pid()
    assert not mapped_elsewhere(seal, settle_s=0.0)  # nobody maps it: not in use


def test_a_dead_sealers_lingering_writer_is_waited_for_then_counts(tmp_path):
    seal = _seal(tmp_path, pid=_dead_pid())
    holder = _holder(seal.entries[0].path, 0.4)  # its writer, dying
    try:
        t = time.monotonic()
        assert not mapped_elsewhere(seal, settle_s=5.0)
        assert time.monotonic() - t >= 0.1  # waited for it to let go
    finally:
        holder.wait()
    holder = _holder(seal.entries[0].path, 30)  # one that does not let go
    try:
        t = time.monotonic()
        assert mapped_elsewhere(seal, settle_s=0.5)
        assert 0.4 <= time.monotonic() - t < 3.0
    finally:
        holder.kill()
        holder.wait()
