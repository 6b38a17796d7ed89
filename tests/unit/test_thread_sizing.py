"""Threads sized to the node: a rank's reading, checksum and writer threads derive from its share
of the cores (the usable cores over the host's ranks), a value the user gave wins, and a verified
load on a rank with few cores starts no more checksum threads than it has cores."""

from __future__ import annotations

import argparse
import concurrent.futures
import threading
import types
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, _threads, add_arguments
from megatron_ckpt_ext.backend import load_reader
from megatron_ckpt_ext.errors import CkptOptionsError
from megatron_ckpt_ext.load import verify
from megatron_ckpt_ext.staging import restore_copy, retained
from megatron_ckpt_ext.staging.sealing import _Sealing
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
    assert (counts.cores, counts.load_read, counts.checksum, counts.writer, counts.copy) == (
        2, 2, 2, 1, 2)
    assert _threads.thread_counts(load_read="auto") == counts  # --ckpt-load-threads auto


def test_one_rank_per_host_keeps_the_one_rank_defaults(host):
    host(16, None)  # no LOCAL_WORLD_SIZE: a world of one
    assert _threads.cores_per_local_rank() == 16
    counts = _threads.thread_counts()
    assert (counts.load_read, counts.checksum, counts.writer, counts.copy) == (8, 8, 1, 16)
    host(6, None)  # fewer cores than the one-rank count: one reading thread a core
    assert _threads.thread_counts().load_read == 6
    host(64, 4)  # 16 cores a rank: the one-rank count, not more (16 were slower through
    assert _threads.thread_counts().load_read == 8  # Megatron-LM: docs/notes/node.md)


def test_a_value_given_wins(host):
    host(16, 8)
    counts = _threads.thread_counts(load_read=8, writer=3, copy=6)
    assert counts.load_read == 8 and counts.writer == 3 and counts.copy == 6
    assert counts.checksum == 2  # not given: at most the rank's cores
    assert _threads.thread_counts(load_read=8, checksum=5).checksum == 5
    assert _threads.thread_counts(cores=4).load_read == 4


def test_fewer_cores_than_ranks_still_get_one_thread_and_two_readers(host):
    """Two reading threads at least: one would leave our reader for megatron-core's own loop,
    which reads every file again to verify it."""
    host(1, 8)
    assert _threads.cores_per_local_rank() == 1
    counts = _threads.thread_counts()
    assert (counts.load_read, counts.checksum, counts.writer, counts.copy) == (2, 1, 1, 1)
    assert _threads.thread_counts(load_read=1).load_read == 1  # given: megatron-core's loop


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


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "Auto"])
def test_a_bad_count_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="load_read must be an integer >= 1 or 'auto'"):
        _threads.thread_counts(load_read=bad)


class _Recording(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that records its size under its thread name prefix."""

    sizes: dict[str, int] = {}

    def __init__(self, max_workers=None, thread_name_prefix="", **kw):
        _Recording.sizes[thread_name_prefix] = max_workers
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, **kw)


@pytest.fixture
def pools(monkeypatch) -> dict[str, int]:
    """The size of each pool a load's reader starts ({"mcx-read": n, "mcx-sum": n}) and the
    manifest check's workers ("check")."""
    _Recording.sizes = {}
    real_verify_files = verify.verify_files

    def recording_verify_files(*args, **kw):
        _Recording.sizes["check"] = kw["workers"]
        return real_verify_files(*args, **kw)

    monkeypatch.setattr(load_reader, "ThreadPoolExecutor", _Recording)
    monkeypatch.setattr(verify, "verify_files", recording_verify_files)
    return _Recording.sizes


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
@pytest.mark.parametrize("ranks,argv,read,summing", [
    (8, [], 2, 2),  # auto: 16 cores over 8 ranks
    (None, [], 8, 8),  # auto at one rank per host: the one-rank counts
    (8, ["--ckpt-load-threads", "auto"], 2, 2),
    (8, ["--ckpt-load-threads", "4"], 4, 2),  # the flag wins; summing at most the cores
    (8, ["--ckpt-load-threads", "8"], 8, 2),
])
def test_a_load_reads_and_sums_on_the_ranks_share_of_the_cores(host, pools, tmp_path: Path,
                                                               ranks, argv, read, summing):
    """The load's reading threads (--ckpt-load-threads, auto by default), its summing threads and
    its manifest-check threads, and the load is still verified."""
    state = {f"w{i}": torch.randn(4096) for i in range(4)}
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path, iteration=1)
    host(16, ranks)
    pools.clear()
    options = CkptOptions.from_args(add_arguments(argparse.ArgumentParser()).parse_args(argv))
    with Checkpointer(options) as ck:
        got = ck.load(sharded(0, 1, {k: torch.zeros(4096) for k in state}), tmp_path)
        assert ck.load_reports[-1]["verified"] is True
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert pools == {"mcx-read": read, "mcx-sum": summing, "check": summing}, pools


