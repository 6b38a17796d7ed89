"""What a load trusts: a checkpoint the plugin wrote is known as ours without its manifest (a
deleted manifest is an error, or a warning with --no-ckpt-verify-load); a tracker naming a
deleted directory gives a fix and --ckpt-load-fallback covers it; the fallback takes the newest
older checkpoint that verifies; an integrity error names each bad file once, with fixes a
command-line user can apply (with two ranks: tests/functional/multirank/test_load_trust.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, manifest
from megatron_ckpt_ext.errors import CheckpointIntegrityError, CheckpointNotFound
from tests._support.dist import sharded

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py



def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(512, dtype=torch.float32) + step}


def _save(root: Path, steps) -> None:
    with Checkpointer(CkptOptions()) as ck:
        for step in steps:
            ck.save(sharded(0, 1, _state(step)), root, iteration=step)


def _load(root: Path, **options) -> torch.Tensor:
    with Checkpointer(CkptOptions(**options)) as ck:
        return ck.load(sharded(0, 1, {"w": torch.zeros(512)}), root)["w"]


def _flip_bit(path: Path, offset: int = -100) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_our_checkpoint_without_its_manifest_is_refused_unless_told(tmp_path, caplog):
    _save(tmp_path, [1, 2])
    (tmp_path / "iter_0000002" / manifest.MANIFEST).unlink()
    with pytest.raises(CheckpointIntegrityError) as e:
        _load(tmp_path)
    assert f"{manifest.MANIFEST}: missing" in str(e.value) and "iteration 2" in str(e.value)
    assert "--no-ckpt-verify-load" in str(e.value) and "--ckpt-load-fallback" in str(e.value)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(_load(tmp_path, ckpt_verify_load=False), _state(2)["w"])
    assert [w for w in _warnings(caplog) if "unverified" in w and "missing" in w], \
        _warnings(caplog)
    assert torch.equal(_load(tmp_path, ckpt_load_fallback=True), _state(1)["w"])
    (tmp_path / "iter_0000002" / manifest.MARKER).unlink()  # now as a stock checkpoint
    assert torch.equal(_load(tmp_path), _state(2)["w"])


def test_a_tracker_naming_a_deleted_directory_says_the_fix_and_falls_back(tmp_path, caplog):
    _save(tmp_path, [1, 2, 3])
    shutil.rmtree(tmp_path / "iter_0000003")
    with pytest.raises(CheckpointNotFound) as e:
        _load(tmp_path)
    message = str(e.value)
    assert "iter_0000003 does not exist" in message and "Fix:" in message, message
    assert "--ckpt-load-fallback" in message and "--ckpt-step N" in message, message
    assert "committed here: 2, 1" in message, message
    with caplog.at_level(logging.WARNING):
        assert torch.equal(_load(tmp_path, ckpt_load_fallback=True), _state(2)["w"])
    assert any("loading iteration 2 instead" in w for w in _warnings(caplog)), _warnings(caplog)


def test_an_iteration_asked_for_by_name_never_falls_back_to_another(tmp_path):
    """--ckpt-load-fallback covers the tracker's iteration only: a load of iteration N by name
    (Megatron-LM's --ckpt-step N) whose directory is gone is an error, not iteration N-1."""
    _save(tmp_path, [1, 2, 3])
    shutil.rmtree(tmp_path / "iter_0000003")
    with Checkpointer(CkptOptions(ckpt_load_fallback=True)) as ck:
        with pytest.raises(CheckpointNotFound) as e:
            ck.load(sharded(0, 1, {"w": torch.zeros(512)}), tmp_path, iteration=3)
    message = str(e.value)
    assert "iter_0000003 does not exist; the load asked for this iteration" in message, message
    assert "--ckpt-load-fallback" not in message, message


def test_the_fallback_takes_the_newest_older_checkpoint_that_verifies(tmp_path):
    _save(tmp_path, [1, 2, 3])
    _flip_bit(next((tmp_path / "iter_0000003").glob("*.distcp")))
    assert torch.equal(_load(tmp_path, ckpt_load_fallback=True), _state(2)["w"])


def test_an_integrity_error_gives_fixes_a_command_line_user_can_apply(tmp_path):
    _save(tmp_path, [1, 2])
    bad = next((tmp_path / "iter_0000002").glob("*.distcp"))
    _flip_bit(bad)
    with pytest.raises(CheckpointIntegrityError) as e:
        _load(tmp_path)
    message = str(e.value)
    assert message.count(bad.name) == 1, message
    assert "--ckpt-step N" in message and f"echo N > {tmp_path}" in message, message


def test_the_fallback_names_the_older_checkpoints_it_skipped_too(tmp_path, caplog):
    _save(tmp_path, [1, 2, 3])
    _flip_bit(next((tmp_path / "iter_0000003").glob("*.distcp")))
    (tmp_path / "iter_0000002" / manifest.MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        assert torch.equal(_load(tmp_path, ckpt_load_fallback=True), _state(1)["w"])
    said = [w for w in _warnings(caplog) if "loading iteration 1 instead" in w]
    assert said and "skipped, not verifying either: 2 (" in said[0], _warnings(caplog)


def test_a_load_pointed_at_a_checkpoint_directory_names_its_parent(tmp_path):
    """--load DIR/iter_0000002 (a checkpoint, not the save root that holds it) must not start
    from scratch silently: the error names the root and the iteration flag."""
    _save(tmp_path, [1, 2])
    with pytest.raises(CheckpointNotFound) as e:
        _load(tmp_path / "iter_0000002")
    message = str(e.value)
    assert "is a checkpoint directory (iteration 2), not a save root" in message, message
    assert f"point --load at {tmp_path}" in message and "--ckpt-step 2" in message, message


def test_a_damaged_tracker_is_an_integrity_error_naming_the_flags(tmp_path):
    _save(tmp_path, [1])
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("seven\n")
    with pytest.raises(CheckpointIntegrityError) as e:
        _load(tmp_path)
    assert isinstance(e.value, ValueError)  # what it raised before
    message = str(e.value)
    assert "holds 'seven\\n', not an iteration number" in message, message
    assert "--ckpt-step N" in message and "--iteration N" in message, message


@pytest.mark.parametrize("case", ["shape", "missing"])
def test_a_checkpoint_of_another_model_is_a_load_error_naming_the_tensor_and_the_fix(tmp_path,
                                                                                     case):
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_ckpt_ext.errors import CheckpointLoadError

    _save(tmp_path, [1])
    like = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6), replica_id=0)}
    if case == "missing":  # the saved key, and one the checkpoint lacks
        like = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(_state(1)["w"]),
                                                   replica_id=0) for k in ("w", "extra")}
    with Checkpointer(CkptOptions()) as ck, pytest.raises(CheckpointLoadError) as e:
        ck.load(like, tmp_path)
    message = str(e.value)
    want = "Global shape mismatch" if case == "shape" else "extra from model not in state dict"
    assert f"does not fit the state this job builds: {want}" in message, message
    assert "Fix: build it with that run's model arguments" in message, message


