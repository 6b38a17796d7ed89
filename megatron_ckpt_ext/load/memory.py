"""The memory tier of a load: restore from this node's sealed snapshot (staging/retained.py)
instead of reading storage, when it provably is the checkpoint being loaded.

Each rank looks for the seal of (the save root, its rank), and adopts it only if the world size,
the iteration, the committed checkpoint's manifest CRC, every tensor (key, global offset, shape,
dtype, in order) and every buffer's CRC-32 match; then the ranks agree: all restore from memory,
or all read storage (a mix would make megatron-core's collective load differ between ranks).
Rank 0 says in one line which tier each node used and why. What is not a tensor (the common
state, ShardedObjects, tensor factories) is read from storage either way (small), its files
checked against the manifest first."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from .. import backend
from .._runtime import rank
from ..collectives import Group
from ..errors import CheckpointIntegrityError, SnapshotInUse
from ..manifest import ManifestError, read_manifest, verify_files
from ..save.layout import checkpoint_name, parse_iteration
from ..save.planner import copy_structure, structure_digest, structure_key, structure_objects
from ..staging import restore_copy, restore_sums
from ..staging.restore_copy import CopyInFlight, drop_warm_bounce, start_copy_verified, warm_bounce
from ..staging.retained import Seal, read_seal, seal_path
from . import prepared as _prepared
from .device_ahead import blocks_for
from .report import LoadRecord

__all__ = ["discard_snapshot", "release_warm_restore", "restore_from_memory", "tensor_layout",
           "warm_restore"]

logger = logging.getLogger(__name__)

_SMALL_FILES = (".metadata", "common.pt", "metadata.json")


def tensor_layout(sharded_state_dict: Any) -> list[tuple[str, list[int], list[int], str]]:
    """(key, global offset, local shape, dtype) of every ShardedTensor, in staging order."""
    out: list = []

    def note(t: Any) -> Any:
        out.append((t.key, list(t.global_offset), list(t.data.shape), str(t.data.dtype)))
        return t

    backend.map_sharded_tensors(sharded_state_dict, note)
    return out


def restore_from_memory(stager: Any, sharded_state_dict: Any, path: Path, record: LoadRecord,
                        group: Group, *, load_strategy: Callable[[], Any],
                        proven: Callable[[tuple], None] | None = None,
                        partner: Any = None, metadata: Any = None) -> dict | None:
    """Collective: the loaded state restored from this node's sealed snapshots on every rank,
    or None on every rank (storage is read then; rank 0 has said why). Where every rank's
    whole structure is the one its seal names (``Seal.structure``: validated by megatron-core
    in the run that saved it), megatron-core does not validate the sharding again: neither the
    load of the rest nor (``proven``, called with the structure key) the next prepare() and
    save. ``partner`` (``--ckpt-memory-partner``, staging/partner.py): first, the ranks whose
    node holds no seal of this checkpoint fetch their copy from their partner's node.
    ``metadata``: the checkpoint's DCP ``.metadata`` the load's locate step unpickled (0.19),
    used by megatron-core's load of the rest instead of reading it again."""
    t = t0 = time.perf_counter()
    iteration = parse_iteration(path.name)
    if iteration is None:  # not a committed iteration's name: storage decides what it is
        return None
    record.path, record.iteration = path, iteration
    steps: dict[str, float] = {}
    if partner is not None:  # (C) a rank whose node lost its seal fetches its partner's copy
        partner.reseed(root=str(path.parent), iteration=iteration, world=group.size(),
                       gather=group.all_gather, detail=record.memory_detail)
        t = _step(steps, "partner_s", t)
    tensors, why, seal, ahead = _adopt(stager, sharded_state_dict, path.parent, iteration,
                                       group.size())
    t = _step(steps, "adopt_s", t)
    if ahead is not None:
        record.memory_detail.update(prepared_s=ahead.seconds, prepare_wait_s=ahead.waited_s,
                                    pinned_ahead=len(ahead.pinned), prepared_steps=ahead.steps)
        if ahead.device is not None:  # --ckpt-restore-prefetch: its part of prepared_s
            record.memory_detail.update(device_ahead_fill_s=ahead.device.seconds,
                                        device_ahead_left=ahead.device.left,
                                        device_ahead_block=ahead.device.kind)
    copying: CopyInFlight | None = None
    if tensors is not None:  # checked and the copies into the targets issued in one pass (a
        why, copying = _check_and_copy(stager, tensors, sharded_state_dict,  # refusal is
                                       detail=record.memory_detail,  # overwritten by storage)
                                       summed=frozenset(ahead.verified) if ahead else frozenset(),
                                       on_device=ahead.device if ahead else None,
                                       device_sums=bool(ahead and ahead.device_sums))
    t = _step(steps, "check_and_copy_s", t)
    if copying is not None and not why and read_seal(seal.file) != seal:
        copying.finish()
        stager.drop_adopted(unlink=False)  # unsealed (to be staged into) or replaced meanwhile
        why = "the snapshot was unsealed or replaced while it was copied"
    t = _step(steps, "seal_recheck_s", t)
    key = structure_key(sharded_state_dict) if not why and seal.structure else None
    left_out = _sealed_less_objects(seal, key)
    if key is not None and left_out is None:
        record.memory_detail["structure_differs"] = _objects_differ(seal.objects, key)
    elif left_out:  # Megatron-LM's load leaves out its rerun state machine's object
        record.memory_detail["objects_not_loaded"] = list(left_out)
    try:
        pending = bool(copying is not None and not why and copying.pending)
        views = group.all_gather((socket.gethostname(), why, left_out, pending))
        t = _step(steps, "agree_s", t)
        record.memory_steps = steps
        if any(w for _, w, *_ in views):
            _say(views, iteration, used=False)
            record.phase("memory_s", t0)
            return None
        # proven: every rank's structure is its sealed one, less the same whole objects
        same = all(v[2] is not None for v in views) and len({v[2] for v in views}) == 1
        record.memory_detail["structure_proven"] = same
        state = _load_rest_and_fill(sharded_state_dict, path, load_strategy,  # while the
                                    validate=not same, detail=record.memory_detail,  # copies
                                    metadata=metadata)  # land
        t = _step(steps, "rest_from_storage_s", t)
        if any(v[3] for v in views):  # (C) some ranks' sums were taken on the device: agree again
            why = _late_verdict(stager, copying, tensors) if pending else ""
            views = group.all_gather((socket.gethostname(), why, left_out, False))
            t = _step(steps, "device_sums_s", t)
            if any(w for _, w, *_ in views):
                _say(views, iteration, used=False)
                record.phase("memory_s", t0)
                return None
        if same and proven is not None:
            proven(key)
    finally:
        if copying is not None:
            copying.finish()
    _step(steps, "copies_landed_s", t)
    record.tier = "memory"
    record.memory_bytes = sum(b.numel() * b.element_size() for b, _ in tensors)
    record.verified = True
    _say(views, iteration, used=True)
    record.phase("memory_s", t0)
    return state


