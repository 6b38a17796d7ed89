"""Guards for behaviours a one-line slip would break silently, that need a process group: the
direct reader refusing a target it would fill wrongly, a manifest copied from another iteration
refused by the load, and a dead persistent writer replaced under --ckpt-failure-policy warn
(tests/unit/test_guards.py has the ones that need none)."""

from __future__ import annotations

import shutil
from datetime import timedelta

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointIntegrityError
from megatron_ckpt_ext.save.layout import TRACKER
from tests._support.dist import free_port, run_ranks, sharded, world

from . import _guards_workers as gw

pytestmark = pytest.mark.multirank


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


SAVED = {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
         "v": torch.randn(256, generator=torch.Generator().manual_seed(2))}

# targets the direct reader must not fill with the saved bytes as they lie (it would cast nothing,
# or write a strided view's elements as if contiguous)
TARGETS = {
    "float64": ("w", lambda: torch.zeros(64, 8, dtype=torch.float64)),
    "bfloat16": ("w", lambda: torch.zeros(64, 8, dtype=torch.bfloat16)),
    "transposed": ("w", lambda: torch.zeros(8, 64).t()),
    "strided": ("v", lambda: torch.zeros(512)[::2]),
}


@pytest.mark.usefixtures("one_rank_group")
def test_a_target_of_another_dtype_or_not_contiguous_loads_the_right_values(tmp_path):
    """With the parallel reader on (--ckpt-load-threads 4), a target whose dtype differs from
    the saved tensor's, or a non-contiguous view, gets the saved values (cast, in its layout);
    the matching target beside it is read directly, so the direct path was live."""
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, SAVED), tmp_path, iteration=1)
    for name, (key, make) in TARGETS.items():
        other = "v" if key == "w" else "w"
        like = {key: make(), other: torch.zeros_like(SAVED[other])}
        with Checkpointer(CkptOptions(ckpt_load_threads=4)) as ck:
            got = ck.load(sharded(0, 1, like), tmp_path)
            report = ck.load_reports[-1]
        assert report["direct_items"] >= 1, (name, report)  # the matching item, at least
        assert torch.equal(got[other], SAVED[other]), name
        assert got[key].dtype == like[key].dtype, name
        assert torch.equal(got[key], SAVED[key].to(like[key].dtype)), name


@pytest.mark.usefixtures("one_rank_group")
def test_the_load_refuses_a_manifest_copied_from_another_iteration(tmp_path):
    """iter_2 a byte-for-byte copy of iter_1 (its manifest's CRCs all match, only the iteration
    in it is 1): the load of 2 refuses it, naming the iteration mismatch."""
    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, SAVED), tmp_path, iteration=1)
    shutil.copytree(tmp_path / "iter_0000001", tmp_path / "iter_0000002")
    (tmp_path / TRACKER).write_text("2\n")
    like = {k: torch.zeros_like(v) for k, v in SAVED.items()}
    with Checkpointer(CkptOptions()) as ck:
        with pytest.raises(CheckpointIntegrityError, match="written for iteration 1, not 2"):
            ck.load(sharded(0, 1, like), tmp_path)
        assert torch.equal(ck.load(sharded(0, 1, like), tmp_path, iteration=1)["w"], SAVED["w"])


@pytest.mark.timeout(90)
def test_a_dead_persistent_writer_is_replaced_under_warn_and_the_next_save_commits(tmp_path):
    """A persistent writer SIGKILLed between saves under --ckpt-failure-policy warn: the next
    save is served by a new writer and commits on every rank (not a hang, not an error)."""
    run_ranks(gw.dead_worker_under_warn, world_size=world(), timeout=75, args=(str(tmp_path),))
    assert (tmp_path / "iter_0000002").is_dir()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["prepare", "stage"])
def test_a_staging_allocation_that_fails_on_one_rank_hangs_no_rank(tmp_path, where):
    """The staging allocation fails on the last rank only, in prepare()'s background thread or
    in the first save's staging: the other ranks' collectives do not wait for it (prepare()'s
    validation and planning ahead, the save's planning), the save fails on every rank naming
    that rank, within the test's limit instead of a timeout, and the next save commits."""
    run_ranks(gw.staging_fails_on_the_last_rank, args=(str(tmp_path / "ckpt"), where),
              timeout=120)
