"""Preemption when the signal reaches every process of the job, writers included, as SLURM's
job-step SIGTERM and a terminal's Ctrl-C (SIGINT to the foreground process group) do: the
writers ignore it (their rank tells them when to stop), so the exit checkpoint still commits,
every rank exits 0, and the tracker names that checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ckpt_ext.save.layout import read_tracker
from tests._support.dist import free_port

ROOT = Path(__file__).resolve().parents[3]
PERSISTENT_SHM = ("--async-ckpt-use-cpu-shm", "--ckpt-assume-constant-structure",
                  "--use-persistent-ckpt-worker")


def _start_ranks(save: Path, flags: tuple[str, ...]) -> list[subprocess.Popen]:
    """Two ranks of the example loop started directly (as srun starts its tasks), in one new
    process group led by rank 0; their writers are forked or spawned into that group."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "examples" / "train_loop.py"), "--save", str(save),
           "--save-interval", "3", "--train-iters", "100000", "--exit-signal-handler",
           "--ckpt-preempt-grace-s", "60", *flags]
    procs: list[subprocess.Popen] = []
    for r in range(2):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")
        group = procs[0].pid if r else 0  # 0: a new group, led by rank 0
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, process_group=group))
    return procs


def _in_group(pgid: int) -> int:
    """How many processes the job's process group holds (ranks and their writers)."""
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return len(out.split())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig,flags", [
    ("SIGTERM", ("--async-save", *PERSISTENT_SHM)),
    ("SIGTERM", ("--async-save",)),
    ("SIGINT", ("--async-save", "--exit-signal", "SIGINT")),
], ids=["sigterm-persistent-shm", "sigterm-temporal", "sigint-temporal"])
def test_signal_to_the_whole_process_group_commits_the_exit_checkpoint(tmp_path, sig, flags):
    save = tmp_path / "ckpt"
    procs = _start_ranks(save, flags)
    pgid = procs[0].pid
    try:
        deadline = time.time() + 90
        while (read_tracker(save) or 0) < 3 and time.time() < deadline:  # saving has begun
            time.sleep(0.05)
        assert read_tracker(save), "no checkpoint was committed before the signal"
        writers = _in_group(pgid) - 2
        os.killpg(pgid, getattr(signal, sig))  # every process of the job, writers included
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    codes = [p.returncode for p in procs]
    log = "\n".join(o[-1500:] + e[-3000:] for o, e in outs)
    assert codes == [0, 0], f"exit codes {codes} ({writers} writer processes):\n{log}"
    done = [line for line in outs[0][0].splitlines() if line.startswith("done at iteration")]
    latest = read_tracker(save)
    assert done and int(done[0].split()[3].rstrip(":")) == latest, (done, latest, log)
    assert f"exit checkpoint iteration {latest} durable" in outs[0][1], outs[0][1][-3000:]
    verify = subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", "verify", str(save)],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
