"""Every recipe in configs/ runs on CPU with 2 ranks and passes; bad recipes fail before starting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


def run(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "run_recipe.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.functional
@pytest.mark.timeout(450)
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_passes_on_cpu(recipe):
    r = run(str(recipe))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"PASSED: {recipe.stem}" in r.stdout and "FAIL " not in r.stdout
    assert "per-save report" in r.stdout


def test_at_least_the_required_recipes_exist():
    names = {r.stem for r in RECIPES}
    assert {"gpt_tiny_sync", "gpt_tiny_async_persistent", "gpt_tiny_async_cpu_shm_constant",
            "gpt_tiny_workers2", "gpt_tiny_fully_parallel_load", "gpt_tiny_nemo_rl_knobs"} <= names


@pytest.mark.parametrize("text,expected", [
    (None, "recipe not found"),
    ("test_type: regular\nmodel: [unclosed\n", "malformed YAML"),
    ("test_type: regular\ntrain_iter: 4\n", "unknown recipe key(s) ['train_iter']"),
    ("test_type: sometimes\n", "test_type must be one of"),
    ("test_type: regular\nnproc: 4096\ntrain_iters: 2\n", "nproc 4096 cannot run here"),
    ("test_type: regular\ntrain_iters: 2\nmegatron_cfg: {async_sav: true}\n", "did you mean 'async_save'"),
])
def test_bad_recipe_is_a_clear_error_before_anything_starts(tmp_path, text, expected):
    path = tmp_path / "r.yaml"
    if text is not None:
        path.write_text(text)
    r = run(str(path), timeout=60)
    assert r.returncode == 2 and expected in r.stderr, r.stderr


def test_load_without_committed_checkpoint_is_an_error(tmp_path):
    (tmp_path / "iter_0000004.incomplete").mkdir()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                        "--master-port", "29871", str(ROOT / "scripts" / "pretrain_gpt.py"),
                        "--train-iters", "2", "--load", str(tmp_path)],
                       capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert r.returncode != 0
    assert "no committed checkpoint" in r.stderr and "latest_checkpointed_iteration.txt is missing" in r.stderr
