"""The plugin's own small collectives over the checkpoint process group.

Each is bounded by ``--distributed-timeout-minutes`` when set (else by the process group's own
timeout), counted in the time this process ran (``_clock``: a job suspended whole while a rank
waits in one does not time it out at the continue), and each caller reads its result on the
host right after, so the bound adds no synchronisation. They run on the host, never on the
device: over a group whose only backend is NCCL (Megatron-LM's world) they run on a gloo group of
the same ranks, made once at the first of them (:meth:`Group.control`), whose own timeout is long
(our bound decides; gloo's would count the stop). Over NCCL each would copy its bytes to the
device and read the result back, and that read, issued while a save's device-to-host copies are
in flight, waits behind them on the copy engine: planning, which those copies should overlap,
waited for all of them. One that runs out raises on the rank that waited:
:class:`CheckpointLoadError` inside ``Checkpointer.load`` (or the ``load/`` rooms),
:class:`CheckpointWriteError` elsewhere (a save, its finalization, the job lock). Without an
initialised process group (one process) every call is local.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import sys
from typing import Any, Iterator

import torch

from . import _clock, backend
from .errors import CheckpointLoadError, CheckpointWriteError
from .options import CkptOptions

__all__ = ["Group"]

logger = logging.getLogger(__name__)

_UNSET = object()
_BACKGROUND_TIMEOUT_S = 120  # background_control(): a peer that never comes
_SLICE_S = 5.0  # a bounded wait is re-armed this often, its bound read on _clock each time
# the gloo group made for an NCCL world: its own timeout (gloo's, on the host's clock) only backs
# up our bound, so that a suspension does not fail the collective inside gloo
_CONTROL_GROUP_TIMEOUT = datetime.timedelta(days=7)
_DEFAULT_TIMEOUT = getattr(getattr(torch.distributed, "constants", None), "default_pg_timeout",
                           datetime.timedelta(minutes=30))


class Group:
    """``process_group`` (None: the world) as the checkpoint's collectives use it."""

    def __init__(self, process_group: Any, options: CkptOptions) -> None:
        self.process_group = process_group
        self.options = options
        self._control: Any = _UNSET
        self._world_control: Any = _UNSET
        self._background: Any = _UNSET
        self._cap_s: float | None = None  # capped(): the bound of every wait inside

    @staticmethod
    def initialized() -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def size(self) -> int:
        return torch.distributed.get_world_size(self.process_group) if self.initialized() else 1

    def rank(self, global_rank: int) -> int:
        """This process's rank within the group (``global_rank`` without a process group)."""
        if not self.initialized():
            return global_rank
        return torch.distributed.get_rank(self.process_group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, picklable), in group rank order (collective: two
        all-gathers, its pickle's length then its bytes, as ``all_gather_object`` does, but each
        waited for like the others, so it is bounded too)."""
        if not self.initialized() or self.size() == 1:  # a group of one: nothing to exchange
            return [obj]
        group, device = self.control(), self._device()
        mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.size())]
        self.wait(torch.distributed.all_gather(sizes, size, group=group, async_op=True))
        lengths = [int(n.item()) for n in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        padded[:mine.numel()] = mine
        out = [torch.empty_like(padded) for _ in lengths]
        self.wait(torch.distributed.all_gather(out, padded, group=group, async_op=True))
        return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, lengths)]

    def all_max(self, values: list[float]) -> list[float]:
        """Element-wise max of ``values`` over the group (collective)."""
        return self._all_reduce(values, torch.distributed.ReduceOp.MAX if self.initialized()
                                else None)

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over the group (collective)."""
        return self._all_reduce(values, torch.distributed.ReduceOp.SUM if self.initialized()
                                else None)

    def barrier(self) -> None:
        if self.initialized() and self.size() > 1:
            self.wait(torch.distributed.barrier(group=self.control(), async_op=True))

    @contextlib.contextmanager
    def capped(self, seconds: float | None) -> Iterator[None]:
        """Every wait of this group meanwhile (on any thread) at most ``seconds`` (None: no
        cap), or less where ``--distributed-timeout-minutes`` is: the collectives of a close
        after an error, where the ranks may have left their common order (docs/RELIABILITY.md)."""
        earlier, self._cap_s = self._cap_s, seconds
        try:
            yield
        finally:
            self._cap_s = earlier

    def wait(self, work: Any) -> None:
        """Wait for one of our collectives, at most ``--distributed-timeout-minutes`` when set
        (else the process group's own timeout), or :meth:`capped`'s bound."""
        timeout = self.options.distributed_timeout()
        if self._cap_s is not None:
            cap = datetime.timedelta(seconds=self._cap_s)
            timeout = cap if timeout is None else min(timeout, cap)
        if timeout is None and not self._bounds_control_group():
            work.wait()
            return
        if timeout is None:  # our group's own timeout is long: the bound is torch's default
            timeout = _DEFAULT_TIMEOUT
        if self._on_nccl():  # no gloo group could be made: one wait, as NCCL may abort its
            self._wait_once(work, timeout)  # communicator when a wait runs out
            return
        bound, start = timeout.total_seconds(), _clock.running()
        while True:
            left = bound - (_clock.running() - start)
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(0.001, min(left, _SLICE_S))))
                return
            except RuntimeError as e:
                if not _is_timeout(e):
                    raise  # a peer that crashed: the backend's own message says so
                if work.is_completed():  # ended meanwhile, or by the backend's own timeout
                    self._wait_once(work, timeout)  # its outcome (at once: it is complete)
                    return
                if _clock.running() - start < bound:
                    continue  # the slice ran out, not the bound (or a stop ate it)
                raise self._timed_out(e) from e

    def _wait_once(self, work: Any, timeout: datetime.timedelta) -> None:
        try:
            work.wait(timeout=timeout)
        except RuntimeError as e:
            if not _is_timeout(e):
                raise
            raise self._timed_out(e) from e

    def _on_nccl(self) -> bool:
        return (self._control is not _UNSET and self.initialized()
                and torch.distributed.get_backend(self._control) == "nccl")

    def _bounds_control_group(self) -> bool:
        """Whether :meth:`control` is a group we made (its own timeout long: ours bounds it)."""
        return self._control is not _UNSET and self._control is not self.process_group

    def _timed_out(self, error: RuntimeError) -> CheckpointWriteError | CheckpointLoadError:
        """The error of a wait that ran out: a load's or a save's, by what this thread runs."""
        if self._cap_s is not None:
            return CheckpointWriteError(
                f"a checkpoint collective of a close after an error did not complete within "
                f"{self._cap_s:g} s: some rank did not reach it (it left the ranks' common order "
                f"of collectives when the error came, or has not come to its close) ({error})")
        within = (f"within --distributed-timeout-minutes {self.options.distributed_timeout_minutes}"
                  " (config key 'distributed_timeout_minutes')")
        stack = "its stack shows where: py-spy dump --pid <pid>; please report it"
        if _during_load():
            return CheckpointLoadError(
                f"a collective of the checkpoint load did not complete {within}: some rank did "
                "not reach it, either because it is still inside an earlier step of the load "
                f"(reading or verifying its share of the files; {stack}) or because the training "
                "script does not call load() on every rank alike (it is collective: every rank "
                "loads, from the same directory and iteration). The state loaded so far is not "
                f"to be trusted: load again before training ({error}).")
        return CheckpointWriteError(
            f"a checkpoint collective did not complete {within}: some rank did not reach it, "
            "either because it is still inside an earlier step of a checkpoint "
            f"({stack}) or because the training loop does not call save() and maybe_finalize() "
            f"on every rank alike ({error}).")

    def _all_reduce(self, values: list[float], op: Any) -> list[float]:
        # a group of one reduces to its own values: no round trip through a backend (at one
        # rank that is part of every save's blocking, and the wait gives the GIL away)
        if op is None or self.size() == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        self.wait(torch.distributed.all_reduce(t, op=op, group=self.control(), async_op=True))
        return t.tolist()

    def control(self) -> Any:
        """The process group the collectives above run on, with host tensors: ``process_group``
        itself where its backends include one for the CPU (gloo), else a gloo group of the same
        ranks, made at the first call (collective: every rank of the group reaches our
        collectives alike, so it reaches this too) and kept. Where gloo cannot be made, the
        given group, with one warning on rank 0, and device tensors (:meth:`_device`)."""
        if self._control is _UNSET:
            self._control = self._make_control()
        return self._control

    def world_control(self) -> Any:
        """The host group of :meth:`control` where it spans the whole world, so it can stand in
        for the default group (:func:`backend.object_collectives_on`); else None. Found once."""
        if not self.initialized():
            return None
        if self._world_control is _UNSET:
            control, spans = self.control(), None
            if control is not None and self._device().type == "cpu":
                spans = len(torch.distributed.get_process_group_ranks(control))
            # None: the default group itself, or no gloo group could be made
            self._world_control = (control if spans == torch.distributed.get_world_size()
                                   else None)
        return self._world_control

    def background_control(self) -> Any:
        """Collective, on every rank of the world (the first call): a gloo group of the whole
        world for one background thread's collectives (planning the first save ahead,
        :meth:`SavePlanner.plan_ahead`), apart from the groups the training and our saves use,
        with a short timeout (a peer that never comes fails it, not the job). Made once and kept;
        None without a process group, for a group that is not the world, or where gloo cannot
        be made."""
        if self._background is _UNSET:
            self._background = None
            if (self.initialized() and self.size() == torch.distributed.get_world_size()):
                try:
                    self._background = torch.distributed.new_group(
                        backend="gloo", timeout=datetime.timedelta(seconds=_BACKGROUND_TIMEOUT_S))
                except (RuntimeError, ValueError) as e:
                    logger.debug("no gloo group for background collectives: %s", e)
        return self._background

    def background_copy(self, group: Any) -> Any:
        """Collective on ``group``'s members (every rank calls it, each for its own group): a
        gloo group of the same ranks in the same order for the thread of
        :meth:`background_control`, with its short timeout, made once per group and kept; None
        where it cannot be made so (ranks not in ascending order, no group made by its members
        alone, gloo failing)."""
        copies = self.__dict__.setdefault("_copies", {})
        if group in copies:
            return copies[group]
        copies[group] = None
        ranks = torch.distributed.get_process_group_ranks(group)
        if ranks == sorted(ranks) and backend.accepted_kwargs(
                torch.distributed.new_group, {"use_local_synchronization": True})[0]:
            try:
                copies[group] = torch.distributed.new_group(
                    ranks=ranks, backend="gloo", use_local_synchronization=True,
                    timeout=datetime.timedelta(seconds=_BACKGROUND_TIMEOUT_S))
            except (RuntimeError, ValueError) as e:
                logger.debug("no gloo copy of a group for background collectives: %s", e)
        return copies[group]

    def _make_control(self) -> Any:
        kind = str(torch.distributed.get_backend(self.process_group))
        if "gloo" in kind or "mpi" in kind:
            return self.process_group
        ranks = torch.distributed.get_process_group_ranks(
            self.process_group or torch.distributed.group.WORLD)
        whole_world = len(ranks) == torch.distributed.get_world_size()
        kwargs: dict[str, Any] = {"backend": "gloo", "timeout": _CONTROL_GROUP_TIMEOUT}
        if not whole_world:  # only the group's ranks reach our collectives
            if not backend.accepted_kwargs(torch.distributed.new_group,
                                           {"use_local_synchronization": True})[0]:
                return self._no_control(kind, "this torch's new_group cannot make a group "
                                        "that only its members create")
            kwargs["use_local_synchronization"] = True
        try:
            return torch.distributed.new_group(ranks=ranks, **kwargs)
        except (RuntimeError, ValueError) as e:
            return self._no_control(kind, str(e))

    def _device(self) -> torch.device:
        """The CPU, except where :meth:`control` could only fall back to an NCCL group."""
        if torch.distributed.get_backend(self.control()) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _no_control(self, kind: str, why: str) -> Any:
        if torch.distributed.get_rank() == min(torch.distributed.get_process_group_ranks(
                self.process_group or torch.distributed.group.WORLD)):
            logger.warning(
                "megatron-ckpt-ext: no gloo group for the checkpoint's own collectives (%s); "
                "they run on the %s group instead, and each read of their result waits for the "
                "save's device-to-host copies in flight.", why, kind)
        return self.process_group


def _is_timeout(error: RuntimeError) -> bool:
    return "timed out" in str(error).lower() or "timeout" in str(error).lower()


_LOAD_ROOM = f"{__package__}.load."
_CHECKPOINTER = f"{__package__}.checkpointer"


def _during_load() -> bool:
    """Whether this thread runs a load: ``Checkpointer.load`` or a module of ``load/`` is on its
    stack. Read only once a wait has run out, to name the journey in the error."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_LOAD_ROOM) or (module == _CHECKPOINTER
                                             and frame.f_code.co_name == "load"):
            return True
        frame = frame.f_back
    return False
