"""The one seam where tests, fault-injection harnesses and tracers act on a save.

Pass a :class:`SaveHooks` subclass to ``Checkpointer(hooks=...)``; every method is a no-op here.
A save calls :meth:`SaveHooks.at` at each point of :data:`POINTS` (on every rank, on the
trainer's thread, except ``renamed`` and ``tracker_written``: rank 0 only) and
:meth:`SaveHooks.wrap_request` once with the write request before it goes to the writer, so a
harness can hold, fail or trace a save at a chosen point without patching the package's private
methods.
"""

from __future__ import annotations

from typing import Any, Sequence

from .debug import env_switch, trace_event, traced_request

__all__ = ["POINTS", "SaveHooks", "WriterTrace", "chain", "writer_trace"]

# Roughly in the order a save reaches them ("copies_landed" comes before "planned" where the
# writer must read the staged bytes while planning).
POINTS = (
    "staged",           # the device-to-host copies are issued (async saves)
    "planned",          # megatron-core returned the save request
    "scheduled",        # the request is with the writer (async) or written (sync)
    "copies_landed",    # this save's staged copies are in host memory
    "before_commit",    # every rank's write finished; nothing is renamed yet (collective next)
    "renamed",          # rank 0: iter_N.incomplete is iter_N (the tracker still names the old)
    "tracker_written",  # rank 0: the tracker names iter_N
    "committed",        # the commit's last barrier passed
)


class SaveHooks:
    """Default: nothing. Raising from :meth:`at` fails the save at that point as a crash would
    there (before ``before_commit`` returns: the previous checkpoint stays the latest)."""

    def at(self, point: str, record: Any) -> None:
        """Called at ``point`` (one of :data:`POINTS`) of the save described by ``record``
        (:class:`~megatron_ckpt_ext.save.report.SaveRecord`: iteration, root, phases)."""

    def wrap_request(self, request: Any, record: Any) -> Any:
        """The write request for this save (megatron-core's AsyncRequest, a NamedTuple: change
        it with ``request._replace(async_fn=...)``; what it runs must pickle for a spawned
        writer). Applied inside the staging gate: nothing of it runs before the copies landed."""
        return request


class _Chain(SaveHooks):
    def __init__(self, hooks: Sequence[SaveHooks]) -> None:
        self.hooks = list(hooks)

    def at(self, point: str, record: Any) -> None:
        for hook in self.hooks:
            hook.at(point, record)

    def wrap_request(self, request: Any, record: Any) -> Any:
        for hook in self.hooks:
            request = hook.wrap_request(request, record)
        return request


def chain(*hooks: SaveHooks | None) -> SaveHooks:
    """One hook object running ``hooks`` in order (None entries are skipped)."""
    present = [h for h in hooks if h is not None]
    if len(present) == 1:
        return present[0]
    return _Chain(present)


class WriterTrace(SaveHooks):
    """``MCX_WRITER_TRACE=<dir>`` (docs/DEBUGGING.md): the writer's preload and write, and the
    trainer's ``scheduled`` and ``committed``, as lines of ``<dir>/writer_trace.jsonl``."""

    def __init__(self, folder: str, rank: int) -> None:
        self.folder, self.rank = folder, rank

    def at(self, point: str, record: Any) -> None:
        if point in ("scheduled", "committed"):
            trace_event(self.folder, point, rank=self.rank, iteration=record.iteration)

    def wrap_request(self, request: Any, record: Any) -> Any:
        return traced_request(request, self.folder, rank=self.rank)


def writer_trace(rank: int) -> WriterTrace | None:
    """The trace hooks when ``MCX_WRITER_TRACE`` names a folder, else None."""
    folder = env_switch("MCX_WRITER_TRACE")
    return WriterTrace(folder, rank) if folder else None
