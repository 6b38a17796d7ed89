"""Where a save's blocking phases wait for the device (``MCX_SYNC_POINTS``, docs/DEBUGGING.md):
torch's CUDA sync debug mode around one save, each synchronizing call's stack kept with the save
phases finished by then."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

__all__ = ["sync_points"]

_SYNC_TEXT = "synchronizing CUDA operation"  # torch's warning under set_sync_debug_mode("warn")


@contextlib.contextmanager
def sync_points(folder: str, label: str, rank: int, record: Any) -> Iterator[list]:
    """Within this block torch's CUDA sync debug mode is on ("warn"): every call that waits for
    the device warns, and each warning's Python stack (innermost 8 frames) is kept with the save
    phases ``record`` had finished by then; at the end one JSON line per save is appended to
    ``<folder>/sync_points_rank<rank>.jsonl``. Where a save's blocking phases wait for the copies
    they should overlap shows up here. Without CUDA the mode cannot be set: only warnings raised
    otherwise are kept. Yields the list of points."""
    import traceback
    import warnings

    import torch

    points: list[dict] = []
    original = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if _SYNC_TEXT not in str(message):
            original(message, category, filename, lineno, *rest)
            return
        stack = traceback.extract_stack()[:-1][-8:]
        points.append({"after_phases": list(getattr(record, "phases", None) or {}),
                       "stack": [f"{f.filename}:{f.lineno} {f.name}" for f in stack]})

    settable = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if settable else 0
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        if settable:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield points
        finally:
            if settable:
                torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = original
            Path(folder).mkdir(parents=True, exist_ok=True)
            with open(Path(folder) / f"sync_points_rank{rank}.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"label": label, "cuda": settable, "points": points}) + "\n")
