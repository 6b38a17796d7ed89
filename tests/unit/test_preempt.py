"""Preemption (--exit-signal-handler): which checkpoint is the exit's, the signal-to-durable time
rank 0 reports, and SIGINT handled without a KeyboardInterrupt."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.preempt import Preemption
from megatron_ckpt_ext.save.layout import read_tracker
from tests._support.dist import sharded

LOGGER = "megatron_ckpt_ext"


class _Group:
    """The all-reduce of the agreement, as the other ranks would answer it."""

    def __init__(self, others_age: float = -1.0) -> None:
        self.others_age, self.calls = others_age, 0

    def all_max(self, values):
        self.calls += 1
        return [max(values[0], self.others_age)]


@pytest.fixture()
def preemption():
    p = Preemption(CkptOptions(exit_signal_handler=True))
    yield p
    p.uninstall()


def test_a_regular_save_in_flight_at_the_agreement_is_not_the_exit_checkpoint(preemption,
                                                                               caplog):
    caplog.set_level("WARNING", logger=LOGGER)
    group = _Group()
    preemption.save_started(295, group)  # a regular save, in flight when the signal comes
    preemption._on_signal(signal.SIGTERM, None)
    assert preemption.agree(group, estimate_s=None)
    preemption.save_started(296, group)  # the exit checkpoint
    preemption.committed(295)  # the regular one commits first, after the agreement
    assert preemption.durable_iteration is None and "exit checkpoint" not in caplog.text
    preemption.committed(296)
    assert preemption.durable_iteration == 296
    assert "exit checkpoint iteration 296 durable" in caplog.text


def test_signal_to_another_rank_only_rank_0_reports_the_exit_iteration_and_time(preemption,
                                                                                caplog):
    """Rank 0 never saw the signal: its time comes from the agreement (the oldest rank's age)."""
    caplog.set_level("WARNING", logger=LOGGER)
    group = _Group(others_age=5.0)  # rank 1 got it 5 s before this boundary
    assert preemption.received_at is None and preemption.agree(group, estimate_s=None)
    preemption.save_started(40, group)
    preemption.committed(40)
    assert preemption.durable_iteration == 40
    assert 5.0 <= preemption.durable_after_s < 5.0 + 30
    preemption.report_durable()
    assert "exit checkpoint iteration 40 durable 5." in caplog.text, caplog.text
    assert "no checkpoint" not in caplog.text


def test_where_the_loop_never_agrees_the_first_save_after_the_signal_is_the_exit(preemption):
    """Megatron-LM's own loop (through the adapter) saves on the signal without asking."""
    group = _Group()
    preemption.save_started(10, group)
    assert preemption.exit_iteration is None and group.calls == 1  # no signal yet anywhere
    group.others_age = 1.0  # another rank got it
    preemption.save_started(11, group)
    preemption.save_started(12, group)
    assert preemption.exit_iteration == 11 and group.calls == 2  # decided once, then no more


def test_sigint_as_the_exit_signal_raises_no_keyboard_interrupt():
    p = Preemption(CkptOptions(exit_signal_handler=True, exit_signal="SIGINT"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs at the next bytecode boundary: no KeyboardInterrupt
        assert p.received_at is not None
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler



def test_the_handler_installed_before_ours_still_sees_the_signal_and_the_first_signal_counts():
    """A handler the trainer installed first (Megatron-LM's own --exit-signal-handler, which
    makes its loop save and exit) is chained, with the signal's number; a second signal does not
    reset the time of the first (the grace window runs from the first)."""
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    p = Preemption(CkptOptions(exit_signal_handler=True, exit_signal="SIGUSR1"))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        first = p.received_at
        assert first is not None and seen == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert seen == [signal.SIGUSR1] * 2 and p.received_at == first
    finally:
        p.uninstall()
        signal.signal(signal.SIGUSR1, before)


def test_checkpointer_reports_the_exit_checkpoint_not_the_save_in_flight(tmp_path,
                                                                        one_rank_group, caplog):
    """Through the Checkpointer: save 3 is still pending at the signal and commits inside save
    4, the exit checkpoint, whose signal-to-durable time rank 0 logs."""
    caplog.set_level("WARNING", logger=LOGGER)
    options = CkptOptions(async_save=True, exit_signal_handler=True)
    state = lambda step: sharded(0, 1, {"w": torch.arange(256.0) + step})  # noqa: E731
    with Checkpointer(options) as ck:
        ck.save(state(3), tmp_path, iteration=3)  # not finalized: in flight
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert ck.preempted()
        ck.save(state(4), tmp_path, iteration=4)
    assert read_tracker(tmp_path) == 4
    exits = [r.getMessage() for r in caplog.records if "exit checkpoint" in r.getMessage()]
    assert len(exits) == 1 and exits[0].startswith("exit checkpoint iteration 4 durable "), exits
    assert float(exits[0].split()[5]) >= 0.05


def test_a_writer_spawned_for_the_job_survives_the_job_wide_signal_from_its_first_instant():
    """SIGTERM sent the instant the writer is spawned (it is still starting Python, long before
    it runs a line of ours) neither kills it nor is lost to the trainer."""
    import multiprocessing as mp

    from megatron_ckpt_ext._runtime import forks_die_with_this_process
    from tests.unit import _preempt_child

    from megatron_ckpt_ext.backend.async_queue import _start_resource_tracker

    _start_resource_tracker()  # as the persistent worker's spawn does (persistent_worker_forks)
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with forks_die_with_this_process():
            child = mp.get_context("spawn").Process(target=_preempt_child.first_request)
            child.start()
            os.kill(child.pid, signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's: pending, delivered after
        child.join(timeout=60)
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert child.exitcode == 0, child.exitcode
    assert got == [signal.SIGTERM]
