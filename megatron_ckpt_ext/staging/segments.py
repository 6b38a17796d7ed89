"""Named /dev/shm segments: creation, naming, pickling by name, and the orphan sweep.

Each segment is ``<prefix><job>_<rank>_<pid>_<n>``, mapped as torch fd-shared storage and held
with a shared ``flock`` by every process that maps it, so :func:`sweep_orphans` can tell a
leftover of a dead run from a segment still in use. Live segments are pickled to a writer as
``(path, nbytes)`` (:func:`_reduce_storage`); the writer maps them itself (:func:`_open_segment`)
and, for reused buffers, keeps the mapping per owner epoch."""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import re
import resource
from typing import Any

import torch

from .._runtime import pid_alive, populate, unheld, warn_once
from ..errors import InsufficientSharedMemory

__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "drop_kept_mappings", "is_mapped", "sweep_orphans"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "mcx_"
_FD_MARGIN = 256  # descriptors left for everything else in the process
_counter = itertools.count()
# data pointer of every live segment storage -> (path, nbytes, receivers keep it mapped): what
# _reduce_storage pickles by name
_SEGMENTS: dict[int, tuple[str, int, bool]] = {}
_reducer_installed = False
_epoch = 0  # bumped whenever this process frees a segment (receivers then drop what they kept)
# receiver side: the epoch whose segments it keeps mapped, and path -> storage
_MAPPED: dict[str, Any] = {"epoch": None, "storages": {}}


# -- the owner's side ------------------------------------------------------------------------------
def _segment_path(shm_dir: str, job_id: str, rank: int) -> str:
    """A fresh segment name: whose it is (job, rank, pid) and a per-process counter."""
    return os.path.join(shm_dir, f"{SEGMENT_PREFIX}{job_id}_{rank}_{os.getpid()}_{next(_counter)}")


def _shared_segment(path: str, nbytes: int, *, key: str) -> torch.UntypedStorage:
    """A named /dev/shm segment of ``nbytes`` mapped as torch fd-shared storage, flock-ed by us."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while any process maps it (see sweep_orphans)
        os.posix_fallocate(fd, 0, nbytes)
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    except OSError as e:
        _unlink(path)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _shm_full_error(path, nbytes, key) from e
        raise
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)  # torch keeps its own dup (with our lock) for the life of the mapping


def _register_segment(storage: torch.UntypedStorage, path: str, nbytes: int, *,
                      reuse: bool = False) -> None:
    """Pickle ``storage`` by its segment name while it lives; with ``reuse`` a receiver keeps
    its mapping across saves."""
    global _reducer_installed
    _SEGMENTS[storage.data_ptr()] = (path, nbytes, reuse)
    if not _reducer_installed:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
        _reducer_installed = True


def live_segment(storage_ptr: int) -> tuple[str, int, bool] | None:
    """(path, bytes, receivers keep it mapped) of this process's live segment at ``storage_ptr``."""
    return _SEGMENTS.get(storage_ptr)


def current_epoch() -> int:
    """Bumped whenever this process frees a segment: what receivers key their mappings by."""
    return _epoch


def _forget_segment(storage_ptr: int, path: str, *, unlink: bool = True) -> None:
    """The owner frees a segment: a new epoch (receivers drop what they kept), never pickled by
    this name again, unlinked (unless kept as a sealed snapshot)."""
    global _epoch
    _epoch += 1
    _SEGMENTS.pop(storage_ptr, None)
    if unlink:
        _unlink(path)


# threads that fault a buffer set's fresh segments in at once (a rank's cores permitting): tmpfs
# zeroes a page posix_fallocate reserved only at its first fault, ~1.5-2.7 GB/s on one thread of
# an H200 host and 6.5-7.1 GB/s on four (benchmarks/probe_register_rate.py, thirty-fourth
# session), while registering the faulted-in pages runs at 17-29 GB/s: the fault-in is most of
# a preparation (a 1B state's 12 GB: ~7 s on one thread)
FAULT_IN_THREADS = 4


