"""Pinning a host buffer (``cudaHostRegister``) holds the CUDA driver's lock, which every CUDA
call of the process waits for; a buffer whose pages are not yet in the process's page tables is
faulted in inside that hold (on an H200 the training steps beside the first save's preparation
ran 3.3x slower so, 1.2x with the pages faulted in first). So every pinning of ours faults the
pages in first: the shared-memory staging's segments and the restore's bounce pool. CUDA's
register call is stood in for (CPU) by one that reads, from /proc/self/pagemap, how many of the
pages it was given are present."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from megatron_ckpt_ext._runtime import populate
from megatron_ckpt_ext.staging import restore_copy
from megatron_ckpt_ext.staging.shm import ShmStager

PAGE = os.sysconf("SC_PAGE_SIZE")


def _present(address: int, nbytes: int) -> tuple[int, int]:
    """(pages present in this process's page tables, pages) of the range (pagemap bit 63)."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        data = f.read((last - first + 1) * 8)
    flags = [v for (v,) in struct.iter_unpack("<Q", data)]
    return sum(v >> 63 & 1 for v in flags), len(flags)


@pytest.fixture
def registered(monkeypatch):
    """A fake cudart whose cudaHostRegister records (present, pages) of what it is given."""
    seen: list[tuple[int, int]] = []

    class _Cudart:
        @staticmethod
        def cudaHostRegister(ptr: int, nbytes: int, flags: int) -> int:
            seen.append(_present(ptr, nbytes))
            return 0

        @staticmethod
        def cudaHostUnregister(ptr: int) -> int:
            return 0

    probe = torch.empty(16 * PAGE, dtype=torch.uint8)
    if not populate(probe.data_ptr(), probe.numel(), write=True):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart)
    return seen


@pytest.mark.parametrize("cores", [1, 4])  # 1: each registration faults its segment in
def test_staging_segments_are_faulted_in_before_they_are_pinned(tmp_path, registered,
                                                                monkeypatch, cores):
    from megatron_ckpt_ext import _threads

    monkeypatch.setattr(_threads, "cores_per_local_rank", lambda: cores)
    stager = ShmStager(job_id="pin", rank=0, reuse=True, pin=True, shm_dir=str(tmp_path),
                       sweep=False)
    try:
        stager.prepare([torch.zeros(3 << 20, dtype=torch.float32),
                        torch.zeros(5000, dtype=torch.bfloat16)], keys=["w", "b"])
        assert stager.wait_prepared(timeout_s=30)
        assert len(registered) == 2, registered
        for present, pages in registered:
            assert present == pages, f"{present} of {pages} pages present when pinned"
    finally:
        stager.close()


def test_a_sets_fresh_segments_are_faulted_in_on_several_threads_before_any_is_pinned(
        tmp_path, registered, monkeypatch):
    """The fault-in (tmpfs zeroes each page then) is most of a preparation: one thread ran
    1.5-2.7 GB/s on an H200 host, four 6.5-7.1 GB/s. A set's fresh segments are faulted in on
    several threads at once (daemon threads: an exit does not wait for them), all of them
    before the first is pinned, and only once."""
    import threading

    from megatron_ckpt_ext import _threads
    from megatron_ckpt_ext.staging import segments

    real, calls = segments.populate, []

    def recorded(address: int, nbytes: int, *, write: bool = False) -> bool:
        calls.append((threading.get_ident(), len(registered), threading.current_thread().daemon))
        return real(address, nbytes, write=write)

    monkeypatch.setattr(segments, "populate", recorded)
    monkeypatch.setattr(_threads, "cores_per_local_rank", lambda: 4)
    stager = ShmStager(job_id="pin", rank=0, reuse=True, pin=True, shm_dir=str(tmp_path),
                       sweep=False)
    try:
        stager.prepare([torch.zeros(1 << 20, dtype=torch.float32) for _ in range(8)],
                       keys=[f"t{i}" for i in range(8)])
        assert stager.wait_prepared(timeout_s=30)
    finally:
        stager.close()
    assert len(calls) == 8, calls  # once each: the registration does not fault them in again
    assert all(done == 0 for _, done, _ in calls), calls  # all before the first registration
    assert len({thread for thread, _, _ in calls}) > 1, calls
    assert all(daemon for _, _, daemon in calls), "an exit would wait for the fault-in"
    assert len(registered) == 8 and all(p == n for p, n in registered), registered


def test_the_restore_bounce_pool_is_faulted_in_before_it_is_pinned(registered):
    bounce = restore_copy._Bounce(threads=2, chunk=8 << 20)
    try:
        assert bounce.pinned
        (present, pages), = registered
        assert pages >= (2 * 2 * (8 << 20)) // PAGE  # (one more where it starts mid-page)
        assert present == pages, f"{present} of {pages} pages present when pinned"
    finally:
        bounce.pinned = False  # nothing was pinned for real


def test_the_madvise_binding_is_published_whole(monkeypatch):
    """The first populate() calls of a process may come from several pinning threads at once
    (an adopted snapshot is pinned on several): a thread must never find the binding without
    its argument types (ctypes would then pass the address as a 32-bit int)."""
    from megatron_ckpt_ext import _runtime

    class _Checked(list):
        def append(self, item):
            assert getattr(item, "argtypes", None), "published before its argument types"
            super().append(item)

    monkeypatch.setattr(_runtime, "_madvise", _Checked())
    buffer = torch.empty(64 * PAGE, dtype=torch.uint8)
    if not populate(buffer.data_ptr(), buffer.numel(), write=True):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert len(_runtime._madvise) == 1
    assert _present(buffer.data_ptr(), buffer.numel())[0] >= 64
