"""A load's reading threads read their stripes through descriptors of their own, marked
sequential (the kernel keeps one read-ahead state per open file: interleaved reads of one shared
descriptor look random to it), and load the same bytes; ``MCX_READ_SHARED_FD=1`` reads through
the shared descriptors, with no such advice."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from tests._support.dist import sharded

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_group")]  # tests/conftest.py

_STATE = {f"w{i}": torch.arange(1 << 16, dtype=torch.float32) * (i + 1) for i in range(6)}


@pytest.fixture
def advice(monkeypatch) -> list[tuple[int, int, bool]]:
    """Every (descriptor, advice, whether it is an open file of its own) given to posix_fadvise
    during the test. Of its own: moving its file offset moves none of the descriptors advised
    before (a ``dup`` shares the offset, and the read-ahead state, with its original)."""
    real, calls = os.posix_fadvise, []

    def recording(fd, offset, length, what):
        before = {f for f, _, _ in calls if f != fd}
        mark = os.lseek(fd, 0, os.SEEK_CUR)
        os.lseek(fd, 12345, os.SEEK_SET)
        own = all(os.lseek(f, 0, os.SEEK_CUR) != 12345 for f in before)
        os.lseek(fd, mark, os.SEEK_SET)
        calls.append((fd, what, own))
        return real(fd, offset, length, what)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    return calls


def _load(root, threads: int) -> dict:
    with Checkpointer(CkptOptions(ckpt_load_threads=threads)) as ck:
        return ck.load(sharded(0, 1, {k: torch.empty_like(v) for k, v in _STATE.items()}), root,
                       iteration=1)


@pytest.mark.parametrize("shared", [False, True])
def test_stripes_read_through_sequential_descriptors_of_their_own(tmp_path, advice, monkeypatch,
                                                                 shared):
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, _STATE), tmp_path, iteration=1)
    if shared:
        monkeypatch.setenv("MCX_READ_SHARED_FD", "1")
    advice.clear()
    loaded = _load(tmp_path, threads=3)
    assert all(torch.equal(loaded[k], v) for k, v in _STATE.items())
    headers = {fd for fd, what, _ in advice if what == os.POSIX_FADV_WILLNEED}  # shared ones
    sequential = [(fd, own) for fd, what, own in advice if what == os.POSIX_FADV_SEQUENTIAL]
    if shared:
        assert headers and not sequential
    else:  # one per stripe (3 threads, one data file), each an open file of its own
        assert len(sequential) == 3 and all(own for _, own in sequential), sequential
        assert not headers & {fd for fd, _ in sequential}, (headers, sequential)
