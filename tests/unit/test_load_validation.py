"""megatron-core's sharding validation (a collective, then a walk of every shard) is not run
inside a storage load: the load reads the same bytes without it, and the structure is validated
where a save needs it, by prepare() right after the load (constant structure) or by the first
save; a save never writes an unvalidated structure."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend


def _state(fill: float | None = None) -> dict:
    st = backend.sharded_tensor_cls()
    return {f"w{i}": st.from_rank_offsets(
        f"w{i}", torch.full((64,), fill) if fill is not None else torch.arange(64.0) + i,
        replica_id=0) for i in range(3)}


@pytest.fixture
def validations(monkeypatch):
    """How many times megatron-core validates a structure's sharding (wherever it bound it)."""
    from megatron.core.dist_checkpointing import validation

    real, calls = validation.validate_sharding_integrity, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core.dist_checkpointing") and \
                getattr(module, "validate_sharding_integrity", None) is real:
            monkeypatch.setattr(module, "validate_sharding_integrity", counting)
    return calls


@pytest.mark.parametrize("constant", [False, True])
def test_the_load_leaves_the_sharding_validation_to_the_save(one_rank_group, tmp_path,
                                                             validations, constant):
    options = CkptOptions(ckpt_assume_constant_structure=constant)
    with Checkpointer(options) as ck:
        ck.save(_state(), tmp_path, iteration=1)
        ck.maybe_finalize(blocking=True)
    assert len(validations) == 1  # the save validated
    validations.clear()
    with Checkpointer(options) as ck:
        got = ck.load(_state(0.0), tmp_path)
        # constant structure: prepare(), right after the load, validated it for the first save
        assert len(validations) == (1 if constant else 0)
        assert all(torch.equal(got[f"w{i}"], torch.arange(64.0) + i) for i in range(3))
        ck.save(_state(), tmp_path, iteration=2)
        ck.maybe_finalize(blocking=True)
    assert len(validations) == 1  # validated once before the first save wrote, in either case
