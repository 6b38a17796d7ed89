"""Sealing, adopting and discarding the memory snapshot of a committed save (the format and
the files are :mod:`.retained`'s): the half of :class:`~.shm.ShmStager` that keeps a buffer set
alive past its save, so a restarted job restores from memory instead of reading storage."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..debug import env_switch
from ..errors import SnapshotInUse
from .batch import StagedBatch, _Buffer, _BufferSet, _Spec
from .retained import (Seal, SealEntry, any_mapped, crc32_all, discard, remove_seal,
                       sealer_alive, write_seal)
from .segments import _register, is_mapped

__all__ = ["mapped_elsewhere"]


SETTLE_S = 2.0  # how long a dead sealer's children (its writer) may take to let go of them


def mapped_elsewhere(seal: Seal, *, settle_s: float = SETTLE_S) -> bool:
    """Whether another live process maps any of ``seal``'s segments (holds its shared flock). A
    seal this process wrote is its own (an in-process restart: a closed Checkpointer's mappings
    may still be alive here); for any other, asked while this process maps none of them. Where
    the process that sealed it has ended, its writer may still be dying (it gets SIGKILL when
    its trainer dies): up to ``settle_s`` is given for the segments to be let go."""
    if seal.host == socket.gethostname() and seal.pid == os.getpid():
        return False
    deadline = time.monotonic() + (0.0 if sealer_alive(seal) else settle_s)
    while any_mapped(seal, is_mapped):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False

logger = logging.getLogger(__name__)


class _Sealing:
    """Mixed into :class:`~.shm.ShmStager`, whose buffer sets, lock, ``_map``, ``_free_all`` and
    ``_check_open`` it uses: the buffer set of the last committed save, sealed (or being sealed)
    as a snapshot."""

    partner: Any = None  # a staging.partner.PartnerLink (--ckpt-memory-partner), set by its owner
    _pin_started: Any = None  # the adopted set pin_adopted() handed to a thread (once per set)
    _pin_hurry: threading.Event | None = None  # set: a save or close waits, pin at full speed

    if TYPE_CHECKING:
        rank: int
        reuse: bool
        pin: bool
        shm_dir: str
        _sets: list[_BufferSet]
        _lock: threading.Lock
        _sealed: tuple[_BufferSet, str] | None
        _seal_thread: threading.Thread | None
        _seal_cancel: threading.Event
        _seal_lock: threading.Lock
        _prepare_thread: threading.Thread | None
        _prepare_error: BaseException | None
        stats: dict

    def seal(self, batch: StagedBatch, *, root: str, iteration: int, world: int,
             layout: Sequence[tuple], manifest_crc32: str | None,
             structure: tuple[str, list] = ("", [])) -> None:
        """After ``batch``'s save committed: keep its buffers as the snapshot of that checkpoint
        (``structure``: the digest of the save's validated structure and its items that are not
        tensors, :meth:`SavePlanner.digest`).
        The buffers' CRC-32s are computed on a background thread; the seal is written when they
        are, unless the next stage() unsealed first."""
        buffer_set = batch._set
        if buffer_set is None or len(layout) != len(batch.tensors):
            return
        self.unseal()
        specs = {id(b.tensor): spec for spec, b in buffer_set.buffers.items()}
        paths = {id(b.tensor): b.path for b in buffer_set.buffers.values()}
        entries = [SealEntry(key=k, offset=list(o), shape=list(sh), dtype=dt,
                             spec=specs[id(t)][0], path=paths[id(t)],
                             nbytes=t.numel() * t.element_size())
                   for (k, o, sh, dt), t in zip(layout, batch.tensors)]
        seal = Seal(root=os.path.realpath(root), rank=self.rank, world=world,
                    iteration=iteration, manifest_crc32=manifest_crc32, entries=entries,
                    structure=structure[0], objects=structure[1], device_peak=_device_peak())
        self._sealed = (buffer_set, seal.root)
        self._seal_cancel = threading.Event()
        self._seal_thread = threading.Thread(
            target=self._write_seal, args=(seal, list(batch.tensors), self._seal_cancel),
            name="mcx-seal", daemon=True)
        self._seal_thread.start()

    def _write_seal(self, seal: Seal, tensors: list[torch.Tensor],
                    cancel: threading.Event) -> None:
        crcs = crc32_all(tensors, cancelled=cancel)
        with self._seal_lock:
            if crcs is None or cancel.is_set():
                return
            for entry, crc in zip(seal.entries, crcs):
                entry.crc32 = crc
            try:
                write_seal(seal, self.shm_dir)
            except OSError as e:  # no snapshot then: a restart reads storage
                if not getattr(self, "_seal_failed_said", False):  # each process once: a
                    self._seal_failed_said = True  # full /dev/shm fails every save alike
                    logger.warning(
                        "rank %d: could not seal the staging buffers of iteration %d as a "
                        "snapshot (%s); until a seal succeeds a restart reads storage (said "
                        "once). Fix: free /dev/shm (python -m megatron_ckpt_ext shm list)",
                        self.rank, seal.iteration, e)
                return
            if self.partner is not None:  # --ckpt-memory-partner: copied to another node
                self.partner.replicate(seal, cancel)

    def unseal(self, *, wait: bool = False) -> None:
        """Before the sealed buffers change (the next staging, close): no seal may name them.

        A seal still being summed is cancelled, not waited for (``wait``: at close): once the
        seal file is gone under the seal lock, the summing thread can no longer write one (it
        checks its own cancel event under that lock) and only reads the buffers, whose mappings
        its references keep alive, until its current chunk ends. The next save's staging thus
        never waits for the summing of a save that committed just before it."""
        sealed = self._sealed
        if sealed is None:
            return
        self._seal_cancel.set()
        with self._seal_lock:
            remove_seal(self.shm_dir, sealed[1], self.rank)
        thread, self._seal_thread = self._seal_thread, None
        if thread is not None and wait:
            thread.join()
        self._sealed = None
        with self._lock:
            buffer_set = sealed[0]
            if not self.reuse and not buffer_set.in_flight and buffer_set in self._sets:
                self._sets.remove(buffer_set)
                self._free_all(buffer_set.buffers.values())

    def _finish_sealing(self) -> _BufferSet | None:
        """At a close that keeps the snapshot: the sealed set once its seal is written."""
        if self._sealed is None:
            return None
        if self._seal_thread is not None:
            self._seal_thread.join()
            self._seal_thread = None
        return self._sealed[0]

    def sealed_root(self) -> str | None:
        """The save root of the snapshot this stager holds (sealed, or adopted), or None."""
        return None if self._sealed is None else self._sealed[1]

    def adopt(self, seal: Seal) -> list[torch.Tensor]:
        """Map a sealed snapshot left by an earlier run as this stager's buffer set (the next
        save stages into it); its tensors in the seal's order. The seal stays valid until then.
        The buffers are not pinned yet: the restore copies them through pinned bounce chunks,
        faster than pinning first (:func:`.restore_copy.copy_verified`); :meth:`pin_adopted` pins
        them afterwards, in the background, for the next save's staging."""
        self._check_open()
        own = self._own_sealed(seal)
        if own is not None:  # a load in the run that sealed it: its own buffers
            return own
        if mapped_elsewhere(seal):  # another job loading this root while its own job runs
            raise SnapshotInUse(f"its buffers are mapped by another live process (the job that "
                                f"sealed it, pid {seal.pid} on {seal.host}, still runs, or its "
                                "writer)")
        buffers: dict[_Spec, _Buffer] = {}
        keys: list[_Spec] = []
        try:
            for e in seal.entries:
                buffer = self._map(e)  # raises on an unknown dtype before mapping anything
                keys.append((e.spec, tuple(e.shape), buffer.tensor.dtype))
                buffers[keys[-1]] = buffer
        except BaseException:
            self._free_all(buffers.values(), unlink=False)
            raise
        buffer_set = _BufferSet(buffers)
        with self._lock:
            self._sets.append(buffer_set)
        self._sealed = (buffer_set, seal.root)
        return [buffers[key].tensor for key in keys]

    def pin_adopted(self) -> None:
        """Pin the adopted snapshot's buffers (the next save stages into them) on a background
        thread, after a prepare() running in the background: off the restore's path; the next
        stage() or close() waits for it, and a prepare() meanwhile runs after it. Once per
        adopted snapshot (the load asks, and prepare() asks again). The time it took is
        ``stats["pin_adopted_s"]``."""
        sealed = self._sealed
        if sealed is None or not self.pin:
            return
        todo = [b for b in sealed[0].buffers.values() if b.path and not b.registered]
        if not todo or self._pin_started is sealed[0]:  # (the load's, then prepare()'s call)
            return
        self._pin_started, self._pin_hurry = sealed[0], threading.Event()
        earlier = self._prepare_thread
        self._prepare_thread = threading.Thread(target=self._pin_in_background,
                                                args=(todo, earlier), name="mcx-pin-adopted",
                                                daemon=True)
        self._prepare_thread.start()

    def pin_adopted_now(self, tensors: Sequence[torch.Tensor],
                        stop: threading.Event) -> set[int]:
        """Pin these adopted buffers (as :meth:`adopt` returned them), largest first, one at a
        time on this thread, until ``stop`` is set: the indices now pinned. A restore prepared
        while the model is built (load/prepared.py) copies those straight to the device and the
        rest through the bounce pool; :meth:`pin_adopted` pins the rest after the load."""
        sealed = self._sealed
        if sealed is None or not self.pin:
            return set()
        by_id = {id(b.tensor): b for b in sealed[0].buffers.values() if b.path}
        done: set[int] = set()
        for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].untyped_storage().nbytes()):
            buffer = by_id.get(id(tensors[i]))
            if stop.is_set():
                break
            if buffer is not None and not buffer.registered:
                buffer.registered = _register(buffer.tensor, buffer.nbytes)
            if buffer is not None and buffer.registered:
                done.add(i)
        return done

    def _pin_in_background(self, buffers: list[_Buffer],
                           earlier: threading.Thread | None) -> None:
        if earlier is not None:
            earlier.join()
        t0 = time.perf_counter()
        paused: list[float] = []
        try:
            self._pin_all(buffers, paused)
        except BaseException as e:  # re-raised by the next stage()/prepare()
            self._prepare_error = e
        # one entry, set once the pinning is over: a save that takes it (save/steps.py) reports
        # the whole pinning, never the pauses so far with the rest in a later save
        figures = {"pin_adopted_s": round(time.perf_counter() - t0, 6)}
        if paused:
            figures["pin_paused_s"] = round(sum(paused), 6)
        self.stats["pinned_adopted"] = figures

    def discard_stale(self, seal: Seal) -> None:
        """A snapshot of this rank's save root that this run will not adopt (another iteration,
        layout or world size): its seal and the segments no live process maps are removed now,
        so it does not hold /dev/shm while this run allocates its own staging. Not this run's
        own sealed buffers."""
        if self._sealed is not None and self._sealed[1] == seal.root:
            return
        if mapped_elsewhere(seal):  # the live snapshot of a job that still runs: not ours
            return
        discard(seal, is_mapped=is_mapped)

    def _own_sealed(self, seal: Seal) -> list[torch.Tensor] | None:
        if self._sealed is None or self._sealed[1] != seal.root:
            return None
        by_path = {b.path: b.tensor for b in self._sealed[0].buffers.values() if b.path}
        if not all(e.path is None or e.path in by_path for e in seal.entries):
            return None
        return [by_path[e.path] if e.path else self._map(e).tensor for e in seal.entries]

    def drop_adopted(self, *, unlink: bool) -> None:
        """Give up an adopted snapshot (``unlink``: it is damaged, delete it and its seal)."""
        sealed, self._sealed = self._sealed, None
        if sealed is None:
            return
        if unlink:
            remove_seal(self.shm_dir, sealed[1], self.rank)
        with self._lock:
            if sealed[0] in self._sets:
                self._sets.remove(sealed[0])
            self._free_all(sealed[0].buffers.values(), unlink=unlink)

    def hurry_pinning(self) -> None:
        """A save or a close is about to wait for the background pinning: no more pauses."""
        if self._pin_hurry is not None:
            self._pin_hurry.set()

    def _pin_all(self, buffers: list[_Buffer], paused: list[float] | None = None) -> None:
        """``cudaHostRegister`` an adopted snapshot's buffers, largest first, on several threads
        (the driver serialises most of it: 0.1-0.2 s per GiB). Pinned, they are the next save's
        staging at full copy speed. With ``MCX_PIN_PACE`` below 1, one buffer at a time with a
        pause after each, so that registering (which holds the driver's lock every CUDA call of
        the training step waits for) takes at most that share of the wall time, until a save or
        a close waits for it (:meth:`hurry_pinning`): then the rest at full speed. Each pause's
        seconds are appended to ``paused`` (where given)."""
        from concurrent.futures import ThreadPoolExecutor

        from .._threads import thread_counts

        todo = sorted((b for b in buffers if b.path), key=lambda b: -b.nbytes)
        pace = _pin_pace()
        hurry = self._pin_hurry = threading.Event() if self._pin_hurry is None else self._pin_hurry

        def pin(buffer: _Buffer) -> None:
            buffer.registered = _register(buffer.tensor, buffer.nbytes)

        while pace < 1.0 and todo and not hurry.is_set():
            t0 = time.perf_counter()
            pin(todo.pop(0))
            if not todo:  # (no pause after the last)
                break
            t1 = time.perf_counter()
            hurry.wait((t1 - t0) * (1 / pace - 1))  # (returns at once when a save or close waits)
            if paused is not None:
                paused.append(time.perf_counter() - t1)
        # the rank's share of the host's cores: every rank of the host pins at once
        with ThreadPoolExecutor(max_workers=thread_counts().copy) as pool:
            list(pool.map(pin, todo))


def _pin_pace() -> float:
    """``MCX_PIN_PACE`` as a share of wall time in (0, 1] (1: no pauses; a bad value is 1)."""
    try:
        pace = float(env_switch("MCX_PIN_PACE"))
    except ValueError:
        return 1.0
    return min(1.0, pace) if pace > 0 else 1.0


def _device_peak() -> int:
    """The most memory torch's caching allocator has held on this process's device (0 where
    CUDA was never used here), read without a synchronisation. The largest over the devices:
    a rank uses one, and a commit on another thread would read the thread's current device."""
    try:
        if not torch.cuda.is_initialized():
            return 0
        return max((int(torch.cuda.max_memory_reserved(d))
                    for d in range(torch.cuda.device_count())), default=0)
    except (RuntimeError, AssertionError):
        return 0
