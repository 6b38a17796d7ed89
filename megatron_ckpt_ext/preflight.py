"""Checks before the first save: enough host memory and /dev/shm on every node for what its
ranks will stage (node-level admission), enough disk for a checkpoint.

A shared-memory shortfall otherwise surfaces as SIGBUS in the middle of a save (tmpfs pages are
only claimed on first touch), and a node whose ranks together stage more than its memory is
OOM-killed at its first save (each rank alone fits; the sum does not). So the first save's staging
is admitted per node: every rank's bytes and its host's budget are gathered once, summed per host,
and every rank fails at once, naming the node, the bytes and the fix. The probes are injectable so
tests can simulate a small /dev/shm, a full disk or a small node.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import socket
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ._runtime import rank, warn_once
from .errors import CkptOptionsError, InsufficientHostMemory, InsufficientSharedMemory

__all__ = ["LIMIT_FLAG", "DiskUsage", "HostBudget", "admit_node", "cap_budget", "check_disk",
           "check_writable", "checkpoint_bytes_on_disk", "host_budget"]

logger = logging.getLogger(__name__)


class DiskUsage(NamedTuple):
    total: int
    used: int
    free: int


Probe = Callable[[str], DiskUsage]


def check_writable(checkpoint_dir: str | os.PathLike[str], *, flag: str = "--save") -> None:
    """Create ``checkpoint_dir`` (with parents) and a probe file in it, so an unwritable save
    directory fails at start-up, naming it, instead of at the first save hours later."""
    root = Path(checkpoint_dir)
    probe = root / f".mcx-write-probe.{os.getpid()}"
    blocker = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise CkptOptionsError(
            f"{flag} {root}: {'it' if blocker == root else blocker} is a file, not a "
            f"directory. Fix: point {flag} at a directory (a new path is created), not at a "
            "file.")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CkptOptionsError(
            f"{flag} {root}: the checkpoint directory is not writable ({type(e).__name__}: "
            f"{e.strerror or e}). Fix: point {flag} at a directory this job can create files "
            "in.") from e


def check_disk(checkpoint_dir: str | os.PathLike[str], last_checkpoint_bytes: int, *,
               probe: Probe | None = None, remeasure: bool = True) -> bool:
    """Warn (rank 0, once per directory) when the checkpoint directory has less free space than
    the last checkpoint took (``last_checkpoint_bytes``, or what the latest committed checkpoint
    there takes on disk, whichever is more). Returns True when there is enough.
    ``remeasure=False`` (the state's structure did not change since that checkpoint): the size
    measured on disk before for this directory stands, its files are not walked again."""
    last_checkpoint_bytes = max(last_checkpoint_bytes,
                                checkpoint_bytes_on_disk(checkpoint_dir, remeasure=remeasure))
    free = _free_bytes(checkpoint_dir, probe)[1]
    if free >= last_checkpoint_bytes:
        return True
    warn_once(f"disk:{checkpoint_dir}",
              f"{checkpoint_dir}: {_size(free)} free, but the last checkpoint took "
              f"{_size(last_checkpoint_bytes)}; the next save will likely fail. Free "
              "space there, or point --save at a larger file system.")
    return False


def disk_full_hint(checkpoint_dir: str | os.PathLike[str], needed: int, *,
                   probe: Probe | None = None) -> str:
    """For a failed save's error: a sentence when the checkpoint directory's file system has less
    free space than a checkpoint there takes (a full disk shows up in torch's writer only as e.g.
    ``unexpected pos 704 vs 598``), else ''."""
    try:
        where, free = _free_bytes(checkpoint_dir, probe)
    except OSError:
        return ""
    needed = max(needed, checkpoint_bytes_on_disk(checkpoint_dir))  # every rank's files
    if needed <= 0 or free >= needed:
        return ""
    return (f" {where} has {_size(free)} free and a checkpoint here takes about {_size(needed)}:"
            " the disk is likely full. Fix: free space there, or point --save at a larger file "
            "system.")


_ON_DISK: dict[str, tuple[int, int]] = {}  # root -> (iteration, bytes), measured once each


def checkpoint_bytes_on_disk(checkpoint_dir: str | os.PathLike[str], *,
                             remeasure: bool = True) -> int:
    """The bytes of every file of the latest committed checkpoint under ``checkpoint_dir`` (all
    ranks' files, metadata and manifest: what the next save will take), or 0. ``remeasure=False``
    returns the size measured before for this directory, if any, whatever its iteration."""
    from .save.layout import checkpoint_name, read_tracker

    if not remeasure and str(checkpoint_dir) in _ON_DISK:
        return _ON_DISK[str(checkpoint_dir)][1]

    try:
        iteration = read_tracker(checkpoint_dir)
    except (OSError, ValueError):
        return 0
    if iteration is None:
        return 0
    cached = _ON_DISK.get(str(checkpoint_dir))
    if cached is not None and cached[0] == iteration:
        return cached[1]
    total = 0
    for path in checkpoint_name(checkpoint_dir, iteration).rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass
    _ON_DISK[str(checkpoint_dir)] = (iteration, total)
    return total


def _free_bytes(checkpoint_dir: str | os.PathLike[str], probe: Probe | None) -> tuple[Path, int]:
    """The nearest existing directory at or above ``checkpoint_dir``, and its free bytes."""
    where = Path(checkpoint_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    return where, (probe or shutil.disk_usage)(str(where)).free


class HostBudget(NamedTuple):
    """What one host offers a save's staging, in bytes (-1: unknown or unlimited)."""

    shm_free: int  # free space of /dev/shm (cpu-shm staging lives there)
    mem_available: int  # MemAvailable, lowered to the cgroup's memory.max - memory.current
    memlock_limit: int  # RLIMIT_MEMLOCK (soft), reported: CUDA's pinning does not count on it


def host_budget(shm_path: str = "/dev/shm", *, meminfo: str = "/proc/meminfo",
                cgroup: str = "/sys/fs/cgroup") -> HostBudget:
    """This host's :class:`HostBudget`."""
    try:
        shm_free = shutil.disk_usage(shm_path).free
    except OSError:
        shm_free = -1
    available = -1
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # a container's limit (cgroup v2) can be far below the host's MemAvailable
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path(cgroup, "memory.current").read_text())
            available = left if available < 0 else min(available, left)
    except (OSError, ValueError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return HostBudget(shm_free, available, -1 if soft == resource.RLIM_INFINITY else soft)


LIMIT_FLAG = "--ckpt-node-memory-limit-mib"


def cap_budget(budget: HostBudget, limit_bytes: int | None) -> HostBudget:
    """``budget`` with its MemAvailable and /dev/shm figures lowered to ``limit_bytes`` (the
    node's memory this job may stage into; None: the measured figures stand)."""
    if limit_bytes is None:
        return budget
    cap = lambda x: limit_bytes if x < 0 else min(x, limit_bytes)  # noqa: E731 - -1: unknown
    return budget._replace(shm_free=cap(budget.shm_free), mem_available=cap(budget.mem_available))


def admit_node(nbytes: int, *, shm: bool, gather: Callable[[Any], list[Any]],
               budget: HostBudget | None = None, host: str | None = None,
               limit_bytes: int | None = None, held: tuple[int, int] | None = None,
               reclaim: Callable[[], Any] | None = None, kept: int = 0) -> dict:
    """Collective (``gather``: every rank's value, in rank order): admit the first save's
    staging of ``nbytes`` on this rank against its node's memory. The ranks are grouped by host
    name; a node's staging is the sum over its ranks; it must fit in the node's MemAvailable
    (or container limit) and, with ``shm``, in its /dev/shm, each lowered to ``limit_bytes``
    when given (``--ckpt-node-memory-limit-mib``). Raises on every rank (all see the
    same figures) when any node does not fit, naming the node, its ranks, the bytes and the
    fix; else returns the figures of the fullest node (``node_staging_bytes``, its budget,
    ``nodes``, ``limit_bytes``), logged on rank 0. ``held``: (seals, bytes) of the sealed
    snapshots that runs now ended left in this rank's /dev/shm (``retained.held_by_ended_runs``;
    None: /dev/shm's, with ``shm``). A node that fits once they are freed is not refused: its
    ranks free them (``reclaim``, default ``retained.reclaim_ended_runs`` of /dev/shm: those
    no live process maps), with one rank-0 warning, before any rank stages. A snapshot kept for
    a restart is a cache, storage the fallback: it never keeps a job from running. A node that
    does not fit even so is refused, the refusal naming them. ``kept``: staging bytes this rank
    holds already and keeps (the buffers of a snapshot adopted at a restore from memory: in the
    node's figures as used, not in ``nbytes``), named in the rank-0 line."""
    if held is None or (reclaim is None and shm):
        from .staging.retained import held_by_ended_runs, reclaim_ended_runs
        from .staging.segments import is_mapped

        if held is None:
            held = held_by_ended_runs("/dev/shm", is_mapped=is_mapped) if shm else (0, 0)
        if reclaim is None and shm:
            reclaim = lambda: reclaim_ended_runs("/dev/shm", is_mapped=is_mapped)  # noqa: E731
    mine = (host or socket.gethostname(), int(nbytes),
            tuple(budget if budget is not None else host_budget()), tuple(held), int(kept))
    nodes: dict[str, dict] = {}
    for r, (name, n, measured, seals, *more) in enumerate(gather(mine)):
        b = cap_budget(HostBudget(*measured), limit_bytes)  # the same limit on every rank
        node = nodes.setdefault(name, {"ranks": [], "bytes": 0, "budget": HostBudget(*b),
                                       "max_rank_bytes": 0, "held": (0, 0), "kept": 0,
                                       "measured": HostBudget(*measured)})
        node["ranks"].append(r)
        node["bytes"] += n
        node["kept"] += more[0] if more else 0
        node["max_rank_bytes"] = max(node["max_rank_bytes"], n)
        node["held"] = max(node["held"], tuple(seals), key=lambda h: h[1])  # one /dev/shm
        # the tightest figure any of the node's ranks measured (they measured the same machine)
        node["budget"], node["measured"] = (
            HostBudget(*(min(x, y) if x >= 0 and y >= 0 else max(x, y) for x, y in zip(a, c)))
            for a, c in ((node["budget"], b), (node["measured"], HostBudget(*measured))))
    short = {name: _node_shortfall(name, node, shm=shm) for name, node in nodes.items()}
    short = {name: s for name, s in short.items() if s}
    freeing = short and reclaim is not None and all(
        _fits_once_freed(nodes[name], limit_bytes, shm=shm) for name in short)
    if short and not freeing:
        error = (InsufficientSharedMemory if all(s[0] for s in short.values())
                 else InsufficientHostMemory)
        raise error(" ".join(s[1] for s in short.values()) + _limit_text(limit_bytes)
                    + " Fix: " + _FIX + (_FIX_SHM if shm else "") + _fix_limit(limit_bytes))
    if freeing:  # (C) every rank: the short nodes' ranks free, then all wait for them
        if mine[0] in short:
            reclaim()
        gather(None)
        if rank() == 0:
            logger.warning(
                "staging did not fit beside the sealed snapshots that runs now ended left in "
                "/dev/shm of %s: freed them, so a restart of those runs there reads its "
                "checkpoint from storage (a snapshot kept for a restart never keeps a job from "
                "running)", ", ".join(
                    f"node {n} ({nodes[n]['held'][0]} snapshot(s), {_size(nodes[n]['held'][1])})"
                    for n in sorted(short)))
    name, node = max(nodes.items(), key=lambda kv: kv[1]["bytes"])
    budget_used = node["budget"]
    result = {"nodes": len(nodes), "node": name, "node_ranks": len(node["ranks"]),
              "node_staging_bytes": node["bytes"], "node_kept_bytes": node["kept"],
              **budget_used._asdict(),
              "limit_bytes": limit_bytes,
              "freed_snapshots": {n: nodes[n]["held"][0] for n in short} if freeing else {}}
    if rank() == 0:
        kept_text = (f" more beside the {_size(node['kept'])} its ranks hold already (restored"
                     " snapshots' buffers, staged into from now on)" if node["kept"] else "")
        logger.info("staging admitted: %d node(s); the fullest, %s, stages %s%s over %d ranks "
                    "(MemAvailable %s%s)", len(nodes), name, _size(node["bytes"]), kept_text,
                    len(node["ranks"]), _size(budget_used.mem_available),
                    f", /dev/shm free {_size(budget_used.shm_free)}" if shm else "")
    return result


_FIX = ("stage less per node (more model parallelism, or fewer ranks per node), give the node "
        "more memory (containers: a larger memory limit), or save synchronously (no "
        "--async-save: nothing is staged).")
_FIX_SHM = (" For /dev/shm: enlarge it (docker run --shm-size=..., Kubernetes: an emptyDir with "
            "medium: Memory), or drop --async-ckpt-use-cpu-shm (plain host copies, in RAM).")


def _limit_text(limit_bytes: int | None) -> str:
    if limit_bytes is None:
        return ""
    return (f" {LIMIT_FLAG} {limit_bytes // 2**20} caps each node's MemAvailable and /dev/shm "
            f"figures at {_size(limit_bytes)}.")


def _fix_limit(limit_bytes: int | None) -> str:
    if limit_bytes is None:
        return ""
    return (f" Or raise {LIMIT_FLAG} (it reserves the rest of the node's memory for other "
            "uses, such as data loaders), or drop it to admit against the measured figures.")


def _node_shortfall(name: str, node: dict, *, shm: bool) -> tuple[bool, str] | None:
    """(only /dev/shm is short, sentence) for a node whose staging does not fit, else None."""
    need, b = node["bytes"], node["budget"]
    ranks = node["ranks"]
    what = (f"node {name} (ranks {_ranks_text(ranks)}): its {len(ranks)} ranks stage "
            f"{_size(need)} for a save (at most {_size(node['max_rank_bytes'])} on one rank)")
    missing = []
    if b.mem_available >= 0 and need > b.mem_available:
        missing.append("MemAvailable (or the container's memory limit) leaves "
                       f"{_size(b.mem_available)}")
    if shm and b.shm_free >= 0 and need > b.shm_free:
        missing.append(f"/dev/shm has {_size(b.shm_free)} free")
    if not missing:
        return None
    seals, held = node.get("held", (0, 0))
    if held > 0:  # a node whose /dev/shm outlived a job: what holds it, and how to free it
        missing[-1] += (f" ({seals} sealed snapshot(s) left by runs that have ended hold "
                        f"{_size(held)} of its shared memory: 'python -m megatron_ckpt_ext shm "
                        "list' shows whose, 'shm clean' frees them)")
    return (len(missing) == 1 and missing[0].startswith("/dev/shm"),
            f"{what}, but {' and '.join(missing)}.")


def _fits_once_freed(node: dict, limit_bytes: int | None, *, shm: bool) -> bool:
    """Whether the node's staging fits once the snapshots of ended runs are freed (their pages
    count in its /dev/shm and, being shared memory, against its MemAvailable)."""
    seals, held = node["held"]
    if held <= 0:
        return False
    b = node["measured"]
    freed = cap_budget(b._replace(
        shm_free=b.shm_free + held if b.shm_free >= 0 else -1,
        mem_available=b.mem_available + held if b.mem_available >= 0 else -1), limit_bytes)
    return _node_shortfall("", {**node, "budget": freed}, shm=shm) is None


def _ranks_text(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"
