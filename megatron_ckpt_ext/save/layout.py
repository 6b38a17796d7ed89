"""The on-disk layout (Megatron's): ``<root>/iter_{iteration:07d}/`` per checkpoint, written
under ``iter_XXXXXXX.incomplete`` until rank 0 commits it, and the tracker
``<root>/latest_checkpointed_iteration.txt`` naming the newest committed one.

This module is the layout's one home: every name (:func:`checkpoint_name`, :data:`TRACKER`, the
suffixes :data:`INCOMPLETE`, :data:`DELETING`, :data:`OLD`) is spelled here and every directory
name is read back through :func:`parse_iteration`; the rest of the package asks these."""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from .._runtime import rank, warn_once
from ..collectives import Group
from ..errors import CheckpointIntegrityError, CheckpointWriteError
from ..manifest import MANIFEST, write_manifest, write_marker

__all__ = ["DELETING", "INCOMPLETE", "METADATA", "OLD", "REPORT", "TRACKER", "checkpoint_name",
           "commit_on_disk", "has_metadata", "incomplete_name", "is_committed", "iteration_number",
           "leftovers", "open_workdir", "parse_iteration", "read_tracker", "remove_torn_saves",
           "suffixed", "tracker_text", "warn_incomplete"]

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
INCOMPLETE = ".incomplete"  # a save being written; the commit renames it to iter_N
DELETING = ".deleting"  # retention's rename of iter_N before it removes the directory
OLD = ".old"  # a committed iter_N moved aside while a re-save of it commits
REPORT = "ckpt_report.jsonl"
METADATA = "metadata.json"  # megatron-core's, written by its finalize

_PREFIX = "iter_"
# exactly the names checkpoint_name writes: seven digits, or more without a leading zero
_COMMITTED = re.compile(_PREFIX + r"([0-9]{7}|[1-9][0-9]{7,})")


def checkpoint_name(root: str | os.PathLike[str], iteration: int) -> Path:
    return Path(root) / f"{_PREFIX}{iteration_number(iteration):07d}"


def iteration_number(value: Any) -> int:
    """``value`` as a checkpoint's iteration: a non-negative integer (a numpy one too), not a
    bool, a string or a float: anything else is a ValueError naming it (``iteration=-1`` made
    ``iter_-000001``, ``"2"`` failed inside a format string)."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            number = -1
        if number >= 0:
            return number
    raise ValueError(f"iteration={value!r} ({type(value).__name__}): a checkpoint's iteration "
                     "is a non-negative integer, the training step it was saved at. Fix: pass "
                     "it as an int (save(state, dir, iteration=int(step))).")


def parse_iteration(name: str) -> int | None:
    """The iteration of the committed checkpoint directory name ``iter_NNNNNNN`` (the whole
    name, as :func:`checkpoint_name` writes it), else None: a suffixed name (``.incomplete``,
    ``.deleting``, ``.old``) or any other is not a committed checkpoint's."""
    match = _COMMITTED.fullmatch(name)
    return int(match.group(1)) if match else None


def suffixed(path: Path, suffix: str) -> Path:
    """``path`` with one of the layout's suffixes (:data:`INCOMPLETE`, :data:`DELETING`,
    :data:`OLD`) appended to its name."""
    return path.with_name(path.name + suffix)


def leftovers(root: Path, suffix: str) -> list[Path]:
    """The ``iter_*<suffix>`` entries under ``root``, sorted (none when it is no directory)."""
    return sorted(root.glob(f"{_PREFIX}*{suffix}")) if root.is_dir() else []


def has_metadata(path: Path) -> bool:
    """Whether megatron-core's ``metadata.json`` is in ``path``: what the load takes for a
    committed checkpoint (the save's own test, for a re-save, is :func:`is_committed`)."""
    return (Path(path) / METADATA).exists()


def read_tracker(root: str | os.PathLike[str]) -> int | None:
    """The newest committed iteration under ``root``, or None when there is no tracker file.
    A tracker that does not hold one ASCII decimal number is a :class:`CheckpointIntegrityError`
    (a ``ValueError``) naming the file and the fix."""
    path = Path(root) / TRACKER
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:  # a directory, no permission: say what it must be
        raise OSError(e.errno, f"{path} cannot be read ({e.strerror}). The tracker must be a "
                      f"readable file holding the latest iteration: make it one ('echo N > "
                      f"{path}' for an existing {root}/iter_{{N:07d}}) or pass "
                      "load(iteration=N)") from e
    text = raw.strip()
    if not (0 < len(text) <= 12 and all(48 <= c <= 57 for c in text)):
        shown = raw[:40].decode("ascii", "backslashreplace")
        raise CheckpointIntegrityError(
            f"{path} holds {shown!r}{'...' if len(raw) > 40 else ''}, not an iteration number "
            f"(ASCII digits). The tracker is damaged: write the iteration to load into it (e.g. "
            f"'echo N > {path}' for an existing {root}/iter_{{N:07d}}), or name the iteration "
            "(Megatron-LM: --ckpt-step N; verify: --iteration N; Python: load(iteration=N)).")
    return int(text)


