"""Rank bodies for test_admission.py (spawned ranks import them by module path)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, preflight
from megatron_ckpt_ext.errors import InsufficientHostMemory


def _owned(tensors: dict[str, torch.Tensor]) -> dict:
    """Each key wholly this rank's (pipeline stages hold different layers)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}

MODES = {"temporal": {"async_save": True},
         "persistent-shm": {"async_save": True, "use_persistent_ckpt_worker": True,
                            "async_ckpt_use_cpu_shm": True}}


def _state(rank: int) -> dict[str, torch.Tensor]:
    # uneven ranks, as pipeline stages are: rank r stages (r + 1) x 64 KiB of its own layer
    return {f"layer{rank}": torch.full((16384 * (rank + 1),), float(rank))}


def staging_bytes(world: int) -> int:
    return sum(t.numel() * 4 for r in range(world) for t in _state(r).values())


def admit(rank: int, world: int, root: str, mode: str, mem_available: int,
          fallback: str = "none") -> None:
    """Every rank measures a node of ``mem_available`` bytes (its host_budget patched); both
    ranks are on this host. Over budget: every rank raises at its first save, before writing
    (``fallback`` "sync": the saves commit synchronously instead); else the save commits and
    the admission names the node-wide sum."""
    preflight.host_budget = lambda *a, **k: preflight.HostBudget(2**40, mem_available, -1)
    options = CkptOptions(**MODES[mode], ckpt_node_memory_fallback=fallback)
    with Checkpointer(options) as ck:
        if fallback == "sync":
            for iteration in (1, 2):  # the first save falls back, the next stays synchronous
                ck.save(_owned(_state(rank)), root, iteration=iteration)
                ck.maybe_finalize(blocking=True)
                assert ck.reports[-1]["mode"] == "sync", ck.reports[-1]
            assert ck.admission["fallback"] == "sync", ck.admission
            assert "MemAvailable" in ck.admission["why"], ck.admission
            assert ck.idle and len(ck.reports) == 2
            like = {k: torch.zeros_like(v) for k, v in _state(rank).items()}
            got = ck.load(_owned(like), root, iteration=2)
            assert all(torch.equal(got[k], v) for k, v in _state(rank).items())
            return
        try:
            ck.save(_owned(_state(rank)), root, iteration=1)
            ck.maybe_finalize(blocking=True)
        except InsufficientHostMemory as e:
            need = staging_bytes(world)
            assert need > mem_available, f"rank {rank}: refused {need} <= {mem_available}: {e}"
            assert f"stage {need / 2**30:.2f} GiB ({need} bytes)" in str(e), str(e)
            assert not (Path(root) / "iter_0000001").exists()
            return
        assert ck.admission["node_staging_bytes"] == staging_bytes(world), ck.admission
        assert ck.admission["node_ranks"] == world and ck.admission["nodes"] == 1
        assert staging_bytes(world) <= mem_available
        like = {k: torch.zeros_like(v) for k, v in _state(rank).items()}
        got = ck.load(_owned(like), root, iteration=1)
        assert all(torch.equal(got[k], v) for k, v in _state(rank).items())


def seal_and_end(rank: int, world: int, root: str) -> None:
    """A run that saves, waits for its node's seal and ends keeping it (as a job killed after a
    commit leaves it: the sealing process gone, the snapshot in /dev/shm)."""
    import time

    from megatron_ckpt_ext.staging.retained import read_seal, seal_path

    options = CkptOptions(**MODES["persistent-shm"], ckpt_keep_memory_snapshot=True)
    with Checkpointer(options) as ck:
        ck.save(_owned(_state(rank)), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        deadline = time.monotonic() + 60
        while getattr(read_seal(seal_path("/dev/shm", root, rank)), "iteration", None) != 1:
            assert time.monotonic() < deadline, f"rank {rank}: no seal after the commit"
            time.sleep(0.02)


def admit_beside_ended_snapshots(rank: int, world: int, root: str, short_by: int) -> None:
    """A job whose node has ``short_by`` bytes too little /dev/shm for its staging unless the
    snapshots ended runs left there are freed: it frees them and saves."""
    need = staging_bytes(world)
    preflight.host_budget = lambda *a, **k: preflight.HostBudget(need - short_by, 2**40, -1)
    with Checkpointer(CkptOptions(**MODES["persistent-shm"])) as ck:
        ck.save(_owned(_state(rank)), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        assert ck.admission["freed_snapshots"], ck.admission
        like = {k: torch.zeros_like(v) for k, v in _state(rank).items()}
        got = ck.load(_owned(like), root, iteration=1)
        assert all(torch.equal(got[k], v) for k, v in _state(rank).items())
