"""Save steps that fail on every rank alike: each step of a save's finalization (megatron-core's
metadata, our commit) and its planning end in one small all-reduce (:func:`run_agreed`), so a step
that fails on one rank alone (a full disk under rank 0's metadata or commit) fails on every rank
at the same point, instead of leaving the others in the step's next collective."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from .. import backend
from .._runtime import rank
from ..collectives import Group
from ..errors import CheckpointWriteError

__all__ = ["SaveStepFailed", "agreed_finalize", "run_agreed"]


class SaveStepFailed(CheckpointWriteError):
    """A step of a save (its planning, a step of its finalization) failed on some rank; raised
    on every rank, naming it. ``raised``: what the step raised on this rank, if it did (None:
    a deferred write of its, or another rank, failed)."""

    def __init__(self, text: str, raised: BaseException | None = None) -> None:
        super().__init__(text)
        self.raised = raised


def agreed_finalize(request: Any, group: Group) -> Any:
    """``request`` whose finalization steps (megatron-core's metadata, our commit) each end in
    :func:`run_agreed`, so a step one rank alone fails in fails on every rank at the same point:
    the save is then abandoned everywhere before the next save's first collective."""
    return request._replace(finalize_fns=[partial(run_agreed, fn, group)
                                          for fn in request.finalize_fns])


def run_agreed(fn: Callable[[], Any], group: Group) -> Any:
    """Collective: run ``fn`` on every rank, then one small all-reduce says whether it raised on
    any; if so raise :class:`SaveStepFailed` on every rank, naming the failing ranks' errors.
    ``fn`` must reach its own collectives on every rank: the writes one rank makes alone inside
    megatron-core's save and finalization (a full disk under rank 0) are deferred to here
    (:func:`backend.lone_writes_deferred`), and our commit agrees itself. The object collectives
    ``fn`` runs on the default group run on the group's host (gloo) group where there is one
    (:func:`backend.object_collectives_on`)."""
    errors: list[BaseException] = []
    result, raised = None, None
    with backend.lone_writes_deferred(errors), \
            backend.object_collectives_on(group.world_control()):
        try:
            result = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is one
            raised = e
    errors = [raised, *errors] if raised is not None else errors
    if not group.all_max([float(bool(errors))])[0]:
        return result
    texts = group.all_gather(_failure_text(errors[0]) if errors else None)
    raise SaveStepFailed(_agreed_text(texts), raised) from (errors[0] if errors else None)


def _failure_text(e: BaseException) -> tuple[int, str]:
    """(rank: 0 its own failure, 1 an agreed one, 2 an echo of a peer's; the text). A
    CheckpointException names each failing rank itself; its empty copy on the other ranks only
    echoes the coordinator's."""
    failures = getattr(e, "failures", None)
    if isinstance(e, SaveStepFailed):
        return 1, str(e)
    if isinstance(failures, dict):
        return (0 if failures else 2), backend.checkpoint_failure_text(e)
    return 0, f"rank {rank()}: {backend.checkpoint_failure_text(e)}"


def _agreed_text(texts: list[tuple[int, str] | None]) -> str:
    """The failing ranks' texts, the most telling kind first, each once (at most three)."""
    found = [t for t in texts if t is not None]
    best = min(kind for kind, _ in found)
    chosen = list(dict.fromkeys(text for kind, text in found if kind == best))
    more = f" (and {len(chosen) - 3} more ranks)" if len(chosen) > 3 else ""
    return "; ".join(chosen[:3]) + more