def _step(steps: dict[str, float], name: str, since: float) -> float:
    now = time.perf_counter()
    steps[name] = round(now - since, 6)
    return now


def warm_restore(stager: Any, root: Path, prefetch: str = "off", early: bool = False) -> bool:
    """Before the load, while the model is built: where this node holds this rank's seal of
    ``root``, background threads prepare its restore: one maps the snapshot, faults it in,
    sums every buffer against the seal and pins buffers until the load comes (with
    ``MCX_RESTORE_SUMS=device`` and CUDA it only pins every buffer, the load then summing
    them on the device) (``prefetch``, --ckpt-restore-prefetch, and ``early``: the blocks
    :func:`.device_ahead.blocks_for` gives: instead copies it to the device, summed on the way,
    where the device has room; :mod:`.prepared`, :mod:`.device_ahead`),
    another one then builds the pinned bounce pool the rest is copied through
    (:func:`.restore_copy.warm_bounce`).
    The load still decides, and takes what was prepared only for the seal it finds then.
    Whether anything started."""
    shm_dir = getattr(stager, "shm_dir", None)
    if shm_dir is None or read_seal(seal_path(shm_dir, root, rank())) is None:
        return False
    device = restore_copy.cuda_device()
    to_device = blocks_for(prefetch, early=early)
    device_sums = device is not None and not to_device and restore_sums.wanted()
    started = _prepared.start(stager, root, device, to_device=to_device, device_sums=device_sums)
    if device_sums and started:  # every buffer pinned: no pool to copy through (a buffer that
        return True  # could not be pinned goes through one built at the load)
    return warm_bounce() or started


def release_warm_restore(*, background: bool = False) -> None:
    """What :func:`warm_restore` prepared and no restore took: the pool released (unpinned;
    ``background``: on a thread of its own), the snapshot unmapped (its seal and segments
    stay)."""
    if drop_warm_bounce(background=background) | _prepared.drop():
        logger.debug("what was prepared ahead of a restore from memory was not used")