@pytest.mark.parametrize("source", ["cli", "mapping"])
def test_load_threads_take_auto_or_an_integer_from_every_source(source):
    def options(value):
        if source == "cli":
            parser = add_arguments(argparse.ArgumentParser())
            return CkptOptions.from_args(parser.parse_args(["--ckpt-load-threads", value]))
        return CkptOptions.from_config({"ckpt_load_threads": value})

    assert CkptOptions().ckpt_load_threads == "auto"
    assert CkptOptions.from_config({}).ckpt_load_threads == "auto"  # an absent key: auto
    assert options("auto").ckpt_load_threads == "auto"
    assert options("4" if source == "cli" else 4).ckpt_load_threads == 4


@pytest.mark.parametrize("value", ["Auto", "many", 0, 2.0, True])
def test_a_bad_load_thread_count_names_the_flag_and_the_valid_values(value):
    with pytest.raises(CkptOptionsError, match=r"--ckpt-load-threads \(config key "
                       r"'ckpt_load_threads'\) must be an integer >= 1 or 'auto'"):
        CkptOptions.from_config({"ckpt_load_threads": value})


@pytest.mark.parametrize("argv", [["--ckpt-load-threads", "Auto"], ["--ckpt-load-threads", "0"]])
def test_a_bad_load_thread_flag_exits_naming_the_valid_values(argv, capsys):
    with pytest.raises(SystemExit):
        add_arguments(argparse.ArgumentParser()).parse_args(argv)
    assert "--ckpt-load-threads: must be an integer >= 1 or 'auto'" in capsys.readouterr().err


@pytest.mark.parametrize("ranks,copy,seal", [(8, 2, 2), (None, 16, 4)])
def test_a_memory_snapshots_pools_use_the_ranks_share_of_the_cores(host, monkeypatch, ranks,
                                                                   copy, seal):
    """Pinning an adopted snapshot, copying it into the targets and summing a seal: 16, 16 and
    4 threads at one rank per host, at most the rank's cores with 8 ranks on 16 cores."""
    host(16, ranks)
    _Recording.sizes = {}
    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", _Recording)  # _pin_all's
    _Sealing()._pin_all([])
    assert _Recording.sizes.pop("") == copy
    monkeypatch.setattr(restore_copy, "ThreadPoolExecutor", _Recording)
    monkeypatch.setattr(retained, "ThreadPoolExecutor", _Recording)
    source, target = torch.randn(1024), torch.zeros(1024)
    assert restore_copy.copy_verified([(source, retained.buffer_crc32(source), target)]) == []
    assert torch.equal(source, target) and _Recording.sizes.pop("") == copy
    restore_copy.copy_verified([(source, retained.buffer_crc32(source), target)], threads=5)
    assert _Recording.sizes.pop("") == 5  # a count given wins
    started = []

    class _Thread(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.name)

    monkeypatch.setattr(retained, "threading",
                        types.SimpleNamespace(Thread=_Thread, Lock=threading.Lock))
    assert retained.crc32_all([source] * 20) == [retained.buffer_crc32(source)] * 20
    assert started == ["mcx-seal-sum"] * seal
