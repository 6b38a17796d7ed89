"""Sealed snapshots: the staging buffers of the last committed save, kept in /dev/shm as
"checkpoint iteration N of the job saving under ROOT, rank R of W", so that a job restarted on
this node restores from memory instead of reading storage.

A seal is a small JSON file ``/dev/shm/mcxseal_<hash of ROOT>_<rank>.json`` naming the segments,
what each holds (key, global offset, shape, dtype), its CRC-32, the iteration, the world size and
the manifest CRC of the committed checkpoint it equals. It is written (atomically) only once every
buffer's CRC is computed after the commit, and removed before the next save writes into the
buffers, so a crash in the middle of staging leaves no sealed torn set. The orphan sweep leaves
the segments of a seal alone until the seal is older than :data:`MAX_AGE_S`, and removes the
half-written seal file (``.json.tmp<pid>``) of a process killed between the write and the rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .._crc import crc32 as _crc32
from .._runtime import pid_alive, populate
from .._threads import cores_per_local_rank
from .restore_copy import _bytes, _nbytes, _pieces

__all__ = ["MAX_AGE_S", "SEAL_PREFIX", "Seal", "SealEntry", "buffer_crc32", "clean", "discard",
           "any_mapped", "held_by_ended_runs", "list_seals", "presum_pieces", "read_seal",
           "reclaim_ended_runs", "remove_seal", "seal_path", "sealed_segments", "sealer_alive",
           "write_seal"]

logger = logging.getLogger(__name__)

SEAL_PREFIX = "mcxseal_"
MAX_AGE_S = 24 * 3600.0  # a seal older than this no longer protects its segments from the sweep
PARTIAL_AGE_S = 60.0  # a seal is written in milliseconds: an older temporary file's writer died
_PARTIAL = re.compile(r"\.json\.tmp(\d+)$")  # write_seal's temporary file: <seal>.json.tmp<pid>
_FORMAT = "megatron-ckpt-ext/seal/1"
_CRC_CHUNK = 64 << 20
_SEAL_SUM_THREADS = 4  # a seal's summing threads, at most the rank's share of the host's cores



@dataclass
class SealEntry:
    """One staged tensor: what it is (for matching a restart's state) and where it lives."""

    key: str
    offset: list[int]  # the ShardedTensor's global offset
    shape: list[int]
    dtype: str
    spec: str  # the stager's buffer name (key, or key#n for a repeated key)
    path: str | None  # None for a zero-size tensor
    nbytes: int
    crc32: int = 0


@dataclass
class Seal:
    root: str  # realpath of the --save root
    rank: int
    world: int
    iteration: int
    manifest_crc32: str | None  # the committed checkpoint's manifest CRC (None: no manifest)
    entries: list[SealEntry]
    # the digest of the save's whole structure (save/planner.structure_digest), which
    # megatron-core validated in the run that saved it; '' where not kept (no constant structure)
    structure: str = ""
    objects: list = field(default_factory=list)  # its items that are not ShardedTensors
    generation: str = ""
    created: float = 0.0  # time.time()
    host: str = ""
    pid: int = 0
    replica_of: str = ""  # a partner copy (staging/partner.py): the node it was copied from
    # the most device memory torch's allocator held in the process that sealed it (bytes; 0:
    # unknown): what its restart needs beside a copy ahead of the load (load/device_ahead.py)
    device_peak: int = 0
    format: str = _FORMAT
    file: str = field(default="", compare=False)  # where it was read from (not stored)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def seal_path(shm_dir: str, root: str | os.PathLike[str], rank: int) -> str:
    digest = hashlib.sha1(os.path.realpath(root).encode()).hexdigest()[:16]
    return os.path.join(shm_dir, f"{SEAL_PREFIX}{digest}_{rank}.json")


def write_seal(seal: Seal, shm_dir: str, *, path: str | None = None) -> str:
    """Write ``seal`` atomically (temporary file, rename): a reader sees all of it or none.
    ``path``: another place than the rank's own seal (a partner copy's)."""
    path = path or seal_path(shm_dir, seal.root, seal.rank)
    seal.created, seal.host, seal.pid = time.time(), socket.gethostname(), os.getpid()
    seal.generation = seal.generation or os.urandom(8).hex()
    data = {k: v for k, v in asdict(seal).items() if k != "file"}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except BaseException:  # a full /dev/shm: no half-written file left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_seal(path: str) -> Seal | None:
    """The seal at ``path``, or None when there is none or it cannot be read as one."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("format") != _FORMAT:
            return None
        entries = [SealEntry(**e) for e in data.pop("entries")]
        return Seal(entries=entries, file=path, **data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def remove_seal(shm_dir: str, root: str | os.PathLike[str], rank: int) -> None:
    try:
        os.unlink(seal_path(shm_dir, root, rank))
    except FileNotFoundError:
        pass


def list_seals(shm_dir: str) -> list[Seal]:
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    found = (read_seal(os.path.join(shm_dir, n)) for n in names
             if n.startswith(SEAL_PREFIX) and n.endswith(".json"))
    return [s for s in found if s is not None]


def sealed_segments(shm_dir: str, *, now: float | None = None,
                    expire: bool = True) -> set[str]:
    """The segment paths of the seals younger than :data:`MAX_AGE_S`; with ``expire`` older
    seals (and unreadable ones) are removed first, so their segments become ordinary orphans."""
    now = time.time() if now is None else now
    kept: set[str] = set()
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return kept
    for name in names:
        if not name.startswith(SEAL_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        if not name.endswith(".json"):
            if expire and _abandoned_partial(path, name, now):
                _unlink(path)
            continue
        seal = read_seal(path)
        if seal is None or now - seal.created > MAX_AGE_S:
            if expire:
                _unlink(path)
            continue
        kept.update(e.path for e in seal.entries if e.path)
    return kept


def _abandoned_partial(path: str, name: str, now: float) -> bool:
    """Whether ``name`` is a seal file half-written by a process that was killed (between
    :func:`write_seal`'s write and its rename): its pid gone and older than
    :data:`PARTIAL_AGE_S` (the age guards a live writer's file against a pid of another pid
    namespace)."""
    match = _PARTIAL.search(name)
    if match is None or pid_alive(int(match.group(1))):
        return False
    try:
        return now - os.stat(path).st_mtime > PARTIAL_AGE_S
    except OSError:
        return False


def held_by_ended_runs(shm_dir: str, *, is_mapped: Callable[[str], bool] | None = None
                       ) -> tuple[int, int]:
    """(seals, bytes): the sealed snapshots in ``shm_dir`` whose sealing process on this host
    has ended, and the shared memory their segments hold (node admission frees them when only
    they are in the way, else names them: ``shm clean`` frees them). With ``is_mapped``, not
    those a live process maps (a restore adopted them): what :func:`reclaim_ended_runs` frees."""
    count, paths = 0, set()
    for seal in list_seals(shm_dir):
        if sealer_alive(seal) if is_mapped is None else not _freeable(seal, is_mapped):
            continue
        count += 1
        paths.update(e.path for e in seal.entries if e.path)
    held = 0
    for path in paths:
        try:
            held += os.stat(path).st_blocks * 512
        except OSError:
            pass
    return count, held


def _ours_to_remove(path: str) -> bool:
    """Whether this process may remove ``path`` from the sticky /dev/shm (its owner, or root)."""
    try:
        return os.geteuid() == 0 or os.stat(path).st_uid == os.geteuid()
    except OSError:
        return False


def _freeable(seal: Seal, is_mapped: Callable[[str], bool]) -> bool:
    """A seal whose sealing process has ended, that no live process maps and that this process
    may remove."""
    return (not sealer_alive(seal) and not any_mapped(seal, is_mapped)
            and _ours_to_remove(seal.file))


def reclaim_ended_runs(shm_dir: str, *, is_mapped: Callable[[str], bool]) -> int:
    """Free what :func:`held_by_ended_runs` with ``is_mapped`` counts (node admission, when a
    job's staging does not fit beside it), each seal with its segments; how many seals."""
    freed = [seal for seal in list_seals(shm_dir) if _freeable(seal, is_mapped)]
    for seal in freed:
        discard(seal, is_mapped=is_mapped)
    return len(freed)


def sealer_alive(seal: Seal) -> bool:
    """Whether the process that wrote ``seal`` still runs on this host."""
    return seal.host == socket.gethostname() and seal.pid > 0 and pid_alive(seal.pid)


def any_mapped(seal: Seal, is_mapped: Callable[[str], bool]) -> bool:
    """Whether a live process maps any of ``seal``'s segments (``is_mapped``: its flock)."""
    return any(os.path.exists(p) and is_mapped(p) for p in {e.path for e in seal.entries if e.path})


def clean(shm_dir: str, *, is_mapped: Callable[[str], bool]
          ) -> tuple[list[str], list[str], list[Seal]]:
    """``shm clean``: remove every seal whose segments no live process maps (``is_mapped``),
    and those segments; a running job's seal (a segment mapped) is left to it, so a node's
    prolog or epilog may clean while a job runs there. Returns (seals removed, segments
    removed, seals left in use)."""
    seals, segments, in_use = [], [], []
    for seal in list_seals(shm_dir):
        if not _ours_to_remove(seal.file):  # another user's: theirs (or root's) to clean
            continue
        if any_mapped(seal, is_mapped):
            in_use.append(seal)
            continue
        segments += discard(seal, is_mapped=is_mapped)
        seals.append(seal.file)
    return seals, segments, in_use


def discard(seal: Seal, *, is_mapped: Callable[[str], bool]) -> list[str]:
    """Remove ``seal`` and the segments it names that no live process maps; those removed
    (none where the seal is not ours to remove)."""
    if not _unlink(seal.file):
        return []
    return [e.path for e in seal.entries if e.path and os.path.exists(e.path)
            and not is_mapped(e.path) and _unlink(e.path)]


def buffer_crc32(tensor: torch.Tensor, cancelled: threading.Event | None = None) -> int | None:
    """CRC-32 of a contiguous CPU tensor's bytes (zlib releases the GIL on large buffers);
    None when ``cancelled`` is set meanwhile."""
    if cancelled is not None and cancelled.is_set():
        return None
    if tensor.numel() == 0:
        return 0
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    crc = 0
    for start in range(0, raw.nbytes, _CRC_CHUNK):
        if cancelled is not None and cancelled.is_set():
            return None
        crc = _crc32(memoryview(raw[start:start + _CRC_CHUNK]), crc)
    return crc


def presum_pieces(buffers: Sequence[torch.Tensor], *, threads: int,
                  chunk: int = 16 << 20) -> list[int]:
    """Each buffer's CRC-32, its chunks faulted in (one ``madvise`` each) and summed on
    ``threads`` threads: a fresh mapping summed ahead of its restore (load/prepared.py)."""
    from ..manifest import crc32_combine

    pieces = _pieces([_nbytes(b) for b in buffers], chunk)

    def run(piece: tuple[int, int, int]) -> int:
        i, a, z = piece
        raw = _bytes(buffers[i])[a:z]
        populate(raw.data_ptr(), z - a)
        return _crc32(memoryview(raw.numpy()))

    sums = [0] * len(buffers)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for (i, a, z), crc in zip(pieces, pool.map(run, pieces)):
            sums[i] = crc if a == 0 else crc32_combine(sums[i], crc, z - a)
    return sums


def crc32_all(tensors: Sequence[torch.Tensor], *, threads: int | None = None,
              cancelled: threading.Event | None = None) -> list[int] | None:
    """Every tensor's CRC-32, on ``threads`` threads (default 4, at most the rank's share of
    the host's cores: it runs beside training); None when cancelled."""
    threads = threads or min(_SEAL_SUM_THREADS, cores_per_local_rank())
    crcs: list[int | None] = [None] * len(tensors)
    order = iter(range(len(tensors)))
    taking = threading.Lock()

    def work() -> None:
        # each thread takes the next buffer until none is left or the seal is cancelled: once
        # cancelled, no thread touches another buffer (the next save's staging runs beside
        # these threads, and its Python work would otherwise share the GIL with their churn)
        while cancelled is None or not cancelled.is_set():
            with taking:
                i = next(order, None)
            if i is None:
                return
            crcs[i] = buffer_crc32(tensors[i], cancelled)

    workers = [threading.Thread(target=work, name="mcx-seal-sum", daemon=True)
               for _ in range(max(1, min(threads, len(tensors))))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return None if any(c is None for c in crcs) else crcs  # type: ignore[return-value]


def _unlink(path: str) -> bool:
    """Remove ``path``; False where it is not ours to remove (another user's file in the sticky
    /dev/shm: left to that user, or to the node's root)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except PermissionError as e:
        logger.debug("left %s: %s", path, e)
        return False
    return True
