"""A restore from memory prepared while the model is built also copies the summed, pinned
snapshot to the device (load/device_ahead.py), where the device has room; the load then copies
device to device and gives the block back. On CPU the device is stood in for by host memory
(the same copies, no stream): what is checked is which copies the load makes, the room rule,
the flag and the release on every path."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.load import device_ahead, prepared
from megatron_ckpt_ext.staging import sealing

from tests._support.prepared_restore import OPTIONS as _OPTIONS, _like, _loaded_w, _memory_detail
from tests._support.seals import flip_byte


OPTIONS = dict(_OPTIONS, ckpt_restore_prefetch=True)


@pytest.fixture
def device(monkeypatch, pool):
    """Pinning stood in for (every buffer 'pinned'), the device stood in for by the CPU with
    ``free`` bytes of room; the blocks made, for the checks."""
    made: list[device_ahead.DeviceAhead] = []
    room = {"free": 1 << 40}
    start = device_ahead.DeviceAhead.start.__func__

    def cpu_start(cls, buffers, wanted, _device, **kwargs):
        made_now = start(cls, buffers, wanted, "cpu", free_bytes=lambda d: room["free"],
                         **kwargs)
        if made_now is not None:
            made.append(made_now)
        return made_now

    class _Cudart:
        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(sealing, "_register", lambda t, n: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart())
    monkeypatch.setattr(device_ahead.DeviceAhead, "start", classmethod(cpu_start))
    return made, room


def _prepare_and_load(ck, root, **load):
    assert ck.prepare_restore(root)
    assert prepared.wait(30)  # the model build outlasts the preparation
    return ck.load(_like(), str(root), **load)


def test_the_load_copies_what_was_copied_ahead_from_the_device_and_gives_the_block_back(
        device, sealed):
    made, _ = device
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        state = _prepare_and_load(ck, root)
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory"
    assert detail["device_ahead"] == 1 and detail["device_ahead_bytes"] == 4096 * 4
    assert detail["pieces"] == 0 and detail["direct"] == 0  # nothing else copied from the host
    assert detail["pinned_ahead"] == 0  # no registering beside the model build: after the load
    assert 0 < detail["device_ahead_fill_s"] <= detail["prepared_s"]
    steps = detail["prepared_steps"]
    assert steps["mapped_s"] <= steps["copied_ahead_s"] <= detail["prepared_s"]
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))
    assert len(made) == 1 and made[0].block.numel() == 0 and not made[0].views  # given back


def test_no_copy_ahead_where_the_device_lacks_room(device, sealed, caplog):
    made, room = device
    room["free"] = 4096 * 4 * device_ahead.ROOM_FACTOR - 1
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck, caplog.at_level("INFO"):
        ck._stager.pin = True
        state = _prepare_and_load(ck, root)
        detail = _memory_detail(ck)
    assert not made and detail["tier"] == "memory" and detail["device_ahead"] == 0
    said = [r.getMessage() for r in caplog.records if "--ckpt-restore-prefetch" in r.getMessage()]
    assert len(said) == 1 and "need 4x that free" in said[0], said  # the flag's user is told
    assert detail["pinned_ahead"] == 1  # pinned ahead, copied whole
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_without_the_flag_nothing_is_copied_ahead(device, sealed):
    made, _ = device
    root = sealed()
    with Checkpointer(CkptOptions(**_OPTIONS)) as ck:  # the default: off
        ck._stager.pin = True
        _prepare_and_load(ck, root)
        assert _memory_detail(ck)["device_ahead"] == 0
    assert not made


@pytest.mark.parametrize("how", ["other_iteration", "never_loaded"])
def test_a_block_no_load_takes_is_given_back(device, sealed, how):
    """The snapshot holds iteration 2: a load of 1 reads storage; or the run closes without a
    load. Either way the device block goes back (on a GPU it would hold the snapshot's bytes)."""
    made, _ = device
    root = sealed((1, 2))
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        if how == "other_iteration":
            _prepare_and_load(ck, root, iteration=1)
            assert ck.load_reports[-1]["tier"] == "storage"
        else:
            assert ck.prepare_restore(root)
            deadline = time.monotonic() + 30
            while not made or not made[0].views:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    assert len(made) == 1 and made[0].block.numel() == 0 and not made[0].views


def test_a_flipped_byte_is_caught_by_the_copy_ahead_and_the_load_reads_storage(device, sealed):
    """The copy ahead sums every chunk against the seal: a byte flipped in /dev/shm after the
    seal is not taken from the device block, the load sums it again, refuses the snapshot and
    reads storage; the block goes back."""
    from megatron_ckpt_ext.staging import retained

    made, _ = device
    root = sealed()
    seal = retained.read_seal(retained.seal_path("/dev/shm", root, 0))
    path = next(e.path for e in seal.entries if e.path and e.nbytes >= 4096 * 4)
    flip_byte(path, 100)
    flipped = next(i for i, e in enumerate(seal.entries) if e.path == path)
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        assert ck.prepare_restore(root) and prepared.wait(30)
        assert flipped not in made[0].views and len(made[0].views) == len(seal.entries) - 1
        state = ck.load(_like(), str(root))
        report = ck.load_reports[-1]
    assert report["tier"] == "storage"
    assert len(made) == 1 and not made[0].views and made[0].block.numel() == 0
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_a_failed_copy_ahead_gives_the_block_back_and_the_load_copies_from_host(
        device, sealed, monkeypatch, caplog):
    """The copy ahead is optional: where it fails (a device error) the block goes back, a
    warning says so, and the prepared restore sums on the host as without it."""
    made, _ = device

    def broken(self, crcs, *, threads):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(device_ahead.DeviceAhead, "fill", broken)
    root = sealed()
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        state = _prepare_and_load(ck, root)
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["device_ahead"] == 0
    assert detail["summed_ahead"] >= 1
    assert len(made) == 1 and made[0].block.numel() == 0
    assert "could not be copied to the device ahead" in caplog.text
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_a_load_that_comes_during_the_copy_ahead_takes_what_landed_and_copies_the_rest(
        device, sealed, monkeypatch):
    """The copy ahead stops when the load comes (a model build shorter than the copy, as at
    the model-build seam): the load waits for the pieces in flight only, not for the whole
    copy, and copies the buffers left from host memory, summed on the way. Here the copy
    ahead would take 8 x 0.1 s (one thread, 2 KiB pieces of the 16 KiB buffer)."""
    import functools
    import types

    from megatron_ckpt_ext.staging import restore_copy

    made, _ = device
    root = sealed()
    real_crc, real_start = restore_copy._crc32, restore_copy.start_copy_verified

    def slow_crc(data):  # noqa: ANN001
        time.sleep(0.1)
        return real_crc(data)

    monkeypatch.setattr(restore_copy, "_crc32", slow_crc)
    monkeypatch.setattr(restore_copy, "start_copy_verified",  # (the fill's; the load's is
                        functools.partial(real_start, chunk=2048))  # bound in load/memory.py)
    monkeypatch.setattr(prepared, "thread_counts", lambda: types.SimpleNamespace(copy=1))
    with Checkpointer(CkptOptions(**OPTIONS)) as ck:
        ck._stager.pin = True
        assert ck.prepare_restore(root)
        time.sleep(0.05)  # the copy ahead has started (or not: the same then)
        state = ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["prepare_wait_s"] < 0.5, detail
    assert detail["device_ahead"] == 0 and detail["device_ahead_left"] == 1
    assert detail["summed_ahead"] == 0 and detail["pieces"] == 1  # copied and summed now
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))
    assert len(made) == 1 and made[0].block.numel() == 0  # the block went back


