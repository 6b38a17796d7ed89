"""A load, step by step: megatron-core's load of the located checkpoint, read in parallel
(``--ckpt-load-threads``), with its manifest check running beside it on every rank's share of
the files; on a mismatch raise naming the files, or with ``--ckpt-load-fallback`` load the newest
older checkpoint that verifies. Every step is collective."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from .. import _crc_device, backend
from .._runtime import rank, warn_once
from .._threads import thread_counts
from ..collectives import Group
from ..errors import CheckpointIntegrityError, CheckpointLoadError
from ..options import CkptOptions
from ..save.layout import checkpoint_name, parse_iteration, read_tracker
from ..save.planner import copy_structure
from .report import LoadRecord
from .verify import agree as verify_agree
from ..manifest import MANIFEST
from .locate import another_iteration
from .verify import committed_before, missing_manifest, verify_collectively
from .verify import start as verify_start

__all__ = ["Loader", "read_ahead"]

logger = logging.getLogger(__name__)


def read_ahead(options: CkptOptions, root: Path, *, pin_chunks: bool) -> None:
    """Before a load of ``root``, while the model is built (``Checkpointer.prepare_restore``),
    where ``root`` has a committed checkpoint (its tracker) and ``pin_chunks`` (the load will
    read storage; not where the node's memory restores it), else nothing (it would only slow the
    model build: docs/MEMORY.md): the device CRC a verifying load sums with is built, and, with
    parallel reads, the items' layouts in this rank's files of it are parsed (the load's
    metadata step) and, in a process using CUDA, the pinned chunks the reads copy through are
    made, each on a thread of its own (a process's first load paid both: docs/node/README.md)."""
    import torch

    try:
        tracked = read_tracker(root)
    except (ValueError, OSError):  # a damaged or unreadable tracker: the load says so
        tracked = None
    if tracked is None or not pin_chunks:  # nothing committed (a first start with --load =
        return  # --save), or restored from memory (a storage load after a refusal sums on the host)
    _crc_device.warm_up_current(options)
    threads = thread_counts(load_read=options.ckpt_load_threads)
    if threads.load_read <= 1:
        return
    iteration = tracked
    backend.parse_layouts_ahead(checkpoint_name(root, iteration), rank())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        backend.pin_chunks_ahead(threads.load_read, threads.checksum)


class Loader:
    """Loads one checkpoint for a Checkpointer (``load_strategy``: megatron-core's, built late)."""

    def __init__(self, options: CkptOptions, group: Group, *,
                 load_strategy: Callable[[], Any]) -> None:
        self.options, self._group, self._load_strategy = options, group, load_strategy

    def load(self, sharded_state_dict: Any, path: Path, record: LoadRecord, *,
             explicit: bool, metadata: Any = None) -> dict:
        """Collective: megatron-core's load of ``path`` with its manifest check running beside
        it; on a mismatch, raise, or with the fallback load the newest older that verifies.
        ``metadata``: ``path``'s DCP ``Metadata`` where the caller has unpickled it already."""
        record.path, record.iteration = path, parse_iteration(path.name)  # a located iter_N
        t = time.perf_counter()
        verify = self.options.ckpt_verify_load
        if not verify and rank() == 0 and (missing := missing_manifest(path)):
            warn_once(f"unverified:{path}", f"checkpoint iteration {record.iteration}: {missing};"
                      " loading it unverified (--no-ckpt-verify-load).")
        # reading threads as asked ("auto": from this rank's share of the cores), checksum
        # threads at most that share; every comparison below reads the resolved counts
        threads = thread_counts(load_read=self.options.ckpt_load_threads)
        # the files the load's own reads sum as they pass are not read a second time
        pending = (verify_start(path, self._group, rank=rank(), workers=threads.checksum,
                                defer=threads.load_read > 1) if verify else None)
        settings = backend.ReadSettings(
            threads.load_read, checksums=pending is not None and pending.checks,
            checksum_threads=threads.checksum,
            metadata={str(path): metadata} if metadata is not None else None,
            on_planned=pending.skip if pending is not None else None, device_checksums=True,
            agreed_failures=True)  # _failed_ranks, below
        state, failure, reads = self._read(sharded_state_dict, path, settings, pending)
        if failure is None:
            _note_reads(record, reads)
        t = record.phase("other_s", t)
        if pending is not None:
            pending.check_inline(reads.file_crcs, reads.planned_files)
        has_manifest, problems = (verify_agree(pending, self._group, record.verify_detail,
                                               failed=failure is not None)
                                  if pending else (False, []))
        record.phase("verify_s", t)  # the part of the check the load did not hide
        uncovered = list((pending.manifest or {}).get("unverified", [])) if pending else []
        record.verified = has_manifest and not problems and not uncovered
        if uncovered and not problems and rank() == 0:
            warn_once(f"uncovered:{path}", f"checkpoint iteration {record.iteration}: "
                      f"{len(uncovered)} file(s) have no checksum in its manifest and load "
                      f"unchecked ({', '.join(uncovered[:4])}{' ...' if len(uncovered) > 4 else ''}"
                      "): their writer recorded none (MCX_WRITE_CHECKSUMS=0, or a writer the "
                      "checksum wrapper does not reach)")
        failed = _failed_ranks(failure, self._group,  # every rank's, where any failed
                               any_failed=pending.any_failed if pending is not None else None)
        if failed and not problems:  # (a damaged file explains a failure: the fallback below)
            _raise_on_every_rank(failed, failure, record, path)
        if not problems:
            return state
        return self._fall_back(sharded_state_dict, path, record, problems, explicit=explicit)

    def _read(self, sharded_state_dict: Any, path: Path, settings: backend.ReadSettings,
              pending: Any) -> tuple[dict | None, BaseException | None, backend.ReadResult]:
        """Collective: megatron-core's load of ``path``, read as ``settings`` say: (the state,
        None, how it was read), or with a manifest check beside it (``pending``) (None, the
        failure, ...) when the load fails: the check may say which file broke it."""
        load_strategy = self._load_strategy()
        reads = backend.ReadResult()
        try:
            with backend.parallel_reads(settings) as reads:
                if pending is not None and reads.why_not is not None:
                    pending.release()
                if reads.why_not is not None and settings.threads > 1 and rank() == 0:
                    logger.info("--ckpt-load-threads: %s; loading with megatron-core's own "
                                "reader", reads.why_not)
                # without megatron-core's sharding validation (a collective and a walk of every
                # shard): prepare(), right after the load, or the first save validates the same
                # structure (a save never writes unvalidated); a load reads right without it
                return (backend.call_with_supported(
                    backend.dist_checkpointing().load, copy_structure(sharded_state_dict),
                    str(path), load_strategy, validate_access_integrity=False), None, reads)
        except (KeyboardInterrupt, SystemExit):
            raise
        # a damaged file can fail the load itself (torch raises CheckpointException, a
        # BaseException): say which file, when the check finds it; and a failure on one rank
        # fails the load on every rank (_failed_ranks), as no DCP collective may tell them
        except BaseException as e:  # noqa: BLE001
            return None, e, reads
        finally:
            backend.discard_layouts()  # what was parsed ahead served this load
            if pending is not None:
                pending.release()

    def _fall_back(self, sharded_state_dict: Any, path: Path, record: LoadRecord,
                   problems: list[str], *, explicit: bool) -> dict:
        unverifiable = any(p.startswith(f"{MANIFEST}: missing") for p in problems)
        what = (f"checkpoint iteration {record.iteration} ({path}) "
                + ("cannot be verified" if unverifiable else
                   "does not match its integrity manifest")
                + f": {'; '.join(problems[:8])}{' ...' if len(problems) > 8 else ''}")
        if explicit or not self.options.ckpt_load_fallback:
            fixes = ([f"restore {MANIFEST}", "pass --no-ckpt-verify-load to load it unverified"]
                     if unverifiable else ["restore those files"])
            if not explicit:
                fixes.append("pass --ckpt-load-fallback to load the newest older checkpoint "
                             "that verifies")
            fixes.append(another_iteration(path.parent, below=record.iteration))
            raise CheckpointIntegrityError(
                f"{what}. The loaded values are not to be trusted. Fix: "
                f"{', '.join(fixes[:-1])}, or {fixes[-1]}")
        skipped: list[str] = []
        for older in committed_before(path.parent, record.iteration):
            candidate = checkpoint_name(path.parent, older)
            has_manifest, bad = verify_collectively(candidate, self._group, rank=rank())
            if bad:
                skipped.append(f"{older} ({'; '.join(bad[:2])}{' ...' if len(bad) > 2 else ''})")
            else:
                passed = (f"; skipped, not verifying either: {', '.join(skipped)}" if skipped
                          else "")
                warn_once(f"fallback:{path}", f"{what}; --ckpt-load-fallback: loading iteration "
                          f"{older} instead ({'verified' if has_manifest else 'no manifest'})"
                          f"{passed}.")
                fell_back_from = record.iteration
                state = self.load(sharded_state_dict, candidate, record, explicit=True)
                record.fell_back_from = fell_back_from
                return state
        raise CheckpointIntegrityError(
            f"{what}, and no older committed checkpoint under {path.parent} verifies "
            "(--ckpt-load-fallback). Fix: restore the files the errors name (their checkpoints "
            "then verify), or pass --no-ckpt-verify-load to load the latest unverified.")


def _note_reads(record: LoadRecord, reads: backend.ReadResult) -> None:
    """Split megatron-core's load into the reader's steps; say once why items went stock."""
    record.add_reads(reads.metadata_s, reads.read_s, reads.h2d_s,
                     direct_items=reads.direct_items, stock_items=reads.stock_items,
                     device_summed_bytes=reads.device_summed_bytes,
                     sums_wait_s=reads.sums_wait_s, sum_device_busy_s=reads.sum_device_busy_s)
    if reads.stock_items and rank() == 0:
        logger.info("%d of %d checkpoint items were read the stock way (unpickled, then "
                    "copied): %s", reads.stock_items, reads.stock_items + reads.direct_items,
                    reads.why_stock)


# a rank whose read failed: (its rank, megatron-core's structure mismatch or None, the failure
# in short)
_Failed = tuple[int, "str | None", str]


def _failed_ranks(failure: BaseException | None, group: Group, *,
                  any_failed: bool | None = None) -> list[_Failed]:
    """Collective: every rank whose read failed (:data:`_Failed`); empty where none did.
    ``any_failed``: whether any did, where a collective already said so (the verification's
    agreement), else an all_max asks. torch DCP planned over the group (megatron-core <= 0.16)
    raises on every rank when one fails, but planned on each rank alone (0.19: ``no_dist``)
    nothing tells the others: they would train on, or wait in their next collective."""
    if any_failed is None:
        any_failed = (failure is not None if group.size() == 1 else
                      group.all_max([float(failure is not None)])[0] > 0)
    if not any_failed:
        return []
    mine = None if failure is None else (
        rank(), _structure_mismatch(failure), f"{type(failure).__name__}: {failure}"[:400])
    return [entry for entry in group.all_gather(mine) if entry is not None]


def _raise_on_every_rank(failed: list[_Failed], failure: BaseException | None,
                         record: LoadRecord, path: Path) -> None:
    """Raise on this rank the load error every rank raises: where any rank's state does not fit
    the checkpoint, the CheckpointLoadError that says so; else this rank's own failure. A rank
    whose own read went through names the ranks that failed."""
    ranks = sorted(r for r, _, _ in failed)
    where = ("" if failure is not None else
             f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
    # this rank's own mismatch first (its entry's, worked out once by _failed_ranks)
    mismatch = next((m for r, m, _ in sorted(failed, key=lambda f: f[0] != rank())
                     if m is not None), None)
    if mismatch is not None:
        raise CheckpointLoadError(
            f"checkpoint iteration {record.iteration} ({path}) does not fit the state "
            f"this job builds{where}: {mismatch}. The model (or its parallel layout's "
            "sharding) differs from the run that saved it. Fix: build it with that "
            "run's model arguments (--num-layers, --hidden-size, --ffn-hidden-size, "
            "--num-attention-heads, --vocab-size, ...), or start from scratch into "
            "another --save without --load.") from failure
    if failure is not None:
        raise failure
    raise CheckpointLoadError(
        f"checkpoint iteration {record.iteration} ({path}) failed to load{where} "
        f"({failed[0][2]}); this rank's load is discarded with theirs. Fix: see that rank's "
        "error in its log.")


def _structure_mismatch(failure: BaseException) -> str | None:
    """megatron-core's reason, where it refused the checkpoint for the state's structure (a
    tensor of another global shape, one the checkpoint lacks), on any rank; else None."""
    causes, seen = [failure], set()
    while causes:
        e = causes.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if e.__cause__ is not None:
            causes.append(e.__cause__)
        failures = getattr(e, "failures", None)  # torch DCP: {rank: (exception, traceback)}
        if isinstance(failures, dict):  # its own text holds their tracebacks: read theirs
            found = [v[0] if isinstance(v, tuple) else v for v in failures.values()]
            causes += [f for f in found if isinstance(f, BaseException)]
            continue
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if "shape mismatch" in text or "from model not in state dict" in text:
            return text.strip().splitlines()[0][:400]
    return None
