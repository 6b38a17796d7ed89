"""The direct reader into CUDA targets (issue 22): each item's bytes go file -> pinned chunk ->
device on the reading threads' streams, several chunks per large item; the values are bit-exact,
every item is read directly, and the copies are ordered after the work that was queued on the
targets before the load. Runs on a GPU through scripts/gpu_tests.sh (MCX_TEST_DEVICE=cuda); CI
covers the CPU targets (tests/functional/multirank/test_integrity.py, tests/unit/test_direct_read.py)."""

from __future__ import annotations

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
