"""Every recipe in configs/ runs on CPU with 2 ranks and passes; bad recipes fail before starting."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support import load_script
from tests._support.jobs import run_job

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


def run(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return run_job([sys.executable, str(ROOT / "scripts" / "run_recipe.py"), *args],
                   timeout=timeout, check=False, cwd=ROOT)


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


def _pretrain(*args: str, timeout: int = 200, nproc: int = 1) -> subprocess.CompletedProcess:
    """scripts/pretrain_gpt.py on ``nproc`` ranks (a tiny model, two iterations)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return run_job([sys.executable, "-m", "torch.distributed.run",
                    "--nproc-per-node", str(nproc),
                    "--master-port", str(port), str(ROOT / "scripts" / "pretrain_gpt.py"),
                    "--train-iters", "2", "--num-layers", "1", "--hidden-size", "32",
                    "--num-attention-heads", "2", "--seq-length", "16", *args],
                   timeout=timeout, check=False, cwd=ROOT)


@pytest.mark.functional
@pytest.mark.timeout(300)
def test_load_without_committed_checkpoint_warns_and_starts_from_scratch(tmp_path):
    # As Megatron-LM: a missing (or empty) --load directory is a warning, not an error.
    metrics = tmp_path / "m.json"
    r = _pretrain("--load", str(tmp_path / "never_saved"), "--metrics-file", str(metrics))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no committed checkpoint to load" in r.stderr and "starting from scratch" in r.stderr
    import json

    assert sorted(json.loads(metrics.read_text())["losses"]) == ["1", "2"]


@pytest.mark.functional
@pytest.mark.timeout(300)
def test_exit_on_missing_checkpoint_makes_it_an_error(tmp_path):
    (tmp_path / "iter_0000004.incomplete").mkdir()
    r = _pretrain("--load", str(tmp_path), "--exit-on-missing-checkpoint")
    assert r.returncode != 0
    assert "no committed checkpoint to load" in r.stderr and "latest_checkpointed_iteration.txt" in r.stderr
    assert "--exit-on-missing-checkpoint is set" in r.stderr and "iteration 1 |" not in r.stderr


@pytest.mark.functional
@pytest.mark.timeout(300)
def test_unwritable_save_fails_at_start_up(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = _pretrain("--save", str(blocker / "ckpt"), "--save-interval", "2", nproc=2)
    assert r.returncode != 0
    # one line, from rank 0 only, no traceback of ours (torchrun's own report follows it)
    line = f"error: --save {blocker / 'ckpt'}: {blocker} is a file, not a directory. Fix:"
    assert r.stderr.count(line) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr.split("ChildFailedError")[0].split(line)[0], r.stderr[-3000:]
    assert "exitcode  : 2" in r.stderr and "CkptOptionsError" not in r.stderr, r.stderr[-3000:]
    assert "iteration 1 |" not in r.stderr  # refused before training, not at the first save


def _run_recipe_module():
    return load_script("scripts/run_recipe.py", "run_recipe")


def test_rank_error_is_the_root_cause_ranks_own_traceback():
    log = "\n".join([
        "[default0]:iteration 1 | loss 6.2",
        "[default1]:[rank1]: Traceback (most recent call last):",
        "[default1]:[rank1]:   File \"pretrain_gpt.py\", line 9, in train_step",
        "[default1]:[rank1]: FloatingPointError: iteration 2: the loss is nan",
        "[default0]:Traceback (most recent call last):",
        "[default0]:  File \"distributed_c10d.py\", line 3, in all_reduce",
        "[default0]:RuntimeError: Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    ])
    err = _run_recipe_module().rank_error(log)
    assert err.startswith("rank 1: FloatingPointError: iteration 2: the loss is nan"), err
    assert "Connection closed" not in err


NAN_RECIPE = """name: nan_{tag}
test_type: regular
nproc: 1
train_iters: 3
model: {{num_layers: 1, hidden_size: 32, num_attention_heads: 2, seq_length: 16, micro_batch_size: 1, lr: 1.0e+20}}
ckpt_flags: {flags}
"""


@pytest.mark.functional
@pytest.mark.timeout(300)
def test_nan_stops_training_and_the_failed_ranks_error_and_log_are_shown(tmp_path):
    recipe = tmp_path / "nan_on.yaml"
    recipe.write_text(NAN_RECIPE.format(tag="on", flags="[]"))  # lr 1e20: step 2 overflows to NaN
    r = run(str(recipe), timeout=250)
    run_dir = re.search(r"\(run dir ([^ )]+)", r.stdout + r.stderr)
    try:
        assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
        real_error = (r"rank 0: FloatingPointError: iteration 2: "
                      r"the (loss is (nan|inf)|gradient of \S+ holds NaN/Inf)")
        assert re.search(real_error, r.stderr), r.stderr[-3000:]
        assert "--no-check-for-nan-in-loss-and-grad turns this check off" in r.stderr
        log = Path(re.search(r"full log: (\S+)", r.stderr).group(1))
        assert f"(run dir {log.parent} kept)" in r.stderr
        assert log.is_file() and "FloatingPointError" in log.read_text()
    finally:
        if run_dir:
            shutil.rmtree(run_dir.group(1), ignore_errors=True)


@pytest.mark.functional
@pytest.mark.timeout(300)
def test_nan_check_off_trains_through_nan(tmp_path):
    recipe = tmp_path / "nan_off.yaml"
    recipe.write_text(NAN_RECIPE.format(tag="off", flags="[--no-check-for-nan-in-loss-and-grad]"))
    r = run(str(recipe), "--run-dir", str(tmp_path / "run"), timeout=250)
    assert "FloatingPointError" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 1 and "FAIL  loss finite" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("keep", [False, True])
def test_the_pass_line_names_a_run_dir_only_while_it_exists(tmp_path, monkeypatch, capsys, keep):
    module = _run_recipe_module()
    made: list[Path] = []
    monkeypatch.setattr(module, "run_regular", lambda recipe, run_dir: made.append(run_dir)
                        or [("trained", True, "")])
    monkeypatch.setattr(module, "print_table", lambda *args: None)
    monkeypatch.setattr(module.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    assert module.main([str(ROOT / "configs" / "gpt_tiny_sync.yaml"),
                        *(["--keep"] if keep else [])]) == 0
    out = capsys.readouterr().out
    named = re.search(r"\(run dir ([^ )]+)\)", out)
    assert made and made[0].exists() == keep
    assert (named is not None) == keep and (not keep or named.group(1) == str(made[0])), out
    assert keep or "--keep keeps it" in out