def test_without_cuda_there_is_no_managed_block_and_no_copy_ahead():
    """Where CUDA (or its managed memory) is not given, the copy ahead makes no block and says
    so at debug level: the load copies from host memory (no error)."""
    from megatron_ckpt_ext.load import managed_block

    if torch.cuda.is_available():
        pytest.skip("a host without CUDA")
    assert managed_block.managed_block(1 << 20, torch.device("cuda", 0)) is None
    buffers = [torch.ones(1024, dtype=torch.uint8)]
    assert device_ahead.DeviceAhead.start(buffers, {0}, "cuda:0",
                                          free_bytes=lambda d: 1 << 40) is None


GIB = 1 << 30


@pytest.mark.parametrize("free,kinds,beside,want", [
    (20 * GIB, "cached", 8 * GIB, "cached"),  # 2 + 8 + 0.8 + 1 <= 20: torch's block
    (11 * GIB, "cached", 8 * GIB, None),  # 2 GiB beside 9.8 GiB do not fit 11
    (11 * GIB, "any", 8 * GIB, "managed"),  # ... but 4 x 2 GiB are free: a managed block
    (7 * GIB, "any", 8 * GIB, None),  # not even that
    (40 * GIB, "cached", 0, None),  # the seal does not say what its run held: never cached
    (40 * GIB, "any", 0, "managed"),
])
def test_the_block_is_torchs_only_where_it_fits_beside_the_sealing_runs_peak(free, kinds, beside,
                                                                             want):
    """A cached block is never freed (training reuses it) but cannot give way to the model
    built beside it: it is taken only where the device's free memory holds it beside all the
    memory the run that sealed the snapshot held (its seal's ``device_peak``), plus a margin;
    otherwise, where the flag asks for any block, a managed one under the 4x rule."""
    kind, why = device_ahead._kind(2 * GIB, free, kinds, beside)
    assert kind == want
    assert bool(why) == (want is None)


