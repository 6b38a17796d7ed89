"""With ``MCX_RESTORE_SUMS=device``, a restore from memory prepared ahead pins the snapshot
without summing it, and the load sums each buffer's copy on the device
(staging/restore_sums.py); by default it is summed on the host ahead. A mismatch found
there, after megatron-core's load of the rest, sends every rank to storage. On CPU the device
is stood in for by host memory: the device CRC's torch operations sum the target tensors, the
"device copies" are plain copies; what is checked is which buffers are summed where, the
values, and the refusals."""

from __future__ import annotations

import logging
import zlib

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext import _crc_device
from megatron_ckpt_ext.load import prepared
from megatron_ckpt_ext.staging import restore_copy, retained
from megatron_ckpt_ext.staging.restore_sums import DeviceChecks

from tests._support.prepared_restore import OPTIONS, _like, _loaded_w, _memory_detail
from tests._support import device_sums_standin
from tests._support.seals import flip_byte


@pytest.fixture
def device(monkeypatch, pool):
    """The device stood in for by the CPU (tests/_support/device_sums_standin.py); the buffers
    summed on the 'device', for the checks."""
    summed: list[list[int]] = []
    made = DeviceChecks.__init__

    def checks(self, jobs, indices):
        summed.append(list(indices))
        made(self, jobs, indices)

    device_sums_standin.install(monkeypatch.setattr)
    monkeypatch.setattr(DeviceChecks, "__init__", checks)
    monkeypatch.setenv("MCX_RESTORE_SUMS", "device")
    return summed


def _prepare_and_load(ck, root, **load):
    assert ck.prepare_restore(root)
    assert prepared.wait(30)  # the model build outlasts the preparation
    return ck.load(_like(), str(root), **load)


def test_the_prepared_snapshot_is_pinned_unsummed_and_summed_on_the_device(device, sealed,
                                                                          pool):
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        state = _prepare_and_load(ck, root)
        detail = _memory_detail(ck)
        steps = ck.load_reports[-1]["memory_steps"]
    assert detail["tier"] == "memory"
    assert detail["summed_ahead"] == 0 and detail["pinned_ahead"] == 1  # pinned, not summed
    assert detail["device_summed"] == 1 and detail["device_summed_bytes"] == 4096 * 4
    assert detail["pieces"] == 0 and detail["direct"] == 1  # no host copy, no host sum
    assert device == [[0]] and "device_sums_s" in steps  # the second agreement
    assert set(detail["prepared_steps"]) == {"mapped_s"}  # nothing summed ahead
    assert not pool.built  # every buffer pinned: no bounce pool beside the build
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_a_flipped_byte_is_caught_on_the_device_and_the_load_reads_storage(device, sealed,
                                                                          caplog):
    root = sealed()
    seal = retained.read_seal(retained.seal_path("/dev/shm", root, 0))
    path = next(e.path for e in seal.entries if e.path and e.nbytes >= 4096 * 4)
    flip_byte(path, 100)
    with Checkpointer(CkptOptions(**OPTIONS)) as ck, \
            caplog.at_level(logging.INFO, logger="megatron_ckpt_ext.load.memory"):
        ck._stager.pin = True
        state = _prepare_and_load(ck, root)
        report = ck.load_reports[-1]
    assert device == [[0]]  # it was summed on the device, and refused there
    assert report["tier"] == "storage"
    assert "do not match their sealed CRC-32" in caplog.text
    assert retained.read_seal(seal.file) is None  # damaged: nobody adopts it again
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_another_ranks_late_mismatch_sends_this_rank_to_storage(device, sealed, monkeypatch):
    """Collective: this rank's sums on the device match, another rank's do not: both read
    storage (the second agreement), never a mix."""
    calls = []
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        real = ck._group.all_gather

        def two_ranks(obj):
            if not (isinstance(obj, tuple) and len(obj) == 4):  # not the memory tier's
                return real(obj)
            calls.append(obj)
            host, _, left_out, _ = obj
            late = len(calls) == 2  # the second agreement: the other rank found a bad buffer
            return [*real(obj), (host, "1 buffer(s) do not match" if late else "", left_out,
                                 True)]

        monkeypatch.setattr(ck._group, "all_gather", two_ranks)
        ck._stager.pin = True
        state = _prepare_and_load(ck, root)
        report = ck.load_reports[-1]
    assert len(calls) == 2 and calls[0][3] is True  # this rank's sums were pending at the first
    assert report["tier"] == "storage"
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


@pytest.mark.parametrize("switch", ["host", None])
def test_the_host_switch_sums_ahead_on_the_host(device, sealed, monkeypatch, switch):
    """MCX_RESTORE_SUMS=host, as by default (unset)."""
    if switch is None:
        monkeypatch.delenv("MCX_RESTORE_SUMS")
    else:
        monkeypatch.setenv("MCX_RESTORE_SUMS", switch)
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        _prepare_and_load(ck, root)
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["summed_ahead"] == 1
    assert detail["device_summed"] == 0 and not device
    steps = detail["prepared_steps"]
    assert steps["mapped_s"] <= steps["summed_s"] <= detail["prepared_s"]


def test_where_the_kernel_is_not_ready_the_copy_threads_sum_on_the_host(device, sealed,
                                                                       monkeypatch):
    monkeypatch.setattr(restore_copy, "usable", lambda device: False)
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        state = _prepare_and_load(ck, root)
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["device_summed"] == 0 and not device
    assert detail["summed_ahead"] == 0 and detail["pieces"] == 1  # summed by a copy thread
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


@pytest.mark.parametrize("flip", [None, 0, 5, (64 << 20) + 100, -1])
def test_device_checks_fold_host_edges_and_device_slots_into_each_buffers_crc(flip):
    """Buffers of odd sizes (some bytes outside the aligned middle, summed from the host buffer;
    one over a slot's 64 MiB, summed in several slots): every CRC-32 is zlib's, and a byte
    flipped in the copy's middle, or in the host buffer's edges, is named."""
    sizes = [0, 7, 16 << 10, (16 << 10) + 5, (64 << 20) + (32 << 10) + 12345]  # 2 slots
    gen = torch.Generator().manual_seed(3)
    jobs = []
    for n in sizes:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        jobs.append((src, zlib.crc32(src.numpy().tobytes()), src.clone()))
    src, _, dst = jobs[-1]
    if flip is not None:
        flip %= dst.numel()  # -1: the last byte, past the aligned middle
        skip, length = _crc_device.device_span(dst.data_ptr(), dst.numel())
        middle = skip <= flip < skip + length
        (dst if middle else src)[flip] ^= 1
    checks = DeviceChecks(jobs, list(range(len(jobs))))
    assert checks.bad() == ([] if flip is None else [len(jobs) - 1])
