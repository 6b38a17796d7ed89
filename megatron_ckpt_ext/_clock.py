"""The clock our own timeouts run on: monotonic seconds during which this process was not stopped.

A cluster stops a job whole and continues it later: SLURM's ``scontrol suspend`` and preemption
by suspension (SIGSTOP to every process of the job, or its cgroup frozen), a container's pause.
``time.monotonic()`` keeps counting through the stop, so a bound taken from it (``--ckpt-timeout``
on a save in flight, the start watch of a forked writer) expires for work that stood still, and
the save fails at the resume. A frozen cgroup delivers no signal to its processes, so the stop is
seen on the clock, not through SIGCONT: a daemon thread ("mcx-clock") sleeps ``BEAT_S`` at a time
and counts as stopped every wake-up later than asked by more than ``STOP_MIN_S``.

What it cannot tell apart: a process whose threads were not scheduled for more than
``STOP_MIN_S`` (a host overloaded that far) is taken as stopped for that time, so a bound runs
that much longer; a stop shorter than ``STOP_MIN_S`` counts as running time.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["BEAT_S", "STOP_MIN_S", "running"]

BEAT_S = 0.5
STOP_MIN_S = 3.0

# (seconds stopped so far, monotonic time of the last beat): one tuple, replaced whole by the
# beating thread, so a reader needs no lock (none is held across a fork either).
_marks: tuple[float, float] = (0.0, 0.0)
_beating: threading.Thread | None = None
_start_lock = threading.Lock()


def _late(beat: float, now: float) -> float:
    """Seconds the beat is overdue by, counted only past ``STOP_MIN_S``."""
    late = now - beat - BEAT_S
    return late if late > STOP_MIN_S else 0.0


def _beat() -> None:
    global _marks
    while True:
        time.sleep(BEAT_S)
        stopped, beat = _marks
        now = time.monotonic()
        _marks = (stopped + _late(beat, now), now)


def _ensure_beating() -> None:
    global _beating, _marks
    if _beating is not None:
        return
    with _start_lock:
        if _beating is None:
            _marks = (_marks[0], time.monotonic())
            thread = threading.Thread(target=_beat, name="mcx-clock", daemon=True)
            thread.start()
            _beating = thread


def _forget_in_child() -> None:
    """A forked child has no beating thread (and maybe a held start lock): the next reading
    starts its own."""
    global _beating, _start_lock
    _beating, _start_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def running() -> float:
    """Monotonic seconds less the time this process was seen stopped, including a stop that
    ended just now and the beating thread has not counted yet. Only differences mean anything;
    it starts the beating thread on first use."""
    _ensure_beating()
    stopped, beat = _marks
    now = time.monotonic()
    return now - stopped - _late(beat, now)
