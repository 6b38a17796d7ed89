"""A stand-in writer for tests/unit/test_preempt.py: spawned, it ignores the job's termination
signals at the start of its first request, as the persistent worker's warm-up does."""

from __future__ import annotations

import os
import signal
import sys
import time


def first_request() -> None:
    from megatron_ckpt_ext._runtime import ignore_job_signals

    ignore_job_signals()
    os.kill(os.getpid(), signal.SIGTERM)  # ignored now, not merely blocked
    time.sleep(0.2)
    unblocked = signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    sys.exit(0 if unblocked and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN else 3)