def _fault_in(tensors: list[torch.Tensor]) -> bool:
    """Fault the pages of ``tensors`` (fresh segments about to be pinned) in, on up to
    :data:`FAULT_IN_THREADS` threads (each ``madvise`` runs without the interpreter's lock);
    whether it did (False: one thread would do, and :func:`_register` faults each in). Daemon
    threads: an interpreter exit that skips the stager's close() does not wait for the rest of
    the fault-in, as it would for a pool's (close() waits for the whole preparation)."""
    import threading

    from .._threads import cores_per_local_rank

    work = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
    threads = min(FAULT_IN_THREADS, cores_per_local_rank(), len(work))
    if threads < 2:
        return False
    pool = [threading.Thread(target=lambda share=work[i::threads]: [
                populate(address, nbytes, write=True) for address, nbytes in share],
                name=f"mcx-fault-in-{i}", daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return True


def _register(tensor: torch.Tensor, nbytes: int, *, faulted_in: bool = False) -> bool:
    """``cudaHostRegister`` ``nbytes`` at ``tensor``, its pages faulted in first (here unless
    ``faulted_in``, :func:`_fault_in` did): pinning faults the missing ones in itself while it
    holds the driver's lock, which every CUDA call of the process waits for (a training step
    beside the first save's preparation ran 3.3x slower, 1.2x with the pages faulted in first:
    docs/MEGATRON_LM.md, thirty-third session)."""
    if not faulted_in:
        populate(tensor.data_ptr(), nbytes, write=True)
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        logger.warning("cudaHostRegister of %d bytes failed (%s): staging into unpinned shared "
                       "memory (slower device-to-host copies)", nbytes, err)
        return False
    return True


def _shm_full_error(path: str, nbytes: int, key: str) -> InsufficientSharedMemory:
    free = os.statvfs(os.path.dirname(path))
    return InsufficientSharedMemory(
        f"--async-ckpt-use-cpu-shm: cannot reserve {nbytes} bytes in {os.path.dirname(path)} "
        f"for staging {key!r} ({free.f_bavail * free.f_frsize} bytes free). Fix: enlarge it "
        "(containers: docker run --shm-size=..., Kubernetes: an emptyDir with medium: Memory), "
        "or drop --async-ckpt-use-cpu-shm.")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _ensure_fd_room(count: int) -> None:
    """Each segment keeps one descriptor open: raise the soft limit, or fail with the fix."""
    if count == 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = _open_fds() + count + _FD_MARGIN
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise OSError(errno.EMFILE, f"staging {count} tensors in shared memory needs about "
                      f"{needed} open files but the hard limit is {hard}: raise it (ulimit -n, or "
                      "LimitNOFILE / --ulimit nofile=...), or drop --async-ckpt-use-cpu-shm")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY
                                                else min(hard, max(needed, soft * 2)), hard))
    logger.info("raised the open-files soft limit from %d for %d staging segments", soft, count)


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _sanitize(job_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", str(job_id))[:48] or "job"


def _warn_file_system_strategy() -> None:
    import torch.multiprocessing as tmp

    if tmp.get_sharing_strategy() == "file_system":
        warn_once("staging-file-system-strategy",
                  "torch.multiprocessing sharing strategy is 'file_system': staged "
                  "tensors are copied again when handed to a spawned writer. Use the "
                  "default 'file_descriptor' strategy for --async-ckpt-use-cpu-shm.")


# -- pickling by name ------------------------------------------------------------------------------
def _reduce_storage(storage: torch.UntypedStorage) -> tuple:
    """torch.multiprocessing's storage reducer, except for our live segments (sent by name)."""
    entry = _SEGMENTS.get(storage.data_ptr()) if storage.device.type == "cpu" else None
    if entry is not None and entry[1] == storage.nbytes():
        path, nbytes, keep = entry
        return _open_segment, (path, nbytes, (os.getpid(), _epoch) if keep else None)
    from torch.multiprocessing.reductions import reduce_storage

    return reduce_storage(storage)


def _open_segment(path: str, nbytes: int, epoch: tuple | None = None) -> torch.UntypedStorage:
    """The receiver's side of :func:`_reduce_storage`: map the named segment (shared lock held
    for as long as the mapping lives, like the owner's). With an ``epoch`` (the owner's pid and
    segment epoch) the mapping is kept for the next reference of the same epoch, and every kept
    mapping of an older epoch is dropped first."""
    if epoch is not None:
        if _MAPPED["epoch"] != epoch:
            _MAPPED["storages"] = {}  # the owner freed segments since: drop every old mapping
            _MAPPED["epoch"] = epoch
        kept = _MAPPED["storages"].get(path)
        if kept is not None and kept.nbytes() == nbytes:
            return kept
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    finally:
        os.close(fd)
    if epoch is not None:
        _MAPPED["storages"][path] = storage
    return storage


def drop_kept_mappings() -> int:
    """Drop every segment mapping this process keeps as a receiver; returns how many."""
    count = len(_MAPPED["storages"])
    _MAPPED["storages"], _MAPPED["epoch"] = {}, None
    return count


# -- the orphan sweep ------------------------------------------------------------------------------
def sweep_orphans(*, prefix: str = SEGMENT_PREFIX, dry_run: bool = False,
                  shm_dir: str = SHM_DIR) -> list[str]:
    """Remove our segments (``<prefix><job>_<rank>_<pid>_<n>``) left by processes that are gone.

    A segment is kept while its owner pid lives, while any process still maps it (the owner's
    shared flock travels with every mapping), or while a seal younger than its age bound names it
    (a snapshot a restart may adopt: :mod:`.retained`). Returns the paths removed (or, with
    ``dry_run``, that would be)."""
    from .retained import sealed_segments

    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    sealed = sealed_segments(shm_dir, expire=not dry_run)
    removed = []
    for name in names:
        pid = _owner_pid(name, prefix)
        if pid is None or pid_alive(pid):
            continue
        path = os.path.join(shm_dir, name)
        if path in sealed:
            continue
        if _remove_if_unmapped(path, dry_run=dry_run):
            removed.append(path)
    if removed:
        logger.info("%s %d orphaned staging segment(s) of dead processes in %s",
                    "would remove" if dry_run else "removed", len(removed), shm_dir)
    return removed


_NAME_TAIL = re.compile(r"_\d+_(\d+)_\d+$")  # _<rank>_<pid>_<n>


def _owner_pid(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    match = _NAME_TAIL.search(name)
    return int(match.group(1)) if match else None


def is_mapped(path: str) -> bool:
    """Whether a live process maps the segment at ``path`` (holds its shared flock)."""
    try:
        with unheld(path) as free:
            return not free
    except OSError:
        return False


def _remove_if_unmapped(path: str, *, dry_run: bool) -> bool:
    try:
        with unheld(path) as free:
            if not free:  # still mapped by a live process (a writer, another pid namespace)
                return False
            if not dry_run:
                _unlink(path)
            return True
    except OSError:
        return False  # gone already (another rank swept it) or not a regular file of ours
