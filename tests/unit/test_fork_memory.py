"""The trainer's CPU tensors kept out of the persistent writer's fork (save/fork_memory.py): a
forked writer holds no stale copy of a CPU tensor the trainer updates in place, and every later
fork (a data loader's workers) inherits the tensors as before."""

from __future__ import annotations

import faulthandler
import os
import signal

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend
from megatron_ckpt_ext.save import fork_memory
from tests._support.dist import sharded

MIB = 1 << 20


def _child_reads(t: torch.Tensor) -> int:
    """Fork; the child reads the middle of ``t`` and exits 0. The child's wait status."""
    pid = os.fork()
    if pid == 0:
        faulthandler.disable()  # the expected SIGSEGV: no "Fatal Python error" dump in the log
        try:
            os._exit(0 if float(t[t.numel() // 2]) == float(t[t.numel() // 2]) else 3)
        finally:
            os._exit(4)
    return os.waitpid(pid, 0)[1]


def test_the_regions_are_the_pages_inside_large_private_cpu_storages():
    big, small = torch.ones(4 * MIB // 4), torch.ones(1024)
    shared = torch.ones(4 * MIB // 4).share_memory_()
    regions = dict(fork_memory.tensor_regions())
    ptr, page = big.untyped_storage().data_ptr(), os.sysconf("SC_PAGE_SIZE")
    start = -(-ptr // page) * page
    assert regions.get(start) == (ptr + 4 * MIB) // page * page - start
    assert all(not (s <= small.data_ptr() < s + n) for s, n in regions.items())
    assert all(not (s <= shared.data_ptr() < s + n) for s, n in regions.items())


def test_a_fork_inside_does_not_inherit_the_tensor_and_one_after_does():
    t = torch.arange(8 * MIB // 4, dtype=torch.float32)
    with fork_memory.kept_from_fork() as info:
        assert info["bytes"] >= 8 * MIB - 2 * os.sysconf("SC_PAGE_SIZE")
        status = _child_reads(t)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS)
    status = _child_reads(t)  # the marks are off again: a data loader's fork reads its tensors
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("MCX_FORK_SKIPS_TENSORS", "0")
    t = torch.ones(4 * MIB // 4)
    with fork_memory.kept_from_fork() as info:
        assert info["bytes"] == 0
        assert os.WIFEXITED(_child_reads(t))


def _private_dirty(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        return sum(int(line.split()[1]) * 1024 for line in fh if line.startswith("Private_Dirty:"))


@pytest.mark.usefixtures("one_rank_group")
def test_the_writer_keeps_no_copy_of_a_cpu_state_the_trainer_updates(tmp_path):
    """256 MiB of CPU state, every page updated in place after the writer was forked: the
    writer's own (private) memory grows by far less than that across the next save (it grew by
    all of it before: 548 MB of a 0.54 GB state)."""
    state = {f"t{i}": torch.zeros(32 * MIB // 4) for i in range(8)}
    options = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                          use_persistent_ckpt_worker=True, ckpt_assume_constant_structure=True)
    with Checkpointer(options) as ck:
        skipped = ck.startup.get("fork_skipped_tensor_bytes", 0)
        if not skipped:
            pytest.skip("the persistent writer is not forked on this backend")
        assert skipped >= 250 * MIB
        writer = backend.newest_writer_pid(ck._writers.queue)
        assert writer is not None
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)  # the writer's own memory settles
        ck.maybe_finalize(blocking=True)
        before = _private_dirty(writer)
        for t in state.values():
            t.add_(1.0)  # every page of the state written by the trainer
        ck.save(sharded(0, 1, state), tmp_path, iteration=2)
        ck.maybe_finalize(blocking=True)
        assert _private_dirty(writer) - before < 96 * MIB
        loaded = ck.load(sharded(0, 1, {k: torch.empty_like(v) for k, v in state.items()}),
                         tmp_path, iteration=2)
        assert all(torch.equal(loaded[k], torch.ones_like(v)) for k, v in state.items())
