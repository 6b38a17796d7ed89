"""The command line's own output only: importing torch (with nvidia-resiliency-ext's pynvml
installed, torch warns that pynvml is deprecated) prints nothing before a `shm` or `verify`
answer."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "megatron_ckpt_ext", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_shm_list_prints_its_listing_and_no_import_warnings(tmp_path):
    r = _cli("shm", "list", "--dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "0 sealed snapshot(s)" in r.stdout
    assert "Warning" not in r.stderr, r.stderr


def test_verify_of_nothing_says_so_and_no_import_warnings(tmp_path):
    r = _cli("verify", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2
    assert "not a checkpoint directory" in r.stdout + r.stderr
    assert "Warning" not in r.stderr, r.stderr
