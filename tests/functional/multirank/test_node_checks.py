"""The node checks (``tools/node_checks.py``) under torchrun with 4 ranks on one host (CPU, gloo):
node admission passes a node that fits and refuses one over --ckpt-node-memory-limit-mib on
every rank alike, a writer SIGKILLed mid-save raises on every rank within the bound, and a
SIGTERM to every process of the job ends with a committed, verifying checkpoint and exactly the
retained ones left. The tool's own JSON is the record asserted on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RANKS = 4
pytestmark = pytest.mark.multirank


def _run_tool(out: Path, timeout: float) -> subprocess.CompletedProcess:
    """torchrun (this interpreter's) in a session of its own, killed whole past ``timeout``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(RANKS), "tools/node_checks.py", "--out", str(out), "--device", "cpu",
           "--check-timeout-s", "30", "--collective-timeout-s", "60",
           "--timeout-s", str(timeout - 15)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"node checks did not finish within {timeout} s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output, "")


@pytest.mark.timeout(180)
def test_every_node_check_passes_with_four_ranks_on_one_host(tmp_path):
    done = _run_tool(tmp_path, timeout=150)
    result = json.loads((tmp_path / "node_checks.json").read_text())
    checks = result["checks"]
    failed = {name: c["details"] for name, c in checks.items() if not c["passed"]}
    assert done.returncode == 0 and not failed, f"{failed}\n{done.stdout[-4000:]}"
    assert list(checks) == ["admission_fits", "admission_refused", "writer_killed",
                            "preempt_and_retention"]
    assert (result["world_size"], result["ranks_per_device"]) == (RANKS, RANKS)
    assert result["layout"]["process_group"] == "gloo" and result["versions"]["torch"]
    fits = checks["admission_fits"]["details"]["admission"]
    assert fits["node_ranks"] == RANKS and fits["node_staging_bytes"] == RANKS * 4 * 2**20
    refused = checks["admission_refused"]["details"]
    assert refused["same_on_every_rank"] and "--ckpt-node-memory-limit-mib" in refused["message"]
    killed = checks["writer_killed"]["details"]
    assert killed["errors"] == ["CheckpointWriteError"] * RANKS
    assert len(killed["seconds_to_raise_per_rank"]) == RANKS
    preempt = checks["preempt_and_retention"]["details"]
    assert preempt["kept"] == preempt["expected_kept"], preempt  # the latest 2, every 3rd
    assert {3, 6} <= set(preempt["kept"]) and 1 not in preempt["kept"], preempt
    assert preempt["verify"]["rc"] == 0 and preempt["signalled_pids"] == RANKS
