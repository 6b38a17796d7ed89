"""A forked writer that never starts (CPython 3.11 can leave a fork blocked in its after-fork
start when another thread held the interpreter's thread-state lock; CI saw a 2-rank save hang on
it) is noticed within the start timeout: a temporal writer is forked again and the save commits;
a persistent worker with nothing but its start-up request is replaced and the save commits; one
that already holds a save (started after an abandoned save) is stopped and every rank raises,
and the next save commits. Nothing waits for --ckpt-timeout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_ckpt_ext import manifest
from tools._dist import run_ranks, world

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
