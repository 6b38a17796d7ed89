"""Rank bodies of ``test_cuda_ordering.py`` (CUDA only; a module of its own so spawned ranks can
import it). They run the real copy stream, events and optimizer hook of the staging path; the
only test code around them makes the timing deterministic (a long kernel queued where the race
would be) and, for the contrast runs, removes the one ordering call under test: both in a
ShmStager subclass each rank passes as ``Checkpointer(stager=...)``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.staging import ShmStager
from megatron_ckpt_ext.staging.batch import _Copies

from tests._support.dist import sharded

BIG = 64 << 20  # fp32 elements: 256 MiB per rank
STEPS = (1, 2, 3)


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond, measured with a spin kernel (for :func:`_spin`)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def _spin(ms: float, per_ms: float) -> None:
    """Queue a kernel that keeps the current stream busy for about ``ms`` (the host goes on)."""
    torch.cuda._sleep(int(ms * per_ms))


def _stager(cls: type[ShmStager], rank: int, options: dict) -> ShmStager:
    """``cls`` built as the Checkpointer's own stager would be for ``options``."""
    return cls(job_id=str(os.getppid()), rank=rank,
               reuse=bool(options.get("ckpt_assume_constant_structure")))


def _load_matches(ck: Checkpointer, rank: int, world: int, root: str, like: torch.Tensor) -> list:
    out = []
    for step in STEPS:
        got = ck.load(sharded(rank, world, {"big": torch.zeros_like(like)}), root, iteration=step)
        out.append(bool(torch.equal(got["big"], torch.full_like(like, float(step)))))
    return out


def producer_before_staging(rank: int, world: int, root: str, options: dict, mutate: bool,
                            out: str) -> None:
    """Each save's values are produced by a kernel on the current stream that is still queued
    (behind 300 ms of other work) when staging issues its copies: the copy stream must wait for
    it. The producer is queued at the stager's stage() call, not before save(): save()'s first
    collective (an NCCL all-reduce read back on the host) already waits for the current stream,
    which would hide a copy stream that does not. ``mutate``: the copy stream does not wait
    (the contrast run). Writes, per rank, whether each checkpoint holds its save's values."""
    per_ms = _cycles_per_ms()
    big = torch.zeros(BIG, device="cuda")
    now = {"step": 0}

    class ProducerAtStage(ShmStager):
        def stage(self, tensors, **kwargs):  # type: ignore[no-untyped-def]
            _spin(300, per_ms)  # the producer's inputs: long work on the current stream...
            big.fill_(float(now["step"]))  # ...then the kernel that writes the saved values
            return super().stage(tensors, **kwargs)

    class CopyStreamThatDoesNotWait(ProducerAtStage):
        def _copy_stream(self, device):  # type: ignore[no-untyped-def]
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            stream = self._streams[device]
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            return stream, start

    stager = _stager(CopyStreamThatDoesNotWait if mutate else ProducerAtStage, rank, options)
    with Checkpointer(CkptOptions(**options), stager=stager) as ck:
        ck.prepare(sharded(rank, world, {"big": big}))
        ck.wait_prepared()
        for step in STEPS:
            now["step"] = step
            ck.save(sharded(rank, world, {"big": big}), root, iteration=step)
            big.fill_(-7.0)  # training goes on
            ck.maybe_finalize()
        ck.maybe_finalize(blocking=True)
        matches = _load_matches(ck, rank, world, root, big)
    Path(out, f"result{rank}.json").write_text(json.dumps({"matches": matches}))


def optimizer_step_after_overlapped_save(rank: int, world: int, root: str, options: dict,
                                         mutate: bool, out: str) -> None:
    """--ckpt-overlap-snapshot: save() returns with the device-to-host copies in flight (made
    slow here: 3 s of work queued on the copy stream before them, as a large state's copies
    would take); the optimizer step that follows (SGD, lr 1, grad 1: the parameter becomes
    step - 1) must run after them: every checkpoint holds its save's values. ``mutate``: the
    step pre-hook does not make the current stream wait (the contrast run). Writes, per rank,
    whether each save returned with its copies in flight and each checkpoint's match."""
    per_ms = _cycles_per_ms()
    param = torch.nn.Parameter(torch.zeros(BIG, device="cuda"))
    param.grad = torch.ones_like(param)
    opt = torch.optim.SGD([param], lr=1.0)
    streams: list = []

    class SlowCopies(ShmStager):
        def _copy_stream(self, device):  # type: ignore[no-untyped-def]
            stream, start = super()._copy_stream(device)
            with torch.cuda.stream(stream):
                _spin(3000, per_ms)
            streams.append(stream)
            return stream, start

    class Unordered(_Copies):
        def order_before_current_stream(self) -> None:
            """The step pre-hook's wait, removed."""

    class SlowCopiesNothingWaitsFor(SlowCopies):
        def _copy(self, staged, tensors):  # type: ignore[no-untyped-def]
            return [Unordered(c.start, c.end, c.device) for c in super()._copy(staged, tensors)]

    stager = _stager(SlowCopiesNothingWaitsFor if mutate else SlowCopies, rank, options)
    in_flight = []
    with Checkpointer(CkptOptions(**options), stager=stager) as ck:
        ck.prepare(sharded(rank, world, {"big": param.detach()}))
        ck.wait_prepared()
        for step in STEPS:
            with torch.no_grad():
                param.fill_(float(step))
            ck.save(sharded(rank, world, {"big": param.detach()}), root, iteration=step)
            in_flight.append(not streams[-1].query())
            opt.step()  # the training step right after the save changes the parameter
            ck.maybe_finalize()
        ck.maybe_finalize(blocking=True)
        matches = _load_matches(ck, rank, world, root, param.detach())
    Path(out, f"result{rank}.json").write_text(json.dumps({"matches": matches,
                                                           "in_flight": in_flight}))