def incomplete_name(root: Path, iteration: int) -> Path:
    return suffixed(checkpoint_name(root, iteration), INCOMPLETE)


def tracker_text(root: Path) -> str:
    """What a failed save's message says about the checkpoint that is still the latest."""
    try:
        latest = read_tracker(root)
    except (OSError, ValueError):
        return ""
    if latest is None:
        return f" (no committed checkpoint under {root} yet)"
    return f"; the latest committed checkpoint is still iteration {latest} ({root / TRACKER})"


def commit_on_disk(root: Path, iteration: int, *,
                   on_step: Callable[[str], None] | None = None) -> None:
    """Rank 0's part of the commit, in the order that keeps the previous checkpoint loadable
    after a crash at any point: fsync every file of ``iter_N.incomplete`` and the directory,
    rename it to ``iter_N``, fsync ``root``, then rewrite the tracker (temporary file, fsync,
    rename) and fsync ``root`` again. The integrity manifest is written first, inside the
    directory, so it is committed with it. The tracker never names a directory that is not durable.
    ``on_step`` is called with ``"renamed"`` and ``"tracker_written"`` (the save's hooks)."""
    on_step = on_step or (lambda step: None)
    src, dst = incomplete_name(root, iteration), checkpoint_name(root, iteration)
    write_marker(src, iteration)
    write_manifest(src, iteration)
    for path in sorted(src.rglob("*")):  # megatron-core writes metadata and common.pt unsynced
        if path.is_file():
            _fsync(path)
    _fsync(src)
    _replace_dir(src, dst)
    on_step("renamed")
    _atomic_write(root / TRACKER, f"{iteration}\n")
    on_step("tracker_written")
    old = _aside(dst)
    if old.exists():  # a re-save of a committed iteration: its old copy goes once replaced
        shutil.rmtree(old)


