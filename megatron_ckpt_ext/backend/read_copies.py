"""How a load's reading threads (:mod:`.load_reader`) get their host chunks to the device: each
thread copies on a stream of its own, and the pinned chunk a copy came from goes back to the
pool once the copy has landed. A thread reads its next chunk while its last one's copy runs; it
used to wait for each copy (19 % of the reading threads' time in an 8 GiB load on one H200,
``h2d_s`` in the load report), and it holds at most ``IN_FLIGHT + 1`` chunks at a time, so a
pool of two a reading thread never runs dry for want of a chunk only a blocked thread would
give back."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from . import direct_read

__all__ = ["IN_FLIGHT", "copies_landed", "host_chunks", "in_flight", "release_when_copied",
           "thread_stream"]

# copies a reading thread leaves in flight while it reads on
IN_FLIGHT = 1

_local = threading.local()


def thread_stream(device: Any) -> Any:
    """This thread's copy stream on ``device``, ordered after the default stream's work (the
    targets' allocation and fills)."""
    import torch

    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    stream = streams[device]
    stream.wait_stream(torch.cuda.default_stream(device))
    return stream


def host_chunks(threads: int, checksum_threads: int) -> Any:
    """The shared pinned pool: two chunks a reading thread (the one it reads into and the one
    whose copy is in flight), one more a summing thread (the one in its hands)."""
    return direct_read.PinnedChunks.shared(2 * threads + checksum_threads, pin=True)


def release_when_copied(copied: Any, chunks: Any, buf: Any, busy: Any) -> None:
    """``buf`` back to ``chunks`` once the event ``copied`` has passed (a summing thread, after
    its sum); the wait counts as ``busy``'s host-to-device time."""
    t = time.perf_counter()
    try:
        copied.synchronize()
    finally:
        chunks.give(buf)
    busy.add("h2d", t)


def _pending() -> collections.deque:
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = collections.deque()
    return pending


def in_flight(copied: Any, chunks: Any, buf: Any, busy: Any) -> None:
    """``buf``'s copy was issued (``copied`` records it): it goes back to ``chunks`` once the
    copy has landed; this thread waits only where more than ``IN_FLIGHT`` of its copies are."""
    _pending().append((copied, chunks, buf))
    copies_landed(busy, keep=IN_FLIGHT)


def copies_landed(busy: Any, keep: int = 0) -> None:
    """This thread's chunks whose copies have landed go back to their pool; the oldest are
    waited for until at most ``keep`` are in flight (0: all of them, at the end of a stripe)."""
    pending = _pending()
    while pending and (len(pending) > keep or pending[0][0].query()):
        copied, chunks, buf = pending.popleft()
        release_when_copied(copied, chunks, buf, busy)
