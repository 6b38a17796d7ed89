"""The command line refuses what it cannot do, naming the argument and the fix, exit 2: a
path that does not exist, a checkpoint directory given with another --iteration, no workers,
a shared-memory directory that does not exist."""

import subprocess
import sys

import pytest

from megatron_ckpt_ext import verify_cli

pytestmark = pytest.mark.unit


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_verify_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    assert verify_cli.run(str(tmp_path / "nowhere")) == 2
    assert "nowhere: no such directory" in capsys.readouterr().err


def test_verify_of_a_checkpoint_directory_with_another_iteration_is_refused(tmp_path, capsys):
    path = tmp_path / "iter_0000010"
    path.mkdir()
    (path / "metadata.json").write_text("{}")
    assert verify_cli.run(str(path), iteration=20) == 2
    err = capsys.readouterr().err
    assert "is a checkpoint directory (iteration 10)" in err, err
    assert f"Pass the save root ({tmp_path}) with --iteration 20" in err, err
    assert verify_cli._checkpoint(path, 10) == path  # its own iteration: accepted


def test_verify_needs_a_worker_and_shm_a_directory_that_exists(tmp_path):
    r = _cli("verify", str(tmp_path), "--workers", "0", cwd=tmp_path)
    assert r.returncode == 2 and "argument --workers: 0: must be at least 1" in r.stderr
    r = _cli("shm", "list", "--dir", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert r.returncode == 2 and "nowhere: no such directory (--dir" in r.stderr, r.stderr
    r = _cli("shm", "--help", cwd=tmp_path)
    assert "clean: remove the snapshots of ended runs" in r.stdout
