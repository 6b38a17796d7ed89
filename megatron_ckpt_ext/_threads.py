"""Thread counts sized to the node: a rank's share of the cores it may run on.

A host running eight ranks gives each one an eighth of its cores; a pool sized for the whole host
in every rank would start eight times as many threads as there are cores, all contending. The
counts here start from :func:`cores_per_local_rank`; a value the user gave always wins, and
``None`` or ``"auto"`` (``--ckpt-load-threads auto``, its default) asks for the derived count.
Each derived count is its one-rank-per-host value capped at the rank's cores, so a host of one
rank with enough cores keeps the counts it always had.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["AUTO", "ThreadCounts", "cores_per_local_rank", "local_world_size", "thread_counts"]

AUTO = "auto"  # a count derived from the rank's cores (--ckpt-load-threads auto)

# reading threads per rank at one rank per host with 8 cores or more
_LOAD_READ_PER_HOST = 8
# threads per rank that pin a memory snapshot's buffers, and copy them at a restore from memory,
# at one rank per host with 16 cores or more
_COPY_PER_HOST = 16


def local_world_size() -> int:
    """Ranks on this host: torchrun's ``LOCAL_WORLD_SIZE``, else 1 (a bad value counts as 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def cores_per_local_rank() -> int:
    """The cores this process may run on, divided among the ranks of its host; at least 1."""
    return max(1, _usable_cores() // local_world_size())


@dataclass(frozen=True)
class ThreadCounts:
    """Threads per rank: ``load_read`` read a checkpoint's bytes at load, ``checksum`` sum them
    (and check the files the reads do not cover), ``writer`` write a save's files, ``copy`` pin
    a memory snapshot's buffers and copy them into the targets at a restore from memory."""

    cores: int
    load_read: int
    checksum: int
    writer: int
    copy: int


def thread_counts(*, load_read: int | str | None = None, checksum: int | str | None = None,
                  writer: int | str | None = None, copy: int | str | None = None,
                  cores: int | None = None) -> ThreadCounts:
    """Each count given wins (``None`` or ``"auto"``: not given); the others derive from
    ``cores`` (default :func:`cores_per_local_rank`):

    * reading threads: 8, at most the rank's cores, at least 2 (one would leave our reader
      for megatron-core's own loop, which reads the files again to verify them);
    * checksum threads: as many as reading ones, at most the rank's cores (summing is CPU work:
      more threads than cores only take turns);
    * writer threads: one (each more forks a writer process competing for the same cores);
    * copy threads: 16, at most the rank's cores (each copies and sums its chunks: CPU work).
    """
    given = {"load_read": load_read, "checksum": checksum, "writer": writer, "copy": copy}
    given = {name: None if value == AUTO else value for name, value in given.items()}
    for name, value in (*given.items(), ("cores", cores)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"thread_counts: {name} must be an integer >= 1 or {AUTO!r}, "
                             f"got {value!r}")
    cores = cores_per_local_rank() if cores is None else cores
    # at least 2 when derived: 1 means megatron-core's own loop, which reads every file a
    # second time to verify it (seen with 4 ranks on 2 cores)
    read = given["load_read"] or max(2, min(_LOAD_READ_PER_HOST, cores))
    return ThreadCounts(cores=cores, load_read=read,
                        checksum=given["checksum"] or min(read, cores),
                        writer=given["writer"] or 1,
                        copy=given["copy"] or min(_COPY_PER_HOST, cores))