def test_a_plain_tensor_target_is_refused_by_the_load_not_left_unloaded(tmp_path):
    """load({"w": torch.Tensor}) returned without 'w', the tensor unchanged, no word: megatron-
    core fills plain entries from common state only. The load refuses it as the save does."""
    _save(tmp_path, [1])
    target = torch.full((512,), -1.0)
    with Checkpointer(CkptOptions()) as ck, pytest.raises(ValueError) as e:
        ck.load({"w": target}, tmp_path)
    assert "'w' is a plain torch.Tensor of shape (512,)" in str(e.value), e.value
    assert "ShardedTensor.from_rank_offsets" in str(e.value)
    assert torch.equal(target, torch.full((512,), -1.0))
    with Checkpointer(CkptOptions()) as ck:  # a one-element tensor stays common state
        assert torch.equal(ck.load(dict(sharded(0, 1, {"w": torch.zeros(512)}),
                                        step=torch.tensor(1)), tmp_path)["w"], _state(1)["w"])


@pytest.mark.parametrize("bad", [-1, "2", 1.5, True])
def test_an_iteration_that_is_no_non_negative_integer_is_refused_naming_it(tmp_path, bad):
    import numpy as np

    with Checkpointer(CkptOptions()) as ck:
        with pytest.raises(ValueError, match=r"iteration=.*is a non-negative integer"):
            ck.save(sharded(0, 1, _state(1)), tmp_path, iteration=bad)
        ck.save(sharded(0, 1, _state(3)), tmp_path, iteration=np.int64(3))  # an int-like one
        with pytest.raises(ValueError, match=r"iteration=.*is a non-negative integer"):
            ck.load(sharded(0, 1, {"w": torch.zeros(512)}), tmp_path, iteration=bad)
    assert not list(tmp_path.glob("iter_-*")) and (tmp_path / "iter_0000003").is_dir()
