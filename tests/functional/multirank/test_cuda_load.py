"""The direct reader into CUDA targets (issue 22): each item's bytes go file -> pinned chunk ->
device on the reading threads' streams, several chunks per large item; the values are bit-exact,
every item is read directly, and the copies are ordered after the work that was queued on the
targets before the load. Also the memory tier's copy-ahead block in CUDA managed memory (it
gives way to the model built beside it). Runs on a GPU through scripts/gpu_tests.sh
(MCX_TEST_DEVICE=cuda); CI covers the CPU targets (tests/functional/multirank/test_integrity.py,
tests/unit/test_direct_read.py, tests/unit/test_managed_block.py)."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.backend import direct_read
from tests._support.dist import device, sharded

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(device() != "cuda" or not torch.cuda.is_available(),
                       reason="CUDA load tests: need a GPU and MCX_TEST_DEVICE=cuda "
                              "(scripts/gpu_tests.sh sets it)"),
]


def _state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(7)
    return {"big": torch.randn(5_000_000, generator=g, device="cuda"),  # 20 MB: 5+ chunks
            "bf16": torch.randn(700, 3000, generator=g, device="cuda").to(torch.bfloat16),
            "ints": torch.randint(0, 1 << 40, (123_457,), generator=g, device="cuda"),
            "tiny": torch.randn(3, generator=g, device="cuda")}


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """megatron-core 0.19's save asks for the default process group, even for one rank."""
    if torch.distributed.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                         world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("verify", [True, False])
def test_cuda_targets_load_bit_exact_in_chunks(tmp_path, monkeypatch, world_of_one, verify):
    state = _state()
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path / "ckpt", iteration=1)
    monkeypatch.setattr(direct_read, "DEFAULT_CHUNK", 4 << 20)
    like = {k: torch.empty_like(v) for k, v in state.items()}
    for v in like.values():  # queued on the default stream just before the load's copies
        v.fill_(3) if v.dtype != torch.bool else v.fill_(True)
    with Checkpointer(CkptOptions(ckpt_load_threads=4, ckpt_verify_load=verify)) as ck:
        got = ck.load(sharded(0, 1, like), tmp_path / "ckpt")
        report = ck.load_reports[-1]
    torch.cuda.synchronize()
    assert (report["direct_items"], report["stock_items"]) == (len(state), 0), report
    assert report["phases"]["h2d_s"] > 0 and report["phases"]["read_s"] > 0, report
    for k, v in state.items():
        assert got[k].is_cuda and torch.equal(got[k], v), k


def _device_sums_ready(timeout: float = 120.0) -> None:
    import time

    from megatron_ckpt_ext import _crc_device

    deadline = time.monotonic() + timeout
    while not _crc_device.warm_up(torch.cuda.current_device()):
        assert time.monotonic() < deadline, "the device CRC never became ready (Triton?)"
        time.sleep(0.1)


def test_the_device_crc_kernel_gives_zlibs_values():
    import zlib

    from megatron_ckpt_ext import _crc_device

    _device_sums_ready()
    host = torch.randint(0, 256, ((9 << 20) + 77,), dtype=torch.uint8)
    dev = host.cuda()
    for a, n in ((0, 0), (3, 1), (1, 1023), (7, 1025), (11, 262_145), (5, (9 << 20) + 60)):
        assert _crc_device.crc32_tensor(dev[a:a + n]) == zlib.crc32(host[a:a + n].numpy()), n


def test_a_verifying_load_sums_on_the_device_and_catches_a_flipped_byte(tmp_path, monkeypatch,
                                                                      world_of_one):
    from megatron_ckpt_ext.errors import CheckpointIntegrityError

    _device_sums_ready()
    state = _state()
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, state), tmp_path / "ckpt", iteration=1)
    monkeypatch.setattr(direct_read, "DEFAULT_CHUNK", 4 << 20)
    like = {k: torch.empty_like(v) for k, v in state.items()}
    with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
        got = ck.load(sharded(0, 1, like), tmp_path / "ckpt")
        report = ck.load_reports[-1]
    assert report["verified"] and report["device_summed_bytes"] > 20_000_000, report
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    # one byte in the middle of the largest file (inside the 20 MB tensor's record), flipped
    data = max((p for p in (tmp_path / "ckpt" / "iter_0000001").iterdir() if p.suffix == ".distcp"),
               key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
        with pytest.raises(CheckpointIntegrityError, match=data.name):
            ck.load(sharded(0, 1, like), tmp_path / "ckpt")


def test_the_copy_aheads_block_gives_way_to_the_model_built_beside_it():
    """The restore's copy-ahead block (--ckpt-restore-prefetch) is taken before the model is built:
    in managed memory, ordinary allocations beyond what was free beside it succeed (its pages
    are evicted to host memory) and its bytes stay intact (an ordinary block would make them
    fail with out of memory); a block is freed on its own thread."""
    from megatron_ckpt_ext.load import managed_block as managed

    nbytes, piece = 4 << 30, 1 << 30
    block = managed.managed_block(nbytes, torch.device("cuda", torch.cuda.current_device()))
    assert block is not None and block.is_cuda and block.numel() == nbytes
    pattern = torch.randint(0, 256, (piece,), dtype=torch.uint8).pin_memory()
    for at in range(0, nbytes, piece):
        block[at:at + piece].copy_(pattern)
    torch.cuda.synchronize()
    free_beside = torch.cuda.mem_get_info()[0]
    held = []
    try:
        while sum(h.numel() for h in held) < free_beside + 2 * piece:
            held.append(torch.empty(piece, dtype=torch.uint8, device="cuda").fill_(1))
        torch.cuda.synchronize()
        for at in range(0, nbytes, piece):
            assert torch.equal(block[at:at + piece].cpu(), pattern), at
    finally:
        del held
        torch.cuda.empty_cache()
    del block  # (part of it was evicted: a second block, resident, shows the free)
    block = managed.managed_block(piece, torch.device("cuda", torch.cuda.current_device()))
    before = torch.cuda.mem_get_info()[0]
    managed.free_later(block)
    del block
    deadline = time.monotonic() + 30
    while torch.cuda.mem_get_info()[0] < before + piece // 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert torch.cuda.mem_get_info()[0] >= before + piece // 2
