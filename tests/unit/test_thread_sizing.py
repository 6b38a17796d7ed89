"""Threads sized to the node: a rank's reading, checksum and writer threads derive from its share
of the cores (the usable cores over the host's ranks), a value the user gave wins, and a verified
load on a rank with few cores starts no more checksum threads than it has cores."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, _threads
from megatron_ckpt_ext.backend import load_reader
from megatron_ckpt_ext.load import verify
from tests._support.dist import sharded


@pytest.fixture
def host(monkeypatch):
    """Pretend this process may run on ``cores`` cores among ``ranks`` ranks of its host."""

    def make(cores: int, ranks: int | None) -> None:
        monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: set(range(cores)))
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))

    return make


def test_eight_local_ranks_on_sixteen_cores_get_two_threads_each(host):
    host(16, 8)
    assert _threads.cores_per_local_rank() == 2
    counts = _threads.thread_counts()
    assert (counts.cores, counts.load_read, counts.checksum, counts.writer) == (2, 2, 2, 1)


def test_one_rank_per_host_keeps_the_one_rank_defaults(host):
    host(16, None)  # no LOCAL_WORLD_SIZE: a world of one
    assert _threads.cores_per_local_rank() == 16
    counts = _threads.thread_counts()
    assert (counts.load_read, counts.checksum, counts.writer) == (8, 8, 1)


def test_a_value_given_wins(host):
    host(16, 8)
    counts = _threads.thread_counts(load_read=8, writer=3)
    assert counts.load_read == 8 and counts.writer == 3
    assert counts.checksum == 2  # not given: at most the rank's cores
    assert _threads.thread_counts(load_read=8, checksum=5).checksum == 5
    assert _threads.thread_counts(cores=4).load_read == 4


def test_fewer_cores_than_ranks_still_get_one_thread(host):
    host(1, 8)
    assert _threads.cores_per_local_rank() == 1
    counts = _threads.thread_counts()
    assert (counts.load_read, counts.checksum, counts.writer) == (1, 1, 1)


def test_without_an_affinity_call_the_cpu_count_is_used(monkeypatch):
    monkeypatch.delattr(_threads.os, "sched_getaffinity")
    monkeypatch.setattr(_threads.os, "cpu_count", lambda: 12)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _threads.cores_per_local_rank() == 3


@pytest.mark.parametrize("value", ["", "eight", "0"])
def test_a_bad_local_world_size_counts_as_one(host, monkeypatch, value):
    host(6, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert _threads.cores_per_local_rank() == 6


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_count_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="load_read must be an integer >= 1"):
        _threads.thread_counts(load_read=bad)


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
def test_a_verified_load_sums_on_the_ranks_share_of_the_cores(host, monkeypatch, tmp_path: Path):
    """--ckpt-load-threads 8 on a rank with 2 cores: 8 reading threads (the flag), 2 summing
    threads and 2 manifest-check threads (derived), and the load is still verified."""
    pools: dict[str, int] = {}

    class Recording(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers=None, thread_name_prefix="", **kw):
            pools[thread_name_prefix] = max_workers
            super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, **kw)

    workers: list[int] = []
    real_verify_files = verify.verify_files

    def recording_verify_files(*args, **kw):
        workers.append(kw["workers"])
        return real_verify_files(*args, **kw)

    monkeypatch.setattr(load_reader, "ThreadPoolExecutor", Recording)
    monkeypatch.setattr(verify, "verify_files", recording_verify_files)
    state = {f"w{i}": torch.randn(4096) for i in range(4)}
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)
    host(16, 8)
    with Checkpointer(CkptOptions(ckpt_load_threads=8)) as ck:
        got = ck.load(sharded(0, 1, {k: torch.zeros(4096) for k in state}), tmp_path)
        assert ck.load_reports[-1]["verified"] is True
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert pools == {"mcx-read": 8, "mcx-sum": 2}, pools
    assert workers and set(workers) == {2}, workers
