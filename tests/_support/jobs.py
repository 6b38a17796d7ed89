"""A job run the way a test needs it: a command in its own session (a torchrun and every rank it
starts, and their writers), killed whole when it outlives its timeout, so a hang fails the test
with the job's output and leaves no process behind. The timeout must stay below pytest-timeout's
(300 s, pyproject.toml): that one ends the test without killing anything."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import pytest

__all__ = ["run_job"]


def run_job(cmd: list[str], *, timeout: float = 240.0, check: bool = True,
            **popen: Any) -> subprocess.CompletedProcess:
    """Run ``cmd`` (stdout and stderr captured, text); on a timeout kill its process group and
    fail the test with the output's tail; ``check``: a non-zero exit fails it too."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every process it started
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout:.0f} s:\n"
                    f"{out[-2000:]}{err[-4000:]}")
    finally:
        if proc.poll() is None:  # the test itself was interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                    f"{out[-2000:]}{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
