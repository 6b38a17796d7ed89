"""Preemption (``--exit-signal-handler``): a signal (SIGTERM from SLURM or Kubernetes, or
``--exit-signal``) is noted by a handler; at the next iteration boundary the ranks agree that one
of them saw it (:meth:`Preemption.agree`, one small all-reduce), the loop checkpoints that
iteration and leaves, and the close waits until it is durable. Rank 0 says when the exit
checkpoint starts whether it is expected to be durable within ``--ckpt-preempt-grace-s``, and
reports the time from the signal to durable. The writers ignore the signal (a job-wide one
reaches them too, as SLURM's and a terminal's Ctrl-C do): their rank stops them once the exit
checkpoint is durable (``_runtime.ignore_job_signals``).

The handler chains the one it replaces (Megatron-LM's ``DistributedSignalHandler`` through the
adapter; not Python's SIGINT handler, whose KeyboardInterrupt would stop a save
halfway) and is removed at close.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from ._runtime import note_exit_signal, rank
from .options import CkptOptions

__all__ = ["Preemption"]

logger = logging.getLogger(__name__)


class Preemption:
    """The exit checkpoint is the first save *started* after the ranks agreed that the signal
    came (after it was seen, where the loop never asks, as in Megatron-LM's own loop through the
    adapter): a regular save still in flight then commits first and is not it. The signal's time
    on every rank is the agreement's time less the oldest rank's signal age, so rank 0 reports
    even when only another rank was signalled."""

    def __init__(self, options: CkptOptions) -> None:
        self.signal_name = options.exit_signal
        self.grace_s = options.ckpt_preempt_grace_s
        self.received_at: float | None = None  # time.monotonic() of the first signal here
        self.agreed_at: float | None = None
        self.signal_age_s: float | None = None  # at agreement, the oldest rank's signal age
        self.exit_iteration: int | None = None  # the first save started after the agreement
        self.durable_after_s: float | None = None
        self.durable_iteration: int | None = None
        self._signum = getattr(signal, options.exit_signal)
        self._previous: Any = None
        self._installed = False
        self._loop_agrees = False  # the loop calls agree(); else save_started() agrees
        note_exit_signal(options.exit_signal)  # writers forked from now on ignore it
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self._signum, self._on_signal)
            self._installed = True
        elif rank() == 0:
            logger.warning("--exit-signal-handler: the Checkpointer was built off the main "
                           "thread, where Python cannot install a signal handler: %s is not "
                           "handled", self.signal_name)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
        # Python's own SIGINT handler raises KeyboardInterrupt wherever the rank stands (mid-save
        # too): the handler replaces it; any other (Megatron-LM's) is chained.
        if callable(self._previous) and self._previous is not signal.default_int_handler:
            self._previous(signum, frame)

    def agree(self, group: Any, *, estimate_s: float | None) -> bool:
        """Collective: whether any rank has received the signal. The first time they agree,
        rank 0 says what happens next and, with a grace window, whether the checkpoint that
        follows is expected to be durable in time (``estimate_s``: the last save's time from
        save() to durable, None before any)."""
        self._loop_agrees = True
        if self.agreed_at is not None:
            return True
        if not self._agree_now(group):
            return False
        if rank() == 0:
            logger.warning("%s received %.1f s ago (--exit-signal-handler): checkpointing at "
                           "this iteration boundary, then exiting once it is durable%s",
                           self.signal_name, self.signal_age_s,
                           self._forecast(self.signal_age_s, estimate_s))
        return True

    def _agree_now(self, group: Any) -> bool:
        """Collective (one small all-reduce): the oldest signal age over the ranks; notes the
        agreement when some rank has one."""
        now = time.monotonic()
        age = now - self.received_at if self.received_at is not None else -1.0
        oldest, = group.all_max([age])
        if oldest < 0:
            return False
        self.agreed_at, self.signal_age_s = now, oldest
        return True

    def save_started(self, iteration: int, group: Any) -> None:
        """Every rank, at the start of each save: the first save started after the agreement is
        the exit checkpoint. Where the loop never calls :meth:`agree`, the ranks agree here
        (collective, only until the exit checkpoint is known)."""
        if self.exit_iteration is not None:
            return
        if self.agreed_at is None and not self._loop_agrees:
            self._agree_now(group)
        if self.agreed_at is not None:
            self.exit_iteration = iteration

    def _forecast(self, age: float, estimate_s: float | None) -> str:
        if self.grace_s is None:
            return ""
        left = self.grace_s - age
        if estimate_s is None:
            return (f"; {left:.1f} s of the {self.grace_s} s grace window left "
                    "(--ckpt-preempt-grace-s), no save measured yet to say whether it fits")
        verdict = ("it should make it" if estimate_s < left else
                   "it will likely NOT be durable before the kill: the previous checkpoint "
                   "stays the latest")
        return (f"; the last save took {estimate_s:.1f} s to be durable and {left:.1f} s of the "
                f"{self.grace_s} s grace window are left (--ckpt-preempt-grace-s): {verdict}")

    def committed(self, iteration: int) -> None:
        """A checkpoint was committed: rank 0 reports the exit checkpoint's time from the signal
        (on whichever rank it came first) to durable."""
        if iteration != self.exit_iteration or self.durable_after_s is not None:
            return
        signalled_at = self.agreed_at - self.signal_age_s  # both set once exit_iteration is
        self.durable_after_s = time.monotonic() - signalled_at
        self.durable_iteration = iteration
        if rank() == 0:
            within = ("" if self.grace_s is None else
                      f", {'within' if self.durable_after_s <= self.grace_s else 'OVER'} the "
                      f"{self.grace_s} s grace window")
            logger.warning("exit checkpoint iteration %d durable %.2f s after %s%s", iteration,
                           self.durable_after_s, self.signal_name, within)

    def report_durable(self) -> None:
        """At close: say so when a signal was agreed on but no exit checkpoint was committed."""
        if self.agreed_at is None or self.durable_after_s is not None or rank() != 0:
            return
        if self.exit_iteration is None:
            logger.warning("%s was received but no checkpoint was started after it (no save "
                           "was made before the exit)", self.signal_name)
        else:
            logger.warning("%s was received but the exit checkpoint (iteration %d) was not "
                           "committed", self.signal_name, self.exit_iteration)

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(self._signum, self._previous if self._previous is not None
                          else signal.SIG_DFL)
            self._installed = False