def _aside(dst: Path) -> Path:
    return suffixed(dst, OLD)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` (an existing ``dst`` moves aside to :func:`_aside`) and fsync
    their parent."""
    old = _aside(dst)
    if dst.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync(dst.parent)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    """fsync a file or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def warn_incomplete(root: Path) -> None:
    """Once per root, on rank 0: name the uncommitted directories load skips."""
    names = [p.name for p in leftovers(root, INCOMPLETE)]
    if names:
        warn_once(f"incomplete:{root}",
                  f"{root}: ignoring uncommitted checkpoint directories {names} "
                  "(a save was interrupted before its commit)")


def open_workdir(record: Any, group: Group, *, new_structure: bool, validate: bool | None = None,
                 plain: list[tuple[str, Any]] = (),
                 staging_error: BaseException | None = None) -> Path:
    """Collective: rank 0 creates ``record``'s ``iter_N.incomplete``; one small all-reduce (in
    place of a barrier) tells every rank whether it could, whether any rank's structure is new
    (sets ``record.new_structure``: validating and re-planning are collectives, so all ranks must
    decide alike), whether any rank must validate its sharding (``validate``, default
    ``new_structure``; sets ``record.validate``), whether any rank holds a plain tensor
    (``plain``) and whether any rank could not stage (``staging_error``: its staging buffers
    could not be allocated): each fails the save on every rank before anything is staged."""
    workdir = incomplete_name(record.root, record.iteration)
    plain_large = [(k, t) for k, t in plain if t.numel() > 1]
    error = _make_workdir(record, workdir) if rank() == 0 and not plain_large else None
    failed, changed, check, bad_rank, unstaged = group.all_max(
        [1.0 if error is not None else 0.0, float(new_structure),
         float(new_structure if validate is None else validate),
         float(rank()) if plain_large else -1.0,
         float(rank()) if staging_error is not None else -1.0])
    record.new_structure = bool(changed)
    record.validate = bool(check)
    if unstaged >= 0:
        if rank() == 0 and workdir.exists() and error is None:
            shutil.rmtree(workdir, ignore_errors=True)
        raise staging_failed(record.iteration, int(unstaged), staging_error)
    if bad_rank >= 0:
        if rank() == 0 and workdir.exists() and error is None:
            shutil.rmtree(workdir, ignore_errors=True)
        raise ValueError(_plain_tensor_message(record.iteration, plain_large, int(bad_rank)))
    if failed:
        cause = f" ({type(error).__name__}: {error})" if error is not None else " (see rank 0)"
        raise CheckpointWriteError(
            f"checkpoint iteration {record.iteration}: cannot create {workdir} on rank 0"
            f"{cause}. Nothing was written. Fix: point the checkpoint directory (--save) at a "
            "writable directory.") from error
    return workdir


def staging_failed(iteration: int, bad_rank: int,
                   error: BaseException | None) -> CheckpointWriteError:
    """The error every rank raises when staging failed on ``bad_rank`` (``error``: this rank's
    own, chained; None on the others)."""
    cause = f"{type(error).__name__}: {error}" if error is not None else "see that rank's log"
    failure = CheckpointWriteError(
        f"checkpoint iteration {iteration}: staging failed on rank {bad_rank} ({cause}). Nothing "
        "was written; every rank stops this save. Fix: free host or shared memory on that "
        "rank's node (python -m megatron_ckpt_ext shm list; df /dev/shm), or stage less per "
        "rank (a smaller model shard, or --ckpt-node-memory-fallback sync).")
    failure.__cause__ = error
    return failure


def is_committed(root: Path, iteration: int) -> bool:
    """Whether ``iter_N`` under ``root`` is a committed checkpoint: the tracker names it, or it
    holds a manifest (ours) or ``metadata.json`` (megatron-core's). An empty or partial
    ``iter_N`` is not: Megatron-LM's ``save_checkpoint`` creates the directory before it hands
    the save over."""
    path = checkpoint_name(root, iteration)
    if not path.is_dir():
        return False
    try:
        if read_tracker(root) == iteration:
            return True
    except (OSError, ValueError):
        pass
    return (path / MANIFEST).is_file() or (path / METADATA).is_file()


def _make_workdir(record: Any, workdir: Path) -> OSError | None:
    if is_committed(record.root, record.iteration):
        logger.warning("checkpoint iteration %d under %s is already committed: this save "
                       "replaces it (atomically, at its commit)", record.iteration, record.root)
    try:
        record.root.mkdir(parents=True, exist_ok=True)
        if workdir.exists():
            _remove_torn(workdir)
        workdir.mkdir()
    except OSError as e:
        return e
    return None


def remove_torn_saves(root: Path, *, all_of_them: bool = True) -> list[str]:
    """The unfinished saves (``iter_N.incomplete``) a killed job left under ``root``, each
    renamed aside and removed on a background thread, and the removals a crash interrupted
    (``*.deleting``); the unfinished ones' names. Only while no process of ours writes there: at
    the take-over of a killed job's lock (``save/joblock.py``). Without it a save that never
    recurs (an exit checkpoint cut short by the scheduler's kill) stays on storage for good.
    ``all_of_them`` False: only those older than the tracker's iteration (a later save committed
    after them, so no writer of theirs is left), and no removal in progress; True: also the
    tracker's temporary file of a commit cut short."""
    try:
        latest = read_tracker(root)
    except (OSError, ValueError):
        latest = None
    if not all_of_them and latest is None:
        return []
    interrupted = [p for p in leftovers(root, DELETING)
                   if p.is_dir() and not p.is_symlink()] if all_of_them else []
    torn = [p for p in leftovers(root, INCOMPLETE) if p.is_dir() and not p.is_symlink()
            and (all_of_them or _iteration_of(p.name, INCOMPLETE) < latest)]
    for path in torn:
        _remove_torn(path)
    for path in interrupted:
        threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                         name="mcx-remove-torn", daemon=True).start()
    for path in root.glob(f".{TRACKER}.tmp*") if all_of_them else ():  # _atomic_write's, cut
        with contextlib.suppress(OSError):
            path.unlink()
    return [p.name for p in torn]


def _iteration_of(name: str, suffix: str) -> float:
    it = parse_iteration(name[:-len(suffix)]) if name.endswith(suffix) else None
    return float("inf") if it is None else it


def _remove_torn(workdir: Path) -> None:
    """An earlier save's ``iter_N.incomplete`` (a crash during its write) is renamed to
    ``iter_N.incomplete.deleting`` and removed on a background thread, off the save's path (a
    ~1B model's 12 GB took 2.9 s there); a crash meanwhile leaves it to the start-up's
    ``finish_interrupted``. Where that name is taken, it is removed here."""
    aside = suffixed(workdir, DELETING)
    if aside.exists():
        shutil.rmtree(workdir)
        return
    os.rename(workdir, aside)
    threading.Thread(target=shutil.rmtree, args=(aside,), kwargs={"ignore_errors": True},
                     name="mcx-remove-torn", daemon=True).start()


def _plain_tensor_message(iteration: int, plain: list[tuple[str, Any]], bad_rank: int) -> str:
    if not plain:
        return (f"checkpoint iteration {iteration}: rank {bad_rank}'s state dict holds plain "
                "torch tensors (see that rank's error for their keys). Nothing was written.")
    key, t = plain[0]
    more = f" (and {len(plain) - 1} more: {[k for k, _ in plain[1:4]]})" if len(plain) > 1 else ""
    return (
        f"checkpoint iteration {iteration}: '{key}' is a plain torch.Tensor of shape "
        f"{tuple(t.shape)}{more}, not a megatron-core ShardedTensor. megatron-core would save "
        "it as common state from rank 0 alone, dropping every other rank's values. Nothing was "
        "written. Fix: wrap it, e.g. ShardedTensor.from_rank_offsets(key, t, replica_id=dp_rank) "
        "for a tensor replicated over data-parallel ranks, or ShardedTensor.from_rank_offsets("
        "key, t, (axis, rank, world_size)) for one split along an axis. Plain Python numbers and "
        "one-element tensors stay common state.")
