"""The FSDP checkpoint path on two CPU ranks: the GPU script (tools/check_fsdp_symm_mem.py) with
``--checkpoint-only``, run by torchrun over gloo on the real Megatron-FSDP 0.19.2 code (unpacked:
tests/_support/mcore0192.py)."""

from __future__ import annotations

import json
import os
import sys

from tests._support import ROOT
from tests._support.jobs import run_job
from tests._support.mcore0192 import FSDP_SRC, needs_0192, subprocess_env

SCRIPT = ROOT / "tools" / "check_fsdp_symm_mem.py"


@needs_0192
def test_fsdp_checkpoint_round_trip_on_two_cpu_ranks(tmp_path):
    """The real Megatron-FSDP 0.19.2 code shards a model over 2 gloo ranks (uneven rows: Linear
    bias and LayerNorm vectors); model + AdamW state go through the Checkpointer (async), are
    overwritten, loaded back bit-exact, and whole parameters loaded on every rank equal the
    all-gathered ones."""
    r = run_job(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(SCRIPT), "--out", str(tmp_path), "--checkpoint-only", "--hidden", "48",
         "--layers", "2", "--phase-timeout", "150"],
        timeout=240, check=False, cwd=ROOT,
        env=subprocess_env(PYTHONPATH=os.pathsep.join([str(FSDP_SRC), str(ROOT)])))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    result = json.loads((tmp_path / "fsdp_symm_mem.json").read_text())
    assert result["checks"] == {"roundtrip_bit_exact": True, "whole_tensors_match": True}
    trips = result["roundtrip"]
    assert len(trips) == 2 and all(t["n_differ"] == 0 and t["tensors"] > 0 for t in trips)
    assert trips[0]["tensors"] != trips[1]["tensors"]  # uneven: some vectors live on one rank
    assert trips[0]["mode"].startswith("async")
    assert result["versions"]["fsdp_symm_mem_support"] is True