def test_ranks_sharing_a_device_each_count_only_their_share_of_its_free_memory(monkeypatch):
    """8 ranks on one GPU decide at once, each knowing only its own seal's peak: each counts an
    eighth of the free memory, so together they never take more than the device holds."""
    assert device_ahead._kind(2 * GIB, 20 * GIB, "cached", 8 * GIB, sharers=1)[0] == "cached"
    kind, why = device_ahead._kind(2 * GIB, 20 * GIB, "cached", 8 * GIB, sharers=2)
    assert kind is None and "share of 2" in why
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_ahead._sharers(torch.device("cuda", 0)) == 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert device_ahead._sharers(torch.device("cuda", 0)) == 1
    buffers = [torch.ones(1024, dtype=torch.uint8)]
    start = device_ahead.DeviceAhead.start  # (on CPU one "device": 8 ranks share it)
    assert start(buffers, {0}, "cpu", free_bytes=lambda d: 20 * GIB, kinds="cached",
                 beside=12 * GIB) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert start(buffers, {0}, "cpu", free_bytes=lambda d: 20 * GIB, kinds="cached",
                 beside=12 * GIB).kind == "cached"


@pytest.mark.parametrize("switch", ["cached", "managed"])
def test_mcx_prefetch_block_forces_a_kind_under_the_4x_rule(monkeypatch, switch):
    monkeypatch.setenv("MCX_PREFETCH_BLOCK", switch)
    assert device_ahead._kind(2 * GIB, 8 * GIB, "cached", 0) == (switch, "")
    assert device_ahead._kind(2 * GIB, 8 * GIB - 1, "any", 40 * GIB)[0] is None


@pytest.mark.parametrize("mode,early,peak,copied", [
    ("auto", True, 1 << 20, True),  # the launcher's early preparation: torch's block
    ("auto", False, 1 << 20, False),  # at the model build: no copy ahead by default
    ("auto", True, 0, False),  # a seal that does not say what its run held
    ("off", True, 1 << 20, False),
    ("on", False, 0, True),  # asked for: wherever, any block
])
def test_by_default_the_copy_ahead_runs_only_in_the_early_preparation_into_torchs_block(
        device, sealed, monkeypatch, caplog, mode, early, peak, copied):
    made, _ = device
    monkeypatch.setattr(sealing, "_device_peak", lambda: peak)
    root = sealed()
    options = dict(_OPTIONS, ckpt_restore_prefetch=mode)
    with Checkpointer(CkptOptions(**options)) as ck, caplog.at_level("INFO"):
        ck._stager.pin = True
        assert ck.prepare_restore(root, early=early) and prepared.wait(30)
        state = ck.load(_like(), str(root))
        detail = _memory_detail(ck)
    assert detail["tier"] == "memory" and detail["device_ahead"] == int(copied)
    assert len(made) == int(copied)
    if copied:
        assert made[0].kind == ("cached" if mode == "auto" else "managed")  # (CPU: host memory)
    said = [r.getMessage() for r in caplog.records if "--ckpt-restore-prefetch" in r.getMessage()]
    assert len(said) == (mode == "auto" and early and not peak), said  # why, once, when asked
    assert torch.equal(_loaded_w(state), torch.arange(4096.0))


def test_the_seal_records_the_peak_device_memory_of_its_run(sealed, monkeypatch):
    """The seal says how much device memory torch held in the run that sealed it; a seal written
    before that field existed reads as 0 (unknown: no cached block for it)."""
    import json

    from megatron_ckpt_ext.staging import retained

    monkeypatch.setattr(sealing, "_device_peak", lambda: 12345)
    root = sealed()
    path = retained.seal_path("/dev/shm", root, 0)
    assert retained.read_seal(path).device_peak == 12345
    data = json.loads(open(path).read())
    del data["device_peak"]
    with open(path, "w") as fh:
        json.dump(data, fh)
    assert retained.read_seal(path).device_peak == 0


def test_the_seals_peak_is_the_largest_of_the_processs_devices(monkeypatch):
    """A rank uses one device, but the commit that seals may run on a thread whose current
    device is another: the peak is read over every device (0 where CUDA was never used)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert sealing._device_peak() == 0
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                        lambda d=None: {0: 0, 1: 7 * GIB, 2: 0}[0 if d is None else d])
    assert sealing._device_peak() == 7 * GIB
