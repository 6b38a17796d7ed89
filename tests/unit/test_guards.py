"""Guards for behaviours a one-line slip would break silently (the suite stayed green with each):
the verification's split of the files over the ranks, the manifest's iteration checked against
its directory's, the CRC chained over a file's reads, the structure key's dtypes, retention's
count of committed directories only, and the admission's own measurement of /dev/shm. Each test
names the slip it catches."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ckpt_ext import manifest, preflight
from megatron_ckpt_ext.errors import InsufficientSharedMemory
from megatron_ckpt_ext.load import verify
from megatron_ckpt_ext.save import retention
from megatron_ckpt_ext.save.layout import TRACKER
from megatron_ckpt_ext.save.planner import SavePlanner, structure_key


class _Group:
    """Rank ``r`` of ``n`` as the verification asks a process group (no collective used)."""

    def __init__(self, r: int, n: int) -> None:
        self._r, self._n = r, n

    def rank(self, global_rank: int) -> int:
        return self._r

    def size(self) -> int:
        return self._n


def _checkpoint(root: Path, iteration: int, files: int, *, manifest_for: int | None = None) -> Path:
    """``root/iter_N`` holding ``files`` small data files and a manifest (for ``manifest_for``,
    default the directory's own iteration)."""
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    for i in range(files):
        (path / f"__{i}_0.distcp").write_bytes(bytes([i % 256]) * (100 + i))
    manifest.write_manifest(path, iteration if manifest_for is None else manifest_for)
    return path


# -- the verification's split over the ranks ----------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_file_is_verified_by_exactly_one_rank(tmp_path, monkeypatch, world):
    """The ranks' shares cover the manifest's files exactly once (a split such as
    ``names[rank::world + 1]`` or an off-by-one leaves files that nobody checks)."""
    path = _checkpoint(tmp_path, 1, files=11)
    asked: list[list[str]] = []
    monkeypatch.setattr(verify, "verify_files",
                        lambda p, m, names, **kw: asked.append(list(names)) or [])
    for r in range(world):
        assert verify.start(path, _Group(r, world), rank=r, workers=1).problems() == []
    every = sorted(manifest.read_manifest(path)["files"])
    assert len(asked) == world
    assert sorted(n for share in asked for n in share) == every, asked
    assert max(map(len, asked)) - min(map(len, asked)) <= 1, asked  # an even split


# -- the manifest's iteration --------------------------------------------------------------------
def test_a_manifest_copied_from_another_iteration_is_refused(tmp_path, capsys):
    """iter_2 holding iter_1's manifest (every CRC matching: the same bytes) is refused by the
    load's check and by ``verify``; its own manifest passes both."""
    from megatron_ckpt_ext import verify_cli

    copied = _checkpoint(tmp_path, 2, files=3, manifest_for=1)
    problems = verify.start(copied, _Group(0, 1), rank=0, workers=1).problems()
    assert any("written for iteration 1, not 2" in p for p in problems), problems
    assert verify_cli.run(str(copied)) == 1
    assert "written for iteration 1, not 2" in capsys.readouterr().out
    own = _checkpoint(tmp_path / "b", 2, files=3)
    assert verify.start(own, _Group(0, 1), rank=0, workers=1).problems() == []
    assert verify_cli.run(str(own)) == 0


# -- the CRC chained over a file's reads ---------------------------------------------------------
def test_a_flip_in_an_early_read_of_a_file_is_caught(tmp_path, monkeypatch):
    """With reads of 4 KiB, a 3.5-read file's CRC-32 is the whole file's (chained over the reads,
    not the last read's alone), and a byte flipped in its first read fails ``verify_files`` and
    ``verify`` alike, whether the manifest was folded at the commit or written from the bytes."""
    from megatron_ckpt_ext import verify_cli

    monkeypatch.setattr(manifest, "_CHUNK", 4096)
    path = tmp_path / "iter_0000001"
    path.mkdir()
    data = bytes(range(256)) * 56  # 14336 bytes: 3.5 reads
    (path / "__0_0.distcp").write_bytes(data)
    assert manifest.file_crc32(path / "__0_0.distcp") == zlib.crc32(data)
    folded = manifest.write_manifest(path, 1)  # the commit sums the file itself (no writer did)
    assert folded["files"]["__0_0.distcp"] == {"bytes": len(data), "crc32": zlib.crc32(data)}
    assert manifest.verify_files(path, folded) == []
    flipped = bytearray(data)
    flipped[10] ^= 0x01
    (path / "__0_0.distcp").write_bytes(bytes(flipped))
    found = manifest.verify_files(path, folded)
    assert [p.file for p in found] == ["__0_0.distcp"] and "CRC-32" in found[0].why, found
    assert verify_cli.run(str(path)) == 1


# -- the structure key ---------------------------------------------------------------------------
def test_a_change_of_dtype_alone_is_a_new_structure():
    """Same keys and shapes, another dtype: the cached save plan (whose metadata holds the
    dtypes) must not be kept."""
    from megatron_ckpt_ext import CkptOptions, backend

    st = backend.sharded_tensor_cls()
    fp32 = {"w": st.from_rank_offsets("w", torch.zeros(4, 8)),
            "b": st.from_rank_offsets("b", torch.zeros(8))}
    bf16 = {"w": st.from_rank_offsets("w", torch.zeros(4, 8, dtype=torch.bfloat16)),
            "b": st.from_rank_offsets("b", torch.zeros(8))}
    assert structure_key(fp32) != structure_key(bf16)
    assert structure_key(fp32) == structure_key({k: st.from_rank_offsets(k, torch.ones_like(
        v.data)) for k, v in fp32.items()})  # new values, same structure
    planner = SavePlanner(CkptOptions(ckpt_assume_constant_structure=True))
    planner.use(planner.key(fp32), SimpleNamespace(new_structure=True))  # a save of fp32
    assert not planner.is_new(planner.key(fp32))
    assert planner.is_new(planner.key(bf16))


# -- retention counts committed directories at or below the tracker ------------------------------
def _tree(root: Path, committed, tracker: int, incomplete=()) -> None:
    for it in committed:
        (root / f"iter_{it:07d}").mkdir(parents=True)
        (root / f"iter_{it:07d}" / "metadata.json").write_text("{}")
    for it in incomplete:
        (root / f"iter_{it:07d}.incomplete").mkdir(parents=True)
    (root / TRACKER).write_text(f"{tracker}\n")


def _its(paths) -> list[int]:
    return [int(p.name[5:12]) for p in paths]


def test_retention_counts_only_committed_directories_up_to_the_tracker(tmp_path):
    """--most-recent-k 2 with the tracker at 6: the 2 kept are 4 and 6. A directory newer than
    the tracker (a save being committed) and an ``.incomplete`` one are neither counted among
    the K (else 4 would go) nor deleted."""
    _tree(tmp_path, [1, 2, 3, 4, 6, 8], tracker=6, incomplete=[5, 7])
    gone = retention.to_delete(tmp_path, most_recent_k=2, retain_interval=None)
    assert _its(gone) == [1, 2, 3], gone
    assert all(p.name == f"iter_{int(p.name[5:12]):07d}" for p in gone), gone
    gone = retention.to_delete(tmp_path, most_recent_k=1, retain_interval=None)
    assert _its(gone) == [1, 2, 3, 4], gone  # never 5 (.incomplete), 7 or 8


# -- admission measures /dev/shm itself ----------------------------------------------------------
def test_admission_measures_dev_shm_itself(monkeypatch):
    """/dev/shm with 1 MiB free (and every other file system roomy): a 64 MiB cpu-shm staging is
    refused with InsufficientSharedMemory. Assuming /dev/shm's room (a constant, MemAvailable,
    or another file system's free space) would admit it and SIGBUS at the first save."""
    real = os.statvfs
    shm = os.path.realpath("/dev/shm")

    def statvfs(path):
        st = real(path)
        if os.path.realpath(os.fspath(path)) != shm:
            return st
        blocks = (1 << 20) // st.f_frsize
        return os.statvfs_result((st.f_bsize, st.f_frsize, max(st.f_blocks, blocks), blocks,
                                  blocks, st.f_files, st.f_ffree, st.f_favail, st.f_flag,
                                  st.f_namemax))

    monkeypatch.setattr(os, "statvfs", statvfs)
    assert preflight.host_budget().shm_free == 1 << 20
    with pytest.raises(InsufficientSharedMemory, match=r"/dev/shm has 0\.00 GiB \(1048576 bytes\)"):
        preflight.admit_node(64 << 20, shm=True, gather=lambda mine: [mine])
    assert preflight.admit_node(64 << 20, shm=False, gather=lambda mine: [mine])["nodes"] == 1
