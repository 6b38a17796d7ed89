"""A restore from memory prepared while the model is built: this rank's sealed snapshot of the
directory to load is mapped, its pages faulted in and every buffer summed against its seal on a
background thread, then (with CUDA) its buffers pinned one by one until the load comes, before
the load is asked for (:meth:`Checkpointer.prepare_restore`). The restore then only copies
(docs/MEMORY.md, "How the bytes travel"). Where the load sums on the device
(``MCX_RESTORE_SUMS=device``, with CUDA), the snapshot is only mapped and pinned here.

What the load takes is what was summed: the load reads the seal again and takes the prepared
buffers only if it is the same seal (same generation, iteration, entries and CRCs); after its
copy it reads the seal once more, and a seal removed or replaced meanwhile (a writer that staged
into the buffers must unseal first) sends the load to storage. A buffer whose sum did not match
is summed again by the copy, and refused there. A prepared snapshot no load takes is unmapped,
its seal and segments left as they were."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .._runtime import rank
from .._threads import thread_counts
from ..staging import restore_copy
from ..staging.retained import Seal, presum_pieces, read_seal, seal_path
from .device_ahead import DeviceAhead

__all__ = ["Prepared", "drop", "start", "take", "wait"]

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What a load takes: the seal, its buffers (mapped by the stager, in the seal's order), the
    indices of those whose sum matched, and how long preparing took."""

    seal: Seal
    buffers: list = field(default_factory=list)
    verified: set[int] = field(default_factory=set)
    pinned: set[int] = field(default_factory=set)  # registered with CUDA before the load came
    seconds: float = 0.0
    steps: dict = field(default_factory=dict)  # mapped, (copied ahead,) summed: seconds since
    # the preparation started (it ended, pinned, at ``seconds``)
    waited_s: float = 0.0
    device: DeviceAhead | None = None  # the snapshot copied to the device (device_ahead)
    device_sums: bool = False  # pinned, not summed: the load sums them on the device (C)

    def release_device(self) -> None:
        """The device block given back (the load's copies landed, or no load took it)."""
        device, self.device = self.device, None
        if device is not None:
            device.release()


_lock = threading.Lock()
_pending: list[dict] = []  # at most one: {"stager", "stop", "thread", "prepared" or "error"}


def start(stager: Any, root: Any, device: int | None = None, *, to_device: str = "",
          device_sums: bool = False) -> bool:
    """Map and sum this rank's sealed snapshot of ``root`` on a background thread, then (with a
    CUDA ``device``) pin its buffers until the load comes; with ``to_device`` ("cached" or
    "any": the blocks it may take), instead copy it to the device through the bounce pool,
    summed on the way, where the device has room (:mod:`.device_ahead`; pinned after the
    load). With ``device_sums`` (and a CUDA ``device``) map and pin every buffer without
    summing it: the load sums them on the device after their copy (staging/restore_sums.py),
    and the device CRC is built meanwhile. Whether it started
    (a seal of ``root`` for this rank, no snapshot of this run's own, none pending)."""
    if not hasattr(stager, "adopt") or stager.sealed_root() is not None:
        return False
    seal = read_seal(seal_path(stager.shm_dir, root, rank()))
    if seal is None:
        return False
    with _lock:
        if _pending:
            return False
        entry: dict = {"stager": stager, "stop": threading.Event()}
        target, args = ((_pin_only, (entry, seal, device)) if device_sums and device is not None
                        and not to_device else (_prepare, (entry, seal, device, to_device)))
        entry["thread"] = threading.Thread(target=target, args=args,
                                           name="mcx-prepare-restore", daemon=True)
        _pending.append(entry)
        entry["thread"].start()
    return True


def _adopt(entry: dict, seal: Seal) -> list | None:
    """The snapshot's buffers mapped (as :meth:`ShmStager.adopt` returns them), or None: one
    that cannot be mapped is left to the load, which finds the same and says why; any other
    error is kept for the load's thread, which re-raises it."""
    try:
        return entry["stager"].adopt(seal)
    except (OSError, ValueError) as e:
        logger.debug("the sealed snapshot could not be mapped ahead of the load: %s", e)
    except BaseException as e:  # noqa: BLE001
        entry["error"] = e
    return None


