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
