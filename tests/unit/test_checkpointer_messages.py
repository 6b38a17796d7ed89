"""The message of a failed async write names each failing rank's own error."""

from torch.distributed.checkpoint.api import CheckpointException

from megatron_ckpt_ext.backend import checkpoint_failure_text as _failure_text


def test_checkpoint_exception_names_each_failing_rank_and_its_error():
    e = CheckpointException("write", {1: RuntimeError("Worker failure:\n[Errno 27] File too large"),
                                      0: OSError(28, "No space left on device")})
    text = _failure_text(e)
    assert text.startswith("CheckpointException (rank 0: OSError")
    assert "rank 1: RuntimeError: [Errno 27] File too large" in text


def test_plain_errors_keep_type_and_text():
    assert _failure_text(OSError(28, "No space")) == "OSError: [Errno 28] No space"


def test_torch_wrapped_failures_are_unwrapped():
    import traceback

    wrapped = (RuntimeError("error: [Errno 27] File too large"), traceback.extract_stack())
    assert _failure_text(CheckpointException("write", {0: wrapped})) == (
        "CheckpointException (rank 0: RuntimeError: error: [Errno 27] File too large)")


def test_a_failed_save_on_a_full_disk_says_so(tmp_path, monkeypatch):
    """torch's writer reports a full disk as e.g. 'unexpected pos 704 vs 598'; the abandoned
    save's error adds the free space when it is below what a checkpoint there takes."""
    import collections

    from megatron_ckpt_ext import CkptOptions, backend, preflight
    from megatron_ckpt_ext.collectives import Group
    from megatron_ckpt_ext.save.writers import WriterPool

    usage = collections.namedtuple("usage", "total used free")
    free = {"bytes": 1 << 30}
    monkeypatch.setattr(preflight.shutil, "disk_usage",
                        lambda path: usage(10 << 30, 9 << 30, free["bytes"]))
    hint = preflight.disk_full_hint(tmp_path / "not_yet_created", 2 << 30)
    assert str(tmp_path) in hint and "1.00 GiB" in hint and "2.00 GiB" in hint
    assert "--save" in hint and "disk is likely full" in hint
    assert preflight.disk_full_hint(tmp_path, 512 << 20) == ""  # enough space: no claim
    assert preflight.disk_full_hint(tmp_path, 0) == ""          # size unknown: no claim

    options = CkptOptions()  # the abandoned save's error carries it
    writers = WriterPool(options, backend.detect(), Group(None, options), is_async=False,
                         cpu_shm=False, reports=[{"bytes": 2 << 30}])
    try:
        error = writers.abandon("its write failed: RuntimeError: unexpected pos 704 vs 598",
                                before=(7, tmp_path))
        assert "unexpected pos" in str(error) and "disk is likely full" in str(error)
        free["bytes"] = 4 << 30
        assert "disk is likely full" not in str(writers.abandon("x", before=(8, tmp_path)))
    finally:
        writers.close(drained=True)


def test_load_on_a_closed_checkpointer_names_close_and_reads_nothing(tmp_path, one_rank_group):
    """The refusal comes first: the targets keep their values and no load is recorded (a load
    that ran and failed afterwards would have overwritten them)."""
    import pytest
    import torch

    from megatron_ckpt_ext import Checkpointer, CkptOptions
    from tests._support.dist import sharded

    with Checkpointer(CkptOptions()) as ck:
        ck.save(sharded(0, 1, {"w": torch.arange(16, dtype=torch.float32)}), tmp_path, iteration=1)
    target = torch.full((16,), -1.0)
    with pytest.raises(RuntimeError, match=r"close\(\)"):
        ck.load(sharded(0, 1, {"w": target}), tmp_path)
    assert torch.equal(target, torch.full((16,), -1.0)), "load() read before it refused"
    assert ck.load_reports == []
