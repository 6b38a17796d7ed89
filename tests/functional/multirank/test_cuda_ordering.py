"""Device-side ordering with the real CUDA code (issue 20): the copy stream waits for the kernels
that produce the saved tensors, and with --ckpt-overlap-snapshot the optimizer step waits for the
overlapped copies. CI keeps the CPU stand-ins (``_LateCopies``, ``_GatedCopies`` in
_ckpt_workers.py); these run on a GPU through ``scripts/gpu_tests.sh`` (MCX_TEST_DEVICE=cuda).

Each ordering is tested twice: as shipped (every checkpoint holds its save's values), and with
that one ordering call removed in the rank (the same check must then see wrong values), which
shows the timing on that GPU really races without it."""

from __future__ import annotations

import json

import pytest
import torch

from . import _cuda_ordering_workers as cw
from tests._support.dist import device, run_ranks, world

pytestmark = [
    pytest.mark.multirank, pytest.mark.timeout(400),
    pytest.mark.skipif(device() != "cuda" or not torch.cuda.is_available(),
                       reason="CUDA ordering tests: need a GPU and MCX_TEST_DEVICE=cuda "
                              "(scripts/gpu_tests.sh sets it)"),
]

CPU_SHM = {"async_save": True, "use_persistent_ckpt_worker": True, "async_ckpt_use_cpu_shm": True,
           "ckpt_assume_constant_structure": True}
OVERLAP = {**CPU_SHM, "ckpt_overlap_snapshot": True}


def _results(tmp_path) -> list[dict]:
    return [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(world())]


def test_copy_stream_waits_for_the_kernels_that_produce_the_saved_tensors(tmp_path):
    run_ranks(cw.producer_before_staging, timeout=300,
              args=(str(tmp_path / "ck"), CPU_SHM, False, str(tmp_path)))
    results = _results(tmp_path)
    assert all(all(r["matches"]) for r in results), results


def test_contrast_a_copy_stream_that_does_not_wait_is_caught_by_the_same_check(tmp_path):
    run_ranks(cw.producer_before_staging, timeout=300,
              args=(str(tmp_path / "ck"), CPU_SHM, True, str(tmp_path)))
    results = _results(tmp_path)
    assert any(not all(r["matches"]) for r in results), (
        f"without the copy stream's wait every checkpoint still matched ({results}): the "
        "producer test cannot detect a missing wait on this GPU")


def test_optimizer_step_after_an_overlapped_save_waits_for_its_copies(tmp_path):
    run_ranks(cw.optimizer_step_after_overlapped_save, timeout=300,
              args=(str(tmp_path / "ck"), OVERLAP, False, str(tmp_path)))
    results = _results(tmp_path)
    # the first save validates the sharding (megatron-core collectives that synchronise), so its
    # copies are done when it returns; from the second on, save() must return with them in flight
    assert all(all(r["in_flight"][1:]) for r in results), f"save() waited for its copies: {results}"
    assert all(all(r["matches"]) for r in results), results


def test_contrast_a_step_that_does_not_wait_is_caught_by_the_same_check(tmp_path):
    run_ranks(cw.optimizer_step_after_overlapped_save, timeout=300,
              args=(str(tmp_path / "ck"), OVERLAP, True, str(tmp_path)))
    results = _results(tmp_path)
    assert any(not all(r["matches"]) for r in results), (
        f"without the step's wait every checkpoint still matched ({results}): the overlap "
        "test cannot detect a missing wait on this GPU")