def discard_snapshot(stager: Any, root: Path) -> None:
    """With the memory tier off: this rank's snapshot of ``root`` left by an earlier run will
    never be adopted, so its memory is freed before this run allocates its staging."""
    if hasattr(stager, "discard_stale"):
        seal = read_seal(seal_path(stager.shm_dir, root, rank()))
        if seal is not None:
            stager.discard_stale(seal)


def _adopt(stager: Any, sharded_state_dict: Any, root: Path, iteration: int,
           world: int) -> tuple[list | None, str, Any, _prepared.Prepared | None]:
    """This rank's snapshot buffers for ``iteration`` paired with their seal entries if they
    match, else (None, why not); the seal; what :func:`warm_restore` prepared of it, if taken."""
    if not hasattr(stager, "adopt"):
        return None, "no shared-memory staging (--async-ckpt-use-cpu-shm) in this run", None, None
    seal = read_seal(seal_path(stager.shm_dir, root, rank()))
    ahead = _prepared.take(seal)  # mapped and summed while the model was built, if of this seal
    why = _mismatch(seal, sharded_state_dict, root, iteration, world)
    if why:
        if ahead is not None:
            ahead.release_device()
            stager.drop_adopted(unlink=False)
        if seal is not None and os.path.realpath(seal.root) == os.path.realpath(root):
            stager.discard_stale(seal)  # this rank's, and nobody will adopt it: free its memory
        return None, why, seal, None
    if ahead is not None:
        return list(zip(ahead.buffers, seal.entries)), "", seal, ahead
    try:
        buffers = stager.adopt(seal)
    except SnapshotInUse as e:  # a running job's snapshot: left to it
        return None, f"the snapshot is in use: {e}", seal, None
    except (OSError, ValueError) as e:
        stager.discard_stale(seal)
        return None, f"its segments cannot be mapped ({e})", seal, None
    return list(zip(buffers, seal.entries)), "", seal, None


def _check_and_copy(stager: Any, adopted: list, sharded_state_dict: Any, *,
                    detail: dict | None = None, summed: frozenset[int] = frozenset(),
                    on_device: Any = None,
                    device_sums: bool = False) -> tuple[str, CopyInFlight | None]:
    """Each buffer's CRC-32 against its seal and its copy into the target, chunk by chunk on
    the copy threads (those in ``summed`` matched ahead: only copied; those ``on_device`` holds,
    copied to the device ahead, from there; with ``device_sums``, the pinned ones summed on the
    device after their copy: :func:`_late_verdict`); why not (a mismatch), or '', and the
    copies, which may still be landing (None where none was issued)."""
    targets: list = []
    backend.map_sharded_tensors(sharded_state_dict, lambda t: targets.append(t.data) or t)
    if not all(t.is_contiguous() for t in targets):
        if on_device is not None:
            on_device.release()
        stager.drop_adopted(unlink=False)
        return "a target tensor is not contiguous (the copies go to contiguous targets only)", None
    copying = start_copy_verified([(b, e.crc32, t) for (b, e), t in zip(adopted, targets)],
                                  detail=detail, summed=summed, on_device=on_device,
                                  device_sums=device_sums)
    if copying.bad:
        copying.finish()
        return _damaged(stager, adopted, copying.bad), copying
    return "", copying


def _late_verdict(stager: Any, copying: CopyInFlight, adopted: list) -> str:
    """Why not, once the sums taken on the device are read (the copies landed), or ''."""
    bad = copying.late_bad()
    return _damaged(stager, adopted, bad) if bad else ""


def _damaged(stager: Any, adopted: list, bad: list[int]) -> str:
    stager.drop_adopted(unlink=True)  # damaged: nobody may adopt it again
    keys = [adopted[i][1].key for i in bad]
    return f"{len(bad)} buffer(s) do not match their sealed CRC-32 ({keys[:3]})"


def _mismatch(seal: Seal | None, sharded_state_dict: Any, root: Path, iteration: int,
              world: int) -> str:
    if seal is None:
        return "no sealed snapshot of this save root on this node"
    if os.path.realpath(seal.root) != os.path.realpath(root):
        return f"the snapshot belongs to {seal.root}"
    if seal.world != world:
        return f"the snapshot was taken at world size {seal.world}, this run has {world}"
    if seal.iteration != iteration:
        return f"the snapshot holds iteration {seal.iteration}, the load asks for {iteration}"
    try:
        manifest = read_manifest(checkpoint_name(root, iteration))
    except ManifestError as e:
        return f"the checkpoint's manifest is damaged ({e})"
    committed = manifest.get("manifest_crc32") if manifest else None
    if committed is None or committed != seal.manifest_crc32:
        return ("the snapshot is not of this commit of the iteration (manifest CRC "
                f"{seal.manifest_crc32} vs {committed})")
    wanted = tensor_layout(sharded_state_dict)
    held = [(e.key, list(e.offset), list(e.shape), e.dtype) for e in seal.entries]
    if wanted != held:
        return (f"the state's tensors differ from the snapshot's ({len(wanted)} vs {len(held)} "
                "tensors, or another layout): resharding reads storage")
    return ""


