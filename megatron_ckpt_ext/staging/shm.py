"""The shared-memory stager: per-tensor buffer sets, the cache key that keeps reuse from going
stale, and the ready flag its writers wait on. Sealing and adopting a memory snapshot live in
:mod:`.sealing`, the device-to-host copies in :mod:`.copies`."""

from __future__ import annotations

import logging
import os
import threading
import time
from functools import partial
from typing import Any, Callable, Sequence

import torch

from .batch import StagedBatch, _Buffer, _BufferSet, _Spec
from .copies import _CopyStreams
from .ready import run_when_staged
from .retained import SealEntry
from .sealing import _Sealing
from .segments import (SHM_DIR, _ensure_fd_room, _fault_in, _forget_segment, _open_segment,
                       _register, _register_segment, _sanitize, _segment_path, _shared_segment,
                       _warn_file_system_strategy, sweep_orphans)

__all__ = ["ShmStager", "StagingKey"]

logger = logging.getLogger(__name__)

StagingKey = tuple  # per tensor: (id, shape, dtype, device, storage data_ptr, storage_offset)


class ShmStager(_Sealing, _CopyStreams):
    """Stages tensors (GPU or CPU) into per-tensor CPU shared-memory buffers."""

    owns_copies = True

    def __init__(self, *, job_id: str, rank: int, reuse: bool, pin: bool | None = None,
                 shm_dir: str = SHM_DIR, sweep: bool = True, snapshot_sets: int = 1) -> None:
        self.job_id, self.rank, self.reuse = _sanitize(job_id), rank, reuse
        # 2 (--ckpt-memory-snapshot-sets 2): a save stages into a set other than the sealed one,
        # so the last committed snapshot stays sealed while the next save stages, writes and
        # commits (twice the staging memory); 1: the next save unseals it first
        self.snapshot_sets = snapshot_sets
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.shm_dir = shm_dir
        self._sets: list[_BufferSet] = []
        self._last_key: StagingKey | None = None
        self._lock = threading.Lock()
        self._prepare_thread: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._queued: dict[torch.device, torch.cuda.Event] = {}  # (copies.py)
        self._flag: _Buffer | None = None
        self._closed = False
        self._tickets = 0  # gated writes handed out: each waits for its number in the flag
        # the buffer set of the last committed save, sealed (or being sealed) as a snapshot
        self._sealed: tuple[_BufferSet, str] | None = None  # (set, save root)
        self._seal_thread: threading.Thread | None = None
        self._seal_cancel = threading.Event()
        self._seal_lock = threading.Lock()
        self.stats = {"bytes_staged": 0, "stages": 0, "allocations": 0, "bytes_allocated": 0,
                      "rebuilds": 0, "last_rebuild_reason": None, "prepare_s": 0.0,
                      "prepare_wait_s": 0.0, "sets_built_at_stage": 0, "allocate_s": 0.0,
                      "register_s": 0.0}
        _warn_file_system_strategy()
        if sweep:
            sweep_orphans(shm_dir=shm_dir)

    # -- public ----------------------------------------------------------------------------------
    def prepare(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
                background: bool = False,
                then: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Allocate (and pin) a buffer set ahead of the first save: start-up, not critical path;
        then ``then(buffers)`` (the set's tensors in the order of ``tensors``: what the first
        save will stage into), whose error is logged, not raised.

        With ``background=True`` this returns at once; a stage() meanwhile waits for it. A
        snapshot adopted by a restore from memory and not pinned yet is pinned first."""
        self._check_open()
        self.pin_adopted()  # (the first save stages into it; nothing where none is adopted)
        specs = _specs(tensors, keys)
        if not background:
            self._join_prepare()  # (a pinning under way: its buffers may be this set's donor)
            with self._lock:
                self._prepare_locked(specs)
            self._then(specs, then)
            return
        earlier = self._prepare_thread  # still pinning an adopted snapshot: run after it
        if earlier is None or not earlier.is_alive():
            earlier = None
            self._join_prepare()
        self._prepare_thread = threading.Thread(target=self._prepare_in_background,
                                                args=(specs, then, earlier),
                                                name="mcx-staging-prepare", daemon=True)
        self._prepare_thread.start()

    def stage(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[str] | None = None,
              wait: bool = True) -> StagedBatch:
        """Copy ``tensors`` into shared memory; returns when the copies are complete, or with
        ``wait=False`` once device copies are issued (call :meth:`StagedBatch.wait` before
        anything reads the staged bytes or the sources change)."""
        self._check_open()
        self._join_prepare()
        t0 = time.perf_counter()
        keep = self._kept_sealed()
        if keep is None:
            self.unseal()  # before any byte of the sealed set changes
        specs = _specs(tensors, keys)
        with self._lock:
            buffer_set = self._acquire(specs, avoid=keep)  # never the sealed set
        staged = [buffer_set.buffers[s].tensor for s in specs]
        pending = self._copy(staged, tensors)
        if self.reuse:  # (a report of what changed: after the copies are on their way)
            with self._lock:
                self._check_key(tensors, specs)
        nbytes = sum(t.numel() * t.element_size() for t in staged)
        self.stats["bytes_staged"] += nbytes
        self.stats["stages"] += 1
        # The sources stay referenced until the copies are waited for: one freed meanwhile (a
        # temporary of the caller's state dict) could be handed out again by the caching
        # allocator and overwritten while its copy still reads it.
        batch = StagedBatch(staged, nbytes, time.perf_counter() - t0, _started=t0,
                            _pending=pending, _sources=list(tensors) if pending else [],
                            _owner=self, _set=buffer_set)
        if wait:
            batch.wait()
        return batch

    def idle_set_fits(self, tensors: Sequence[torch.Tensor], *,
                      keys: Sequence[str] | None = None) -> bool:
        """Whether :meth:`stage` of these would stage into a buffer set that is ready now (no
        allocation, no wait for a background prepare() or for a writer)."""
        thread = self._prepare_thread
        if self._closed or (thread is not None and thread.is_alive()):
            return False
        specs = _specs(tensors, keys)
        keep = self._kept_sealed()
        with self._lock:
            return any(not s.in_flight and s is not keep and s.fits(specs) for s in self._sets)

    def gate(self, write: Callable[..., Any], *, timeout_s: float) -> tuple[Callable[..., Any], int]:
        """``write`` that first waits (in the writer) until :meth:`publish` of its ticket."""
        self._tickets += 1
        return partial(run_when_staged, self.ready_flag(), self._tickets, float(timeout_s),
                       write), self._tickets

    def publish(self, ticket: int, *, ok: bool) -> None:
        """Tell the writer gated with ``ticket`` that its copies are complete (or failed)."""
        if ticket:
            self.ready_flag()[0] = ticket if ok else -ticket

    def host_bytes(self) -> int:
        """Shared memory currently held by this stager."""
        with self._lock:
            return sum(b.nbytes for s in self._sets for b in s.buffers.values())

    def segments(self) -> list[str]:
        """Paths of the shared-memory segments this stager holds."""
        with self._lock:
            return [b.path for s in self._sets for b in s.buffers.values() if b.path]

    def close(self, *, keep_sealed: bool = False) -> None:
        """Unregister, free and unlink every buffer (with ``keep_sealed``, all but those of a
        sealed snapshot, left in /dev/shm for a planned restart). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._prepare_thread is not None:
            self.hurry_pinning()
            self._prepare_thread.join()
            self._prepare_thread = None
        kept = self._finish_sealing() if keep_sealed else None
        if kept is None:
            self.unseal(wait=True)
        with self._lock:
            for s in self._sets:
                self._free_all(s.buffers.values(), unlink=s is not kept)
            self._sets.clear()
            if self._flag is not None:
                self._free_all([self._flag])
                self._flag = None

    def ready_flag(self) -> torch.Tensor:
        """A shared one-element int64 tensor (a segment like the buffers, freed by close()):
        the trainer writes a save's number there once that save's staged copies are complete,
        or its negative when they failed; :func:`run_when_staged` waits on it in the writer."""
        self._check_open()
        with self._lock:
            return self._ready_flag_locked()

    def _ready_flag_locked(self) -> torch.Tensor:
        if self._flag is None:  # not pinned: nothing is copied into it by the device
            self._flag = self._allocate(("mcx-ready-flag", (1,), torch.int64))
            self._flag.tensor.zero_()
        return self._flag.tensor

    def __enter__(self) -> ShmStager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: sweep_orphans cleans up at the next start
            pass

    # -- cache key -------------------------------------------------------------------------------
    def _kept_sealed(self) -> _BufferSet | None:
        """The sealed set no staging may touch (two snapshot sets); None with one set."""
        return self._sealed[0] if self.snapshot_sets > 1 and self._sealed is not None else None

    def _check_key(self, tensors: Sequence[torch.Tensor], specs: Sequence[_Spec]) -> None:
        key = tuple((s[0], s[1], s[2], t.device, t.untyped_storage().data_ptr(), t.storage_offset())
                    for s, t in zip(specs, tensors))
        if self._last_key is not None and key != self._last_key:
            reason = _describe(self._last_key, key)
            self.stats["rebuilds"] += 1
            self.stats["last_rebuild_reason"] = reason
            if self.rank == 0:
                logger.info("staging cache: the state changed since the last save (%s); "
                            "rebuilding the staging plan from the current tensors", reason)
        self._last_key = key

    # -- buffer sets -----------------------------------------------------------------------------
    def _prepare_locked(self, specs: list[_Spec]) -> None:
        """The sets the next saves stage into, allocated now: one, or with two snapshot sets
        two (an adopted snapshot counts as one: the next save stages into the other)."""
        fitting = sum(1 for s in self._sets if s.fits(specs) and not s.in_flight)
        if not fitting:
            self._sets.append(self._build(specs, donor=self._idle_donor()))
            fitting = 1
        for _ in range(fitting, self.snapshot_sets if self.reuse else 1):
            self._sets.append(self._build(specs, donor=None))
        self._ready_flag_locked()  # the first save's gate finds it too

    def _prepare_in_background(self, specs: list[_Spec],
                               then: Callable[[list[torch.Tensor]], None] | None,
                               earlier: threading.Thread | None = None) -> None:
        if earlier is not None:
            earlier.join()
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._prepare_locked(specs)
        except BaseException as e:  # re-raised by the next stage()/prepare()
            self._prepare_error = e
        finally:
            self.stats["prepare_s"] += time.perf_counter() - t0
        self._then(specs, then, failed=self._prepare_error is not None)

    def _then(self, specs: list[_Spec], then: Callable[[list[torch.Tensor]], None] | None, *,
              failed: bool = False) -> None:
        """``then`` with the prepared set's tensors (before any save can take the set: a
        stage() waits for the background prepare, this included), or with None where the
        allocation ``failed`` or no set fits: ``then`` runs collectives, which every rank must
        reach, whatever its allocation did."""
        if then is None:
            return
        buffers = None
        if not failed:
            with self._lock:
                chosen = next((s for s in self._sets if not s.in_flight and s.fits(specs)), None)
                buffers = [chosen.buffers[s].tensor for s in specs] if chosen is not None else None
        try:
            then(buffers)
        except Exception as e:  # noqa: BLE001 - an optimisation of the first save, never fatal
            logger.debug("staging: the step after prepare() failed: %s: %s", type(e).__name__, e)

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        """Until a background :meth:`prepare` is done (at most ``timeout_s``); whether it is.
        Its error, if any, is raised by the next stage() or prepare()."""
        thread = self._prepare_thread
        if thread is not None:  # a save waiting here waits for the allocation
            self.hurry_pinning()
            t0 = time.perf_counter()
            thread.join(timeout_s)
            self.stats["prepare_wait_s"] += time.perf_counter() - t0
            if thread.is_alive():
                return False
            self._prepare_thread = None
        return True

    def prepare_failure(self, *, take: bool = False) -> BaseException | None:
        error = self._prepare_error
        if take:
            self._prepare_error = None
        return error

    def _join_prepare(self) -> None:
        self.wait_prepared()
        if self._prepare_error is not None:
            error, self._prepare_error = self._prepare_error, None
            raise error

    def _acquire(self, specs: list[_Spec], *, avoid: _BufferSet | None = None) -> _BufferSet:
        chosen = next((s for s in self._sets
                       if not s.in_flight and s is not avoid and s.fits(specs)), None)
        if chosen is None:
            if [s for s in self._sets if s is not avoid]:  # prepared, adopted or earlier sets,
                self._say_why_no_set_fits(specs)  # none of them fitting this state
            chosen = self._build(specs, donor=self._idle_donor(avoid=avoid))
            self._sets.append(chosen)
        chosen.in_flight = True
        return chosen

    def _say_why_no_set_fits(self, specs: list[_Spec]) -> None:
        """Rank 0, INFO: a save allocates staging although buffer sets exist (the prepared or
        adopted ones do not match its tensors), with the first differences."""
        self.stats["sets_built_at_stage"] += 1
        if self.rank != 0:
            return
        idle = next((s for s in self._sets if not s.in_flight), None)
        have = set(idle.buffers) if idle is not None else set()
        missing = [s for s in specs if s not in have]
        extra = [s for s in have if s not in set(specs)]
        logger.info("staging: %d of %d tensors of this save have no buffer in the %s (%d sets, "
                    "%d busy); allocating. First missing %s; first unmatched buffer %s",
                    len(missing), len(specs), "idle set" if idle else "sets: all busy",
                    len(self._sets), sum(s.in_flight for s in self._sets),
                    missing[:2], extra[:2])

    def _idle_donor(self, *, avoid: _BufferSet | None = None) -> _BufferSet | None:
        """An idle set whose matching buffers a new set may take over (the rest is freed);
        never ``avoid`` (the sealed snapshot, with two snapshot sets)."""
        donor = next((s for s in self._sets if not s.in_flight and s is not avoid), None)
        if donor is not None:
            self._sets.remove(donor)
        return donor

    def _build(self, specs: list[_Spec], *, donor: _BufferSet | None) -> _BufferSet:
        kept = donor.buffers if donor is not None else {}
        buffers = {s: kept.pop(s) for s in specs if s in kept}
        self._free_all(kept.values())
        missing = [s for s in specs if s not in buffers]
        _ensure_fd_room(len(missing))
        for spec in missing:
            buffers[spec] = self._allocate(spec)
        if self.pin and missing:  # pinned once all are faulted in, on several threads at once
            t0 = time.perf_counter()
            done = _fault_in([buffers[s].tensor for s in missing])
            for spec in missing:
                buffer = buffers[spec]
                if buffer.path:
                    buffer.registered = _register(buffer.tensor, buffer.tensor.nbytes,
                                                  faulted_in=done)
            self.stats["register_s"] += time.perf_counter() - t0
        return _BufferSet(buffers)

    def _release(self, buffer_set: _BufferSet) -> None:
        with self._lock:
            buffer_set.in_flight = False
            sealed = self._sealed is not None and self._sealed[0] is buffer_set
            if (not self.reuse or self._closed) and not sealed and buffer_set in self._sets:
                self._sets.remove(buffer_set)
                self._free_all(buffer_set.buffers.values())

    # -- one buffer ------------------------------------------------------------------------------
    def _allocate(self, spec: _Spec) -> _Buffer:
        """One segment for ``spec``, unpinned (:meth:`_build` pins a set's fresh segments)."""
        _, shape, dtype = spec
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return _Buffer(torch.empty(shape, dtype=dtype), None)
        t0 = time.perf_counter()
        path = _segment_path(self.shm_dir, self.job_id, self.rank)
        storage = _shared_segment(path, nbytes, key=spec[0])
        _register_segment(storage, path, nbytes, reuse=self.reuse)
        tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        self.stats["allocate_s"] += time.perf_counter() - t0
        self.stats["allocations"] += 1
        self.stats["bytes_allocated"] += nbytes
        return _Buffer(tensor, path)

    def _map(self, entry: SealEntry) -> _Buffer:
        """One buffer of a sealed snapshot, mapped from its segment (adopt())."""
        dtype = _dtype(entry.dtype)
        if entry.path is None:
            return _Buffer(torch.empty(tuple(entry.shape), dtype=dtype), None)
        size = os.stat(entry.path).st_size
        if size < entry.nbytes:  # mapping past the end would fault at the first read
            raise ValueError(f"{entry.path} holds {size} bytes, the seal says {entry.nbytes}")
        storage = _open_segment(entry.path, entry.nbytes)
        _register_segment(storage, entry.path, entry.nbytes, reuse=self.reuse)
        tensor = torch.empty(0, dtype=dtype).set_(storage, 0, tuple(entry.shape))
        return _Buffer(tensor, entry.path)


    @staticmethod
    def _free_all(buffers: object, *, unlink: bool = True) -> None:
        for buffer in list(buffers):  # type: ignore[call-overload]
            if buffer.registered:
                torch.cuda.cudart().cudaHostUnregister(buffer.tensor.data_ptr())
                buffer.registered = False
            if buffer.path:
                _forget_segment(buffer.tensor.untyped_storage().data_ptr(), buffer.path,
                                unlink=unlink)
            buffer.tensor = torch.empty(0)  # drop our mapping; a holder still keeps its own

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ShmStager is closed: create a new one (Checkpointer.close() "
                               "closes its stager; do not save after close)")


# -- cache key and specs -------------------------------------------------------------------------
def _specs(tensors: Sequence[torch.Tensor], keys: Sequence[str] | None) -> list[_Spec]:
    if keys is not None and len(keys) != len(tensors):
        raise ValueError(f"stage(): {len(keys)} keys for {len(tensors)} tensors; pass one key "
                         "per tensor, or none")
    names = list(keys) if keys is not None else [str(i) for i in range(len(tensors))]
    seen: dict[str, int] = {}
    specs = []
    for name, tensor in zip(names, tensors):
        n = seen[name] = seen.get(name, 0) + 1
        specs.append((name if n == 1 else f"{name}#{n}", tuple(tensor.shape), tensor.dtype))
    return specs


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _describe(old: StagingKey, new: StagingKey) -> str:
    old_by, new_by = {e[0]: e for e in old}, {e[0]: e for e in new}
    common = set(old_by) & set(new_by)
    changes = (
        ("added", sorted(set(new_by) - set(old_by))),
        ("removed", sorted(set(old_by) - set(new_by))),
        ("reshaped", sorted(k for k in common if old_by[k][1:4] != new_by[k][1:4])),
        ("reallocated", sorted(k for k in common if old_by[k][1:4] == new_by[k][1:4]
                               and old_by[k][4:] != new_by[k][4:])),
    )
    parts = [f"{name} {keys[:3]}{'...' if len(keys) > 3 else ''}" for name, keys in changes if keys]
    return "; ".join(parts) or "order changed"
