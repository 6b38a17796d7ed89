"""examples/train_loop.py runs as the README shows: train, then resume at the next iteration
without rewriting a committed checkpoint; the README's loop is the example's, verbatim."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._support import dist as _dist

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "train_loop.py"
ASYNC_CPU_SHM = ("--async-save", "--async-ckpt-use-cpu-shm", "--ckpt-assume-constant-structure")
N, INTERVAL = 4, 2  # run 1 trains 1..N, run 2 resumes to 2N; a save every INTERVAL iterations


def train(save: Path, train_iters: int, *flags: str, load: Path | None = None,
          timeout: float = 180.0, interval: int = INTERVAL) -> str:
    """One torchrun of the example; its stdout. A hang is killed with all its ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(_dist.world()), str(EXAMPLE), *flags, "--save", str(save),
           "--save-interval", str(interval), "--train-iters", str(train_iters)]
    if load is not None:
        cmd += ["--load", str(load)]
    env = dict(os.environ)
    if _dist.device() != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f} s:\n"
                    f"{out[-2000:]}{err[-3000:]}")
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                  f"{out[-2000:]}{err[-4000:]}")
    return out


def committed(root: Path) -> dict[str, dict[str, str]]:
    """Every committed iteration directory: the sha256 of each of its files."""
    return {d.name: {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest()
                     for f in sorted(d.rglob("*")) if f.is_file()}
            for d in sorted(root.glob("iter_*")) if d.is_dir()}


def final_loss(out: str) -> str:
    match = re.search(r"^done at iteration \d+: loss (\S+)$", out, re.M)
    assert match, out
    return match.group(1)


@pytest.mark.functional
@pytest.mark.timeout(600)
def test_resume_continues_at_the_next_iteration_and_never_rewrites_a_commit(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Megatron's habit: the same --save and --load from the first run on. Nothing is committed
    # there yet, so load() returns None and training starts at iteration 1.
    first = train(ckpt, N, *ASYNC_CPU_SHM, load=ckpt)
    assert f"training iterations 1..{N}\n" in first
    before = committed(ckpt)
    assert sorted(before) == [f"iter_{i:07d}" for i in range(INTERVAL, N + 1, INTERVAL)]

    second = train(ckpt, 2 * N, *ASYNC_CPU_SHM, load=ckpt)
    assert f"training iterations {N + 1}..{2 * N} (resumed from {ckpt} at iteration {N})" in second
    after = committed(ckpt)
    assert sorted(after) == [f"iter_{i:07d}" for i in range(INTERVAL, 2 * N + 1, INTERVAL)]
    assert {name: after[name] for name in before} == before, "a committed checkpoint was rewritten"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(2 * N)
    assert not list(ckpt.glob("*.incomplete")) and not (ckpt / "iter_0000000").exists()
    # --train-iters below the resumed iteration: nothing is trained, saved or made up
    third = train(ckpt, N, *ASYNC_CPU_SHM, load=ckpt)
    assert f"nothing to train: --train-iters {N} (resumed from {ckpt} at iteration {2 * N})" \
        in third and f"done at iteration {2 * N}\n" in third, third
    assert committed(ckpt) == after

    # The resumed run ends where one uninterrupted run (plain sync saves) ends, bit for bit: the
    # model, the optimizer's momentum and every rank's data stream were restored.
    straight = train(tmp_path / "straight", 2 * N, interval=3)
    assert final_loss(second) == final_loss(straight)
    # the end of training is saved, as Megatron-LM does, though 2N is no multiple of 3
    assert sorted(committed(tmp_path / "straight")) == ["iter_0000003", "iter_0000006",
                                                        f"iter_{2 * N:07d}"]


def readme_region() -> str:
    text = EXAMPLE.read_text()
    match = re.search(r"^[ \t]*# \[readme\] start\n(.*?)^[ \t]*# \[readme\] end\n", text,
                      re.M | re.S)
    assert match, f"{EXAMPLE} must mark the README's loop with # [readme] start / end"
    return textwrap.dedent(match.group(1))


def test_readme_shows_the_example_loop_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, re.M | re.S)
    assert readme_region() in blocks, (
        "README.md must show the loop of examples/train_loop.py (between its [readme] markers) "
        "as one ```python block, unchanged")
    assert "python -m torch.distributed.run --nproc-per-node 2 examples/train_loop.py" in readme


@pytest.mark.functional
@pytest.mark.timeout(300)
def test_a_bad_flag_value_is_said_once_not_by_every_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--dist-ckpt-workers", "0", "--train-iters", "1"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    said = [ln for ln in (r.stdout + r.stderr).splitlines()
            if "train_loop.py: error: argument --dist-ckpt-workers" in ln]
    assert len(said) == 1, r.stdout + r.stderr
