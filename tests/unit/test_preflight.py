"""Preflight: /dev/shm shortfall fails at start-up naming needed, available and the fix; a disk
with less room than the last checkpoint warns once; the checkpointer runs the check first."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_ext import _runtime, backend, preflight
from megatron_ckpt_ext.errors import InsufficientSharedMemory
from megatron_ckpt_ext.preflight import DiskUsage

SMALL_SHM = DiskUsage(2**30, 2**30 - 2**28, 2**28)  # 256 MiB free


def test_shm_shortfall_names_needed_available_and_fix():
    with pytest.raises(InsufficientSharedMemory) as e:
        preflight.check_shm(2**28, 4, probe=lambda path: SMALL_SHM)
    msg = str(e.value)
    assert "needs 1.00 GiB (1073741824 bytes)" in msg
    assert "0.25 GiB (268435456 bytes) is free" in msg
    assert "x 4 ranks on this node" in msg and "in /dev/shm" in msg
    assert "--shm-size" in msg and "drop --async-ckpt-use-cpu-shm" in msg


def test_shm_that_fits_all_local_ranks_passes():
    preflight.check_shm(2**26, 4, probe=lambda path: SMALL_SHM)  # exactly 256 MiB needed


def test_shm_ranks_default_to_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(InsufficientSharedMemory, match="x 8 ranks"):
        preflight.check_shm(2**26, probe=lambda path: SMALL_SHM)  # 8 x 64 MiB > 256 MiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "garbage")
    assert preflight.local_ranks() == 1


def test_shm_probe_is_asked_about_the_given_path():
    asked = []
    preflight.check_shm(1, 1, path="/somewhere/shm",
                        probe=lambda path: asked.append(path) or SMALL_SHM)
    assert asked == ["/somewhere/shm"]


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

    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: DiskUsage(2**20, 2**20, 100))
    sharded_tensor = backend.sharded_tensor_cls()
    opts = CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                       ckpt_assume_constant_structure=True)
    with Checkpointer(opts) as ck:
        with pytest.raises(InsufficientSharedMemory,
                           match=r"needs .* \(4000 bytes\) .* \(100 bytes\) is free"):
            ck.save({"w": sharded_tensor.from_rank_offsets("w", torch.ones(1000))}, tmp_path,
                    iteration=1)
