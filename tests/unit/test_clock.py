"""The running clock of our timeouts (``megatron_ckpt_ext/_clock.py``): the time a process stood
stopped (a suspended job: SIGSTOP, or its cgroup frozen) is left out, whether the beating thread
has counted the stop yet or not, in a forked child too; the writer's wait for the staged copies
runs on it (a stop longer than its timeout is not a timeout)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from megatron_ckpt_ext import _clock
from megatron_ckpt_ext.staging.ready import run_when_staged

STOP_S = 4.0  # past _clock.STOP_MIN_S + _clock.BEAT_S


def _stop_for(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)


def _measure(started, out) -> None:
    """In a forked child: the running and monotonic seconds across a window the parent stops."""
    r0, m0 = _clock.running(), time.monotonic()
    started.set()
    time.sleep(1.0 + STOP_S)  # the stop lands inside this sleep; the sleep ends at once after it
    time.sleep(0.5)
    out.put((_clock.running() - r0, time.monotonic() - m0, _clock._beating.is_alive()))


@pytest.mark.timeout(60)
def test_a_stopped_process_does_not_count_the_stop_as_running_time():
    _clock.running()  # the parent's own thread is running: the forked child must start its own
    ctx = mp.get_context("fork")
    started, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_measure, args=(started, out))
    child.start()
    assert started.wait(20)
    time.sleep(0.3)
    _stop_for(child.pid, STOP_S)
    ran, elapsed, beating = out.get(timeout=30)
    child.join(10)
    assert beating
    assert elapsed >= STOP_S + 0.5  # monotonic time counts the stop
    assert ran < elapsed - STOP_S + 1.0, (ran, elapsed)  # the running clock does not
    assert ran >= 1.0, (ran, elapsed)  # and counts the time it ran


def test_a_stop_the_beating_thread_has_not_counted_yet_is_left_out(monkeypatch):
    """Right after a continue, the trainer's thread may read the clock before the beating
    thread wakes: the overdue beat is left out at once."""
    _clock.running()
    now = time.monotonic()
    overdue = _clock.BEAT_S + _clock.STOP_MIN_S + 10.0
    monkeypatch.setattr(_clock, "_marks", (2.0, now - overdue))
    assert _clock.running() == pytest.approx(now - 2.0 - (overdue - _clock.BEAT_S), abs=0.05)
    # a beat a little late (a busy host) is running time
    monkeypatch.setattr(_clock, "_marks", (2.0, now - _clock.BEAT_S - _clock.STOP_MIN_S / 2))
    assert _clock.running() == pytest.approx(now - 2.0, abs=0.05)


def _wait_for_copies(flag, out) -> None:
    try:
        out.put(run_when_staged(flag, 1, 2.0, lambda: "written"))
    except Exception as e:  # noqa: BLE001 - the parent asserts on what came back
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.timeout(60)
def test_the_writer_waiting_for_the_staged_copies_across_a_stop_does_not_time_out():
    """The writer waits up to the save's timeout (2 s here) for the trainer's copies; the job is
    stopped for longer meanwhile, and the copies are published just after the continue."""
    flag = torch.zeros(1, dtype=torch.int64).share_memory_()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_wait_for_copies, args=(flag, out))
    child.start()
    time.sleep(0.5)
    _stop_for(child.pid, STOP_S)
    time.sleep(0.3)
    flag[0] = 1
    got = out.get(timeout=30)
    child.join(10)
    assert got == "written", got