def _load_rest_and_fill(sharded_state_dict: Any, path: Path,
                        load_strategy: Callable[[], Any], *, validate: bool = True,
                        detail: dict | None = None, metadata: Any = None) -> dict:
    """megatron-core's load of everything but the tensors (its files checked first, its
    sharding validated unless ``validate`` is False), the tensors copied from the snapshot
    into their targets. ``detail`` gets the check's time (``rest_check_s``)."""
    t = time.perf_counter()
    manifest = read_manifest(path) or {"files": {}}
    small = [n for n in manifest["files"] if n in _SMALL_FILES or n.endswith(_SMALL_FILES)]
    problems = verify_files(path, manifest, small, workers=2)
    if problems:
        raise CheckpointIntegrityError(
            f"checkpoint iteration {path.name} ({path}) does not match its integrity manifest: "
            f"{'; '.join(str(p) for p in problems)}. Fix: restore those files, or resume from "
            "another checkpoint (point --load at a directory whose tracker names it).")
    if detail is not None:
        detail["rest_check_s"] = round(time.perf_counter() - t, 6)
    state = copy_structure(sharded_state_dict)  # its tensors' data: the filled targets
    known = {str(path): metadata} if metadata is not None else None  # (locate's, on 0.19)
    with backend.metadata_read_once(known):  # (0.19 loads the common state apart: one unpickle)
        return backend.load_with_tensors_from(state, str(path), load_strategy(), lambda t: t.data,
                                              validate=validate)


def _sealed_less_objects(seal: Seal, key: tuple | None) -> tuple[str, ...] | None:
    """Whether ``key`` (this rank's structure) is the structure ``seal`` names, which
    megatron-core validated in the run that saved it, less every item of some keys that are not
    ShardedTensors (a load may leave out what only a save writes: Megatron-LM's rerun state
    machine's object unless it was running): those keys, () for the very structure; None when
    it is not (a tensor differs, an item was added, a key only partly left out)."""
    if key is None:
        return None
    if seal.structure == structure_digest(key):
        return ()
    sealed = [_as_item(o) for o in seal.objects]
    mine = [i for i in key if i[0] != "ShardedTensor"]
    gone = [i for i in sealed if i not in mine]
    names = {i[1] for i in gone}
    if not gone or any(i not in sealed or i[1] in names for i in mine):
        return None
    whole = tuple(sorted([*key, *gone]))  # the key the seal's digest was taken of, if so
    return tuple(sorted(names)) if structure_digest(whole) == seal.structure else None


def _as_item(value: Any) -> Any:
    """A structure item as :func:`structure_key` makes it, from its JSON form (lists)."""
    return tuple(_as_item(v) for v in value) if isinstance(value, list) else value


def _objects_differ(sealed: list, key: tuple) -> str:
    """What differs between the structure a seal names and this state's ``key``, in words (the
    tensors matched already): which items that are not tensors were added or removed."""
    mine, theirs = structure_objects(key), sealed
    added = [i for i in mine if i not in theirs]
    removed = [i for i in theirs if i not in mine]
    if not added and not removed:
        return "the tensors' global shapes or types"
    return f"added {added[:3]}, removed {removed[:3]}"


def _say(views: list[tuple], iteration: int, *, used: bool) -> None:
    if rank() != 0:
        return
    if used:
        hosts = sorted({h for h, *_ in views})
        logger.info("checkpoint iteration %d restored from memory on %d node(s) (%s)", iteration,
                    len(hosts), ", ".join(hosts[:4]))
        return
    by_host: dict[str, str] = {}
    for r, (host, why, *_) in sorted(enumerate(views), key=lambda v: not v[1][1]):  # failures 1st
        by_host.setdefault(host, f"rank {r}: {why}" if why else "memory ready")
    logger.info("checkpoint iteration %d is read from storage, not from memory: %s", iteration,
                "; ".join(f"{h}: {w}" for h, w in sorted(by_host.items())))