def _prepare(entry: dict, seal: Seal, device: int | None, to_device: str) -> None:
    stager, t0 = entry["stager"], time.perf_counter()
    buffers = _adopt(entry, seal)
    if buffers is None:
        return
    mapped = round(time.perf_counter() - t0, 6)
    if device is not None:
        restore_copy.use_device(device)
    ahead = (DeviceAhead.start(buffers, set(range(len(buffers))), f"cuda:{device}",
                               kinds=to_device, beside=seal.device_peak)
             if device is not None and to_device else None)
    verified: set[int] | None = None
    if ahead is not None:  # copied to the device, summed on the way
        try:
            verified = ahead.fill([e.crc32 for e in seal.entries], threads=thread_counts().copy,
                                  stop=entry["stop"])  # a load that comes takes what landed
        except Exception as e:  # noqa: BLE001 - the copy ahead is optional: the load copies
            logger.warning("the snapshot could not be copied to the device ahead of the load "
                           "(%s: %s); the load copies it from host memory", type(e).__name__, e)
            ahead.release()
            ahead = None
    copied = round(time.perf_counter() - t0, 6)
    try:
        if verified is None:
            sums = presum_pieces(buffers, threads=thread_counts().copy)
            verified = {i for i, (crc, e) in enumerate(zip(sums, seal.entries)) if crc == e.crc32}
    except BaseException as e:  # noqa: BLE001
        stager.drop_adopted(unlink=False)
        entry["error"] = e
        return
    prepared = entry["prepared"] = Prepared(seal, buffers, verified, device=ahead)
    prepared.steps = {"mapped_s": mapped, "summed_s": round(time.perf_counter() - t0, 6)}
    if ahead is not None:  # copied to the device (and summed on the way) by then
        prepared.steps["copied_ahead_s"] = copied
    if device is not None and ahead is None:  # pinned, they go to the device without a bounce
        # (the driver serialises registrations: one thread, until the load). Not after a copy
        # ahead: registering holds the driver's lock, which the model build beside it waits
        # for (1B: the build and load took 2.25 s instead of 1.63); the buffers are pinned
        # after the load for the next save's staging (ShmStager.pin_adopted)
        prepared.pinned = stager.pin_adopted_now(buffers, entry["stop"])
    prepared.seconds = round(time.perf_counter() - t0, 6)


def _pin_only(entry: dict, seal: Seal, device: int) -> None:
    """Map and pin every buffer, nothing summed (the load sums on the device): pinning faults
    the fresh mapping's pages in inside the driver, and no host thread sums beside the model
    build. The load that comes meanwhile waits for the pinning to end rather than sending the
    rest through a bounce pool: pinning is the cheaper road (docs/MEMORY.md)."""
    from .._crc_device import warm_up

    stager, t0 = entry["stager"], time.perf_counter()
    entry["pin_all"] = True
    buffers = _adopt(entry, seal)
    if buffers is None:
        return
    mapped = round(time.perf_counter() - t0, 6)
    try:
        warm_up(device)  # on a thread of its own; a load that comes first sums on the host
    except Exception as e:  # noqa: BLE001 - optional: the copy threads sum on the host
        logger.debug("no device CRC-32 for the restore: %s", e)
    try:
        restore_copy.use_device(device)
        prepared = Prepared(seal, buffers, device_sums=True, steps={"mapped_s": mapped})
        prepared.pinned = stager.pin_adopted_now(buffers, entry["stop"])
    except BaseException as e:  # noqa: BLE001
        stager.drop_adopted(unlink=False)
        entry["error"] = e
        return
    prepared.seconds = round(time.perf_counter() - t0, 6)
    entry["prepared"] = prepared


def take(seal: Seal | None) -> Prepared | None:
    """The prepared snapshot (waiting for its preparation) if it is of ``seal``, else None: one of
    another seal (removed or replaced since) is unmapped here."""
    entry, waited = _pop()
    prepared = entry.get("prepared")
    if prepared is None:
        return None
    if seal is None or prepared.seal != seal:
        prepared.release_device()
        entry["stager"].drop_adopted(unlink=False)
        return None
    prepared.waited_s = waited
    return prepared


def wait(timeout_s: float | None = None) -> bool:
    """Until the pending preparation is done (summed and, with CUDA, every buffer pinned),
    without stopping it: what a model build that outlasts it leaves the load (the restore
    benchmark's ``ours-memory-built`` case). Whether none is running any more."""
    with _lock:
        entry = _pending[0] if _pending else None
    if entry is None:
        return True
    entry["thread"].join(timeout_s)
    return not entry["thread"].is_alive()


def drop() -> bool:
    """Unmap a prepared snapshot no load took (its seal and segments stay); whether one was
    pending."""
    try:
        entry, _ = _pop()
    except BaseException as e:  # noqa: BLE001 - nothing was adopted: nothing to release
        logger.debug("the restore prepared ahead failed: %s", e)
        return True
    if entry.get("prepared") is not None:
        entry["prepared"].release_device()
        entry["stager"].drop_adopted(unlink=False)
    return bool(entry)


def _pop() -> tuple[dict, float]:
    with _lock:
        entry = _pending.pop() if _pending else {}
    if not entry:
        return entry, 0.0
    if not entry.get("pin_all"):  # what is pinned by now is taken; the rest after the load
        entry["stop"].set()
    t0 = time.perf_counter()
    entry["thread"].join()
    waited = round(time.perf_counter() - t0, 6)
    if "error" in entry:
        raise entry["error"]
    return entry, waited

