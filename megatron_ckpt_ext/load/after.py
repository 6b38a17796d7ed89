"""The work a load leaves to background threads (the first save's staging and planning, pinning
an adopted snapshot, releasing what a restore did not take), started as the load returns or, in
:func:`deferred`, once the caller's whole load is done.

Megatron-LM's ``load_checkpoint`` goes on after our load returns: the model's and the
optimizer's ``load_state_dict`` (hundreds of short calls that each drop and take back the GIL).
Background threads running Python meanwhile held each of those calls up for a switch interval
(5 ms): after a restore from memory on one H100 those two steps took 46-52 ms instead of 14-22
ms (docs/MEMORY.md, twelfth session). The launcher runs Megatron-LM's whole ``load_checkpoint``
in :func:`deferred`, so that work starts after it, beside the training that follows; a save
waits for it as before. ``MCX_BACKGROUND_IN_LOAD=1`` starts it inside the load again.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

from ..debug import env_switch

__all__ = ["after_load", "deferred"]

_local = threading.local()


def after_load(work: Callable[[], None], *, always: bool = False) -> None:
    """Run ``work`` now, or, inside :func:`deferred` on this thread, when it ends: in order,
    and only if the deferred block ended without an error unless ``always`` (releases)."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        work()
    else:
        pending.append((work, always))


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold the loads' background work on this thread until the block ends (a nested block
    leaves it to the outermost; ``MCX_BACKGROUND_IN_LOAD=1``: not held)."""
    if getattr(_local, "pending", None) is not None or env_switch("MCX_BACKGROUND_IN_LOAD") == "1":
        yield
        return
    _local.pending = []
    ok = False
    try:
        yield
        ok = True
    finally:
        pending, _local.pending = _local.pending, None
        for work, always in pending:
            if ok or always:
                work()
