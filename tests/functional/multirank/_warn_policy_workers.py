"""Rank bodies for test_warn_policy.py: under ``--ckpt-failure-policy warn``, saves that fail
where one rank alone sees the error (a writer's ENOSPC on the last rank; rank 0's metadata,
config, commit or report file), each followed by more saves, as a training loop makes them."""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.errors import CheckpointWriteError
from megatron_ckpt_ext.hooks import SaveHooks
from megatron_ckpt_ext.save.layout import REPORT, incomplete_name, read_tracker

from tests._support.dist import sharded

from ._ckpt_workers import assert_equal, load_back, step_state

# iteration -> where its save fails; "report" fails after the commit, so that save commits
FAULTS = {2: "write", 3: "metadata", 5: "config", 6: "commit", 8: "common", 9: "report"}
ITERATIONS = range(1, 10)
FAILED = [it for it, where in FAULTS.items() if where != "report"]
COMMITTED = [it for it in ITERATIONS if it not in FAILED]
# rank 0's files whose writes fail, made unwritable by a directory of their name (works as root):
# megatron-core's common state (in save()), global metadata and config, then our manifest
RANK0_FILES = {"common": "common.pt", "metadata": ".metadata.tmp", "config": "metadata.json",
               "commit": ".mcx_manifest.json.tmp"}


class _DiskFull(io.FileIO):
    """A data file on a full disk: it opens, its writes fail."""

    def write(self, data):  # noqa: ANN001
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)


_OPEN = builtins.open


def _full_disk_open(file, mode="r", *args, **kwargs):  # noqa: ANN001
    if "w" in mode and str(file).endswith(".distcp"):
        return _DiskFull(file, "wb")
    return _OPEN(file, mode, *args, **kwargs)


def _write_on_full_disk(write, *args, **kwargs):  # noqa: ANN001
    """In the writer: its data files open, their writes fail with ENOSPC (the builtin ``open``
    of the writer process, restored after: a persistent worker writes the next save; a writer
    that took ``open`` when it was built, as nvrx 0.7's does, gets the full disk's instead)."""
    write = _swap_open(write)
    builtins.open = _full_disk_open
    try:
        return write(*args, **kwargs)
    finally:
        builtins.open = _OPEN


def _expected(root: Path) -> tuple[list[int], list[int]]:
    """(failed, committed) iterations: :data:`FAULTS`' where the backend writes the file a fault
    is in (megatron-core 0.19 keeps the common state out of ``common.pt``: that save commits)."""
    common = any(p.is_file() for p in root.glob(f"iter_*/{RANK0_FILES['common']}"))
    failed = [it for it in FAILED if FAULTS[it] != "common" or common]
    return failed, [it for it in ITERATIONS if it not in failed]


def _swap_open(fn):  # noqa: ANN001, ANN202
    """``fn`` with the builtin ``open`` it holds (in partials, nested) swapped for the full
    disk's."""
    if not isinstance(fn, partial):
        return _full_disk_open if fn is _OPEN else fn
    return partial(_swap_open(fn.func), *map(_swap_open, fn.args), **fn.keywords)


class _Faults(SaveHooks):
    """The injections of :data:`FAULTS` on the rank that sees each."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.last = rank, world - 1

    def wrap_request(self, request, record):  # noqa: ANN001
        if (FAULTS.get(record.iteration) == "write" and self.rank == self.last
                and request.async_fn is not None):
            return request._replace(async_fn=partial(_write_on_full_disk, request.async_fn))
        return request

    def at(self, point, record):  # noqa: ANN001
        where = FAULTS.get(record.iteration)
        if self.rank != 0 or where in (None, "write"):
            return
        if point != ("staged" if where == "common" else "planned"):  # a sync save: all later
            return
        if where == "report":
            (record.root / REPORT).unlink(missing_ok=True)
            (record.root / REPORT).mkdir()
        else:
            (incomplete_name(record.root, record.iteration) / RANK0_FILES[where]).mkdir()


def failures_agree(rank: int, world: int, root: str, options: dict, bound_s: float,
                   out: str) -> None:
    """Every rank ends each failed save the same way and the next saves proceed: the same saves
    failed and committed on every rank, the tracker names the last commit, all within
    ``bound_s``; rank 0's messages go to ``out``. Synchronous saves raise (the policy is for
    async ones), on every rank."""
    options = {**options, "ckpt_failure_policy": "warn", "distributed_timeout_minutes": 1}
    raised: dict[int, str] = {}
    with Checkpointer(CkptOptions(**options), hooks=_Faults(rank, world)) as ck:
        t0 = time.monotonic()
        for it in ITERATIONS:
            for _ in range(3):  # the loop's iterations between two saves
                ck.maybe_finalize()
                time.sleep(0.02)
            try:
                ck.save(sharded(rank, world, step_state(it, rank)), root, iteration=it)
            except CheckpointWriteError as e:
                raised[it] = str(e)
        ck.maybe_finalize(blocking=True)
        took = time.monotonic() - t0
        errors = {int(f["error"].split("iteration ")[1].split()[0]): f["error"]
                  for f in ck.failed_saves}
        assert not (errors and raised), (errors, raised)  # the policy, or raised: never both
        errors = dict(sorted({**errors, **raised}.items()))
        committed = [r["iteration"] for r in ck.reports]
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, (list(errors), committed))
        failed, committed = _expected(Path(root))
        assert all(e == (failed, committed) for e in everyone), everyone
        assert took < bound_s, f"{len(ITERATIONS)} saves took {took:.1f} s"
        assert read_tracker(root) == committed[-1]
        got = load_back(ck, rank, world, root, None)
        assert_equal(got, step_state(committed[-1], rank), "the last commit")
        if rank == 0:
            Path(out, "errors").write_text("\n".join(errors.values()))
    if rank == 0:
        shutil.rmtree(Path(root) / REPORT, ignore_errors=True)
