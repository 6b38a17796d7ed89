"""Rank bodies of the reliability harness (issue 9): crash jobs, worker death, soak.

Used by ``tools/reliability.py`` (the long trials) and ``tests/functional/multirank/test_reliability.py``
(the CI subset). A module of its own, importable from the repository root, because the functions
injected into a save request (a held or failing write) are pickled to spawned writer processes.

States are a deterministic function of (iteration, rank), so whoever loads a checkpoint can
recompute what it must hold.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import shutil
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save.layout import checkpoint_name, read_tracker
from megatron_ckpt_ext.errors import CheckpointWriteError
from megatron_ckpt_ext.hooks import SaveHooks

from tests._support.dist import device, sharded

__all__ = ["MODES", "PHASES", "crash_job", "fork_soak", "soak", "trial_state", "verify_committed",
           "worker_death"]

MODES: dict[str, dict[str, Any]] = {
    # the new stack: one long-lived writer, per-tensor shm staging, cached plan
    "persistent-shm": {"async_save": True, "use_persistent_ckpt_worker": True,
                       "async_ckpt_use_cpu_shm": True, "ckpt_assume_constant_structure": True},
    # plain async: a fresh forked writer per save, plain CPU copies
    "temporal": {"async_save": True},
    # a fresh forked writer per save, shm staging (a new buffer set per save, sealed at commit)
    "temporal-shm": {"async_save": True, "async_ckpt_use_cpu_shm": True},
    # the new stack with --ckpt-memory-snapshot-sets 2: the last committed snapshot stays sealed
    # while the next save stages, writes and commits
    "persistent-shm-2sets": {"async_save": True, "use_persistent_ckpt_worker": True,
                             "async_ckpt_use_cpu_shm": True,
                             "ckpt_assume_constant_structure": True,
                             "ckpt_memory_snapshot_sets": 2},
    "temporal-shm-2sets": {"async_save": True, "async_ckpt_use_cpu_shm": True,
                           "ckpt_memory_snapshot_sets": 2},
    # the new stack with partner copies: each rank stands for a node of its own (its own
    # shared-memory directory, the campaign's ``nodes``/node<rank>), its snapshot copied to
    # the next rank's; the campaign may empty node 0's directory after a kill (a lost node)
    "persistent-shm-partner": {"async_save": True, "use_persistent_ckpt_worker": True,
                               "async_ckpt_use_cpu_shm": True,
                               "ckpt_assume_constant_structure": True,
                               "ckpt_memory_partner": True},
}
# Where a crash job holds (so the harness SIGKILLs it exactly there), in save order.
PHASES = ("before_save", "staging", "write", "before_rename", "after_rename", "after_tracker")
HOLD_S = 120.0  # a held rank waits this long for the harness's SIGKILL


def trial_state(iteration: int, rank: int) -> dict[str, torch.Tensor]:
    """Distinct values per iteration and rank; fp32, bf16 and int64; ~70 KB per rank."""
    g = torch.Generator().manual_seed(100_003 * iteration + rank)
    state = {"w": torch.randn(128, 96, generator=g),
             "b": torch.randn(4096, generator=g).to(torch.bfloat16),
             "it": torch.full((8,), iteration, dtype=torch.int64)}
    return {k: v.to(device()) for k, v in state.items()}


SOAK_PARAMS = 400  # the soak's state: as many small tensors as a 134M GPT's (growth per tensor)


def soak_state(iteration: int, rank: int) -> dict[str, torch.Tensor]:
    """:func:`trial_state` plus ``SOAK_PARAMS`` small tensors (256 B each): what leaks per tensor
    and save (a writer's uncollected garbage, ~5.6 KB a tensor, once) shows within a short soak."""
    state = trial_state(iteration, rank)
    g = torch.Generator().manual_seed(7 * iteration + rank)
    many = torch.randn(SOAK_PARAMS, 64, generator=g).to(device())
    return {**state, **{f"p{i:03d}": many[i].clone() for i in range(SOAK_PARAMS)}}


def options_for(mode: str, **extra: Any) -> CkptOptions:
    return CkptOptions(**{**MODES[mode], **extra})


# -- verification ------------------------------------------------------------------------------
def committed_iterations(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit())


def verify_committed(ck: Checkpointer, rank: int, world: int, root: Path) -> dict:
    """Load the tracker's checkpoint (as a resuming job would) and every other committed one;
    each must load and equal the state of its own save. Collective (same order on every rank)."""
    tracker = read_tracker(root)
    out: dict[str, Any] = {"tracker": tracker, "checked": [], "torn": [], "errors": [],
                           "incomplete": sorted(p.name for p in root.glob("iter_*.incomplete"))}
    said = _MemoryLines.attach()  # rank 0's line on the tier (why not memory)
    if tracker is not None:  # as the adapter does while the model is built: the restore of a
        ck.prepare_restore(root)  # sealed snapshot is mapped, summed and pinned ahead
    for it in ([None] if tracker is not None else []) + committed_iterations(root):
        label = tracker if it is None else it
        like = {k: torch.zeros_like(v) for k, v in trial_state(0, rank).items()}
        try:
            with said.only(it is None):
                got = ck.load(sharded(rank, world, like), root, iteration=it)
        except Exception as e:  # noqa: BLE001 - a committed checkpoint that does not load is torn
            out["torn"].append(label)
            out["errors"].append(f"iteration {label}: {type(e).__name__}: {e}"[:400])
            continue
        if it is None:  # the resume: from the node's sealed snapshot, or from storage
            out["tier"] = ck.load_reports[-1].get("tier")
            detail = ck.load_reports[-1].get("memory_detail") or {}
            out["summed_ahead"] = detail.get("summed_ahead")  # what the restart's
            # prepare_restore summed, if taken; a snapshot fetched from the partner's copy:
            out["fetched"] = (detail.get("partner_fetch") or {}).get("ok")
            out["memory_line"] = said.lines[-1] if said.lines else None
        want = trial_state(label, rank)
        if not all(torch.equal(got[k], want[k]) for k in want):
            out["torn"].append(label)
            out["errors"].append(f"iteration {label}: values differ from its own save")
        out["checked"].append(label)
    logging.getLogger("megatron_ckpt_ext.load.memory").removeHandler(said)
    return out


class _MemoryLines(logging.Handler):
    """Collects what the memory tier logs (rank 0: which tier, and why not memory) while
    ``only(True)``. Sets that one logger to INFO: a crash job configures no other handler, so
    the lines go nowhere else."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.on = False

    @classmethod
    def attach(cls) -> _MemoryLines:
        handler = cls()
        log = logging.getLogger("megatron_ckpt_ext.load.memory")
        log.setLevel(logging.INFO)
        log.addHandler(handler)
        return handler

    @contextlib.contextmanager
    def only(self, on: bool) -> Iterator[None]:
        self.on = on
        try:
            yield
        finally:
            self.on = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.on:
            self.lines.append(record.getMessage()[:400])


def prune(root: Path, keep_from: int | None) -> None:
    """Rank 0 housekeeping: drop committed checkpoints older than ``keep_from`` and stale
    ``.incomplete`` directories (disk stays bounded over many trials)."""
    if keep_from is None:
        return
    for it in committed_iterations(root):
        if it < keep_from:
            shutil.rmtree(checkpoint_name(root, it), ignore_errors=True)
    for p in root.glob("iter_*.incomplete"):
        if int(p.name[5:12]) < keep_from:
            shutil.rmtree(p, ignore_errors=True)


def shm_segments(job_id: str | None = None) -> list[Path]:
    prefix = "mcx_" + (f"{job_id}_" if job_id else "")
    return sorted(Path("/dev/shm").glob(prefix + "*"))


def dead_owner_segments(job_prefix: str) -> list[str]:
    """Staging segments of jobs named ``job_prefix*`` whose owner process is gone: what the
    sweep at start-up should have removed (other runs sharing /dev/shm are not counted)."""
    from megatron_ckpt_ext.staging import SEGMENT_PREFIX, sweep_orphans

    return sweep_orphans(dry_run=True, prefix=SEGMENT_PREFIX + job_prefix)  # sealed ones kept


# -- hooks: hold a rank (or its writer) where the harness will SIGKILL it ---------------------
def _hold(marker_dir: str, phase: str, rank: int) -> None:
    Path(marker_dir, f"hit_{phase}_r{rank}").write_text(f"{os.getpid()} {time.time()}")
    time.sleep(HOLD_S)
    raise RuntimeError(f"crash job: the harness did not kill the run held at {phase}")


def hold_in_writer(marker: str, hold_s: float, write: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
    """Runs in the writer process: say where it is (pid), wait, then write for real."""
    Path(marker).write_text(str(os.getpid()))
    time.sleep(hold_s)
    return write(*args, **kwargs)


def failing_write(write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A writer whose storage is full: raises ENOSPC before writing anything."""
    raise OSError(errno.ENOSPC, "No space left on device (injected by the reliability harness)")


def fsize_limited_write(limit: int, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A real failing write(2): the writer may not grow a file past ``limit`` bytes (EFBIG)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return write(*args, **kwargs)


class Harness(SaveHooks):
    """Holds or fails saves at chosen points, through the Checkpointer's hook seam: ``holds``
    maps a point of :data:`megatron_ckpt_ext.hooks.POINTS` to an action on the save's record;
    ``wraps`` are ``(when(record), wrap(write))`` pairs applied to the writer's function."""

    def __init__(self, progress: Callable[[str, int], None] | None = None) -> None:
        self.holds: dict[str, Callable[[Any], None]] = {}
        self.wraps: list[tuple[Callable[[Any], bool], Callable[[Any], Any]]] = []
        self.progress = progress  # told each point reached (where a kill found the rank)

    def at(self, point: str, record: Any) -> None:
        if self.progress is not None:
            self.progress(point, record.iteration)
        action = self.holds.get(point)
        if action is not None:
            action(record)

    def wrap_request(self, request: Any, record: Any) -> Any:
        for when, wrap in self.wraps:
            if when(record):
                request = request._replace(async_fn=wrap(request.async_fn))
        return request


def install_crash_hook(harness: Harness, phase: str, rank: int, kill_iter: int,
                       marker_dir: str) -> None:
    """Hold this rank (or its writer) at ``phase`` of the save of ``kill_iter``. The commit of
    iteration N may run inside save(N+1): the record says which save it is."""
    at_kill = lambda record: record.iteration == kill_iter  # noqa: E731
    hold = partial(_hold, marker_dir, phase, rank)
    point = {"staging": "staged", "before_rename": "before_commit", "after_rename": "renamed",
             "after_tracker": "tracker_written"}.get(phase)
    if point is not None:
        harness.holds[point] = lambda record: hold() if at_kill(record) else None
    elif phase == "write":
        marker = str(Path(marker_dir, f"hit_write_r{rank}"))
        harness.wraps.append((at_kill, lambda fn: partial(hold_in_writer, marker, HOLD_S, fn)))


# -- crash job ------------------------------------------------------------------------------------
def crash_job(rank: int, world: int, spec: dict) -> None:
    """One job of a crash trial: verify what the previous (killed) job left, then save every
    step until the harness kills it (or ``saves`` steps are done)."""
    import torch.distributed as dist

    root, out = Path(spec["root"]), Path(spec["out"])
    progress = partial(_say_progress, out / f"progress_r{rank}.json")
    harness = Harness(progress)
    options = options_for(spec["mode"])
    stager = None
    if options.ckpt_memory_partner:  # this rank's "node": a shared-memory directory of its own
        from megatron_ckpt_ext.staging import ShmStager

        stager = ShmStager(job_id=spec["job_id"], rank=rank, shm_dir=node_dir(spec, rank),
                           reuse=options.ckpt_assume_constant_structure)
    with Checkpointer(options, job_id=spec["job_id"], hooks=harness,
                      stager=stager) as ck:  # sweeps orphans
        verified = verify_committed(ck, rank, world, root)
        verified["shm_dead_owner_after_start"] = len(dead_owner_segments(spec["campaign"]))
        start = verified["tracker"] or 0
        _write_json(out / f"verify_r{rank}.json", verified)
        dist.barrier()
        if rank == 0:
            prune(root, start - 1 if start else None)
            _write_json(out / "ready.json", {"start": start, "time": time.time()})
        dist.barrier()
        kill_iter = start + spec.get("kill_offset", 2)
        now = {"it": 0}
        if spec.get("phase") in PHASES and rank == spec.get("hook_rank", 0):
            install_crash_hook(harness, spec["phase"], rank, kill_iter, str(out))
        run_saves(ck, rank, world, root, range(start + 1, start + 1 + spec["saves"]), now,
                  hold_before_save=(spec.get("phase") == "before_save"
                                    and rank == spec.get("hook_rank", 0)),
                  kill_iter=kill_iter, marker_dir=str(out), step_s=spec.get("step_s", 0.0),
                  progress=progress)
        progress("drain", now["it"])
        ck.maybe_finalize(blocking=True)
        progress("close", now["it"])
    if rank == 0:
        _write_json(out / "finished.json", {"tracker": read_tracker(root), "time": time.time()})


def node_dir(spec: dict, rank: int) -> str:
    return os.path.join(spec["nodes"], f"node{rank}")


def run_saves(ck: Checkpointer, rank: int, world: int, root: Path, iterations: range, now: dict,
              *, hold_before_save: bool = False, kill_iter: int = -1, marker_dir: str = "",
              step_s: float = 0.0, progress: Callable[[str, int], None] | None = None,
              state_fn: Callable[[int, int], dict] = trial_state) -> None:
    """One save per iteration; with ``step_s`` a training step of that long after each (half
    before a commit check, half after: the committed save is sealed meanwhile), so that kills
    also land between saves, where a sealed memory snapshot exists. ``progress(where, it)`` is
    told each step of the loop."""
    say = progress or (lambda where, it: None)
    live = state_fn(0, rank)
    for it in iterations:
        now["it"] = it
        for k, v in state_fn(it, rank).items():
            live[k].copy_(v)  # same storage every step (constant structure)
        if hold_before_save and it == kill_iter:
            _hold(marker_dir, "before_save", rank)
        say("save", it)
        ck.save(sharded(rank, world, live), root, iteration=it)
        for v in live.values():
            v.fill_(-1)  # training moves on at once: the checkpoint must not see this
        say("finalize", it)
        ck.maybe_finalize()
        if step_s:
            say("step", it)
            time.sleep(step_s / 2)
            say("finalize", it)
            ck.maybe_finalize()
            say("step", it)
            time.sleep(step_s / 2)


def _say_progress(path: Path, where: str, iteration: int) -> None:
    """Where this rank is (``save`` and the hook points: inside save ``iteration``;
    ``finalize``: a commit check, a collective; ``step``: training between saves)."""
    import threading

    tmp = path.with_name(f"{path.name}.{threading.get_ident()}")  # a hook may run on a thread
    tmp.write_text(json.dumps({"at": where, "it": iteration, "time": time.time()}))
    os.replace(tmp, path)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# -- worker death -------------------------------------------------------------------------------
def _persistent_process() -> Any:
    """The persistent writer: between saves, the one child of this trainer that is not
    multiprocessing's resource tracker (a psutil.Process)."""
    import psutil

    writers = [p for p in psutil.Process().children()
               if not any("resource_tracker" in part for part in p.cmdline())]
    if len(writers) != 1:
        raise RuntimeError(f"expected one persistent writer process to kill, found {writers}")
    return writers[0]


def _wait_until_dead(process: Any, timeout: float) -> None:
    """Until ``process`` has exited, without reaping it (its multiprocessing parent must see the
    exit code itself: that is what the checkpointer checks)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise RuntimeError(f"writer {process.pid} still alive {timeout:.0f} s after SIGKILL")


def _wait_for(path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
    time.sleep(0.05)
    return path.read_text()


def worker_death(rank: int, world: int, root: str, mode: str, how: str, out: str,
                 timeout_s: int = 60) -> None:
    """Save 1 commits; the save of 2 fails on the victim rank (the last one) in the way ``how``
    says; every rank must raise CheckpointWriteError in bounded time, the tracker must still
    name 1 and load it; a retry (save 3) must commit; close() must leave no child process.

    ``how``: ``kill`` (SIGKILL the writer mid-write), ``kill_idle`` (SIGKILL the persistent
    worker between saves), ``hang`` (the writer never finishes; --ckpt-timeout 3), ``enospc``
    (the write raises ENOSPC), ``fsize`` (a real write(2) fails with EFBIG)."""
    import psutil

    rootp, victim = Path(root), rank == world - 1
    ck_timeout = 3 if how == "hang" else timeout_s
    result: dict[str, Any] = {"rank": rank, "mode": mode, "how": how}
    harness = Harness()
    ck = Checkpointer(options_for(mode, ckpt_timeout=ck_timeout), hooks=harness)
    live = trial_state(1, rank)
    ck.save(sharded(rank, world, live), rootp, iteration=1)
    ck.maybe_finalize(blocking=True)
    marker = Path(out, f"writer_r{rank}")
    if victim:
        _inject(ck, harness, how, marker)
    t0 = time.perf_counter()
    try:
        for k, v in trial_state(2, rank).items():
            live[k].copy_(v)
        ck.save(sharded(rank, world, live), rootp, iteration=2)
        if victim and how == "kill":
            os.kill(int(_wait_for(marker, 60)), signal.SIGKILL)
        if how == "hang":  # bounded here: a timeout that is not enforced fails in seconds
            _finalize_within(ck, ck_timeout + 10.0)
        else:
            ck.maybe_finalize(blocking=True)
        result["error"] = None
    except CheckpointWriteError as e:
        result["error"] = str(e)
    result["seconds_to_error"] = round(time.perf_counter() - t0, 3)
    result["tracker_after_failure"] = read_tracker(rootp)
    result["iter2_committed"] = checkpoint_name(rootp, 2).exists()
    like = {k: torch.zeros_like(v) for k, v in trial_state(0, rank).items()}
    got = ck.load(sharded(rank, world, like), rootp)
    result["previous_intact"] = all(torch.equal(got[k], v) for k, v in trial_state(1, rank).items())
    for k, v in trial_state(3, rank).items():  # the documented retry: the next save just works
        live[k].copy_(v)
    ck.save(sharded(rank, world, live), rootp, iteration=3)
    ck.maybe_finalize(blocking=True)
    result["tracker_after_retry"] = read_tracker(rootp)
    got = ck.load(sharded(rank, world, like), rootp)
    result["retry_intact"] = all(torch.equal(got[k], v) for k, v in trial_state(3, rank).items())
    ck.close()
    me = psutil.Process()
    _, alive = psutil.wait_procs(me.children(recursive=True), timeout=10)
    result["children_after_close"] = [f"{p.pid}:{p.name()}" for p in alive]
    _write_json(Path(out, f"death_r{rank}.json"), result)


def _finalize_within(ck: Checkpointer, bound_s: float, poll_s: float = 0.1) -> None:
    """Poll ``maybe_finalize`` (collective) a fixed number of times, the same on every rank, for
    about ``bound_s`` seconds; raise AssertionError if the pending save neither committed nor
    raised by then (a stuck writer must not hold the test until the process timeout)."""
    for _ in range(int(bound_s / poll_s)):
        if ck.maybe_finalize():
            return
        time.sleep(poll_s)
    import psutil

    for child in psutil.Process().children(recursive=True):  # else this rank's exit waits on
        child.kill()  # its stuck writer for ever
    raise AssertionError(f"a writer stuck past --ckpt-timeout {ck.options.ckpt_timeout} s raised "
                         f"no CheckpointWriteError within {bound_s:.0f} s: the timeout is not "
                         "enforced")


def _inject(ck: Checkpointer, harness: Harness, how: str, marker: Path) -> None:
    first = lambda record: record.iteration == 2  # noqa: E731 - the retry must write normally
    wraps = {"kill": lambda fn: partial(hold_in_writer, str(marker), HOLD_S, fn),
             "hang": lambda fn: partial(hold_in_writer, str(marker), 3600.0, fn),
             "enospc": lambda fn: partial(failing_write, fn),
             "fsize": lambda fn: partial(fsize_limited_write, 1024, fn)}
    if how in wraps:
        harness.wraps.append((first, wraps[how]))
    elif how == "kill_idle":  # dead (and reaped) before the next save starts
        process = _persistent_process()
        os.kill(process.pid, signal.SIGKILL)
        _wait_until_dead(process, 30.0)
    else:
        raise ValueError(f"unknown worker-death case {how!r}")


# -- soak -----------------------------------------------------------------------------------------
def soak(rank: int, world: int, root: str, mode: str, saves: int, out: str,
         sample_every: int = 10, verify_every: int = 20) -> None:
    """``saves`` async saves of a constant structure (:func:`soak_state`: 400 small tensors
    besides the trial state); every ``sample_every`` saves (after a blocking finalize) sample
    RSS, our /dev/shm bytes, open fds and child processes; every ``verify_every`` saves then load
    that checkpoint back bit-exact; older checkpoints are deleted."""
    import psutil

    rootp, me = Path(root), psutil.Process()
    job = f"soak{os.getppid()}"
    samples, verified, mismatched = [], [], []
    now = {"it": 0}
    with Checkpointer(options_for(mode), job_id=job) as ck:
        live = soak_state(0, rank)
        ck.prepare(sharded(rank, world, live))
        for it in range(1, saves + 1):
            run_saves(ck, rank, world, rootp, range(it, it + 1), now, state_fn=soak_state)
            if it % sample_every and it % verify_every:
                continue
            ck.maybe_finalize(blocking=True)
            if it % sample_every == 0:  # before a load: its files and threads may still close
                samples.append(_sample(me, job, rank, it))
            if it % verify_every == 0:
                like = {k: torch.zeros_like(v) for k, v in soak_state(0, rank).items()}
                got = ck.load(sharded(rank, world, like), rootp, iteration=it)
                same = all(torch.equal(got[k], v) for k, v in soak_state(it, rank).items())
                (verified if same else mismatched).append(it)
            torch.distributed.barrier()
            if rank == 0:
                prune(rootp, it)
    _write_json(Path(out, f"soak_r{rank}.json"), {"samples": samples, "verified": verified,
                                                   "mismatched": mismatched})


def _sample(me: Any, job: str, rank: int, it: int) -> dict:
    children = me.children(recursive=True)
    return {"save": it, "rss": me.memory_info().rss,
            "children_rss": sum(_rss(p) for p in children),
            "shm_bytes": sum(p.stat().st_size for p in shm_segments(f"{job}_{rank}")),
            "fds": _steady_fds(me), "children": len(children)}


def _steady_fds(me: Any) -> int:
    """Open fds, the fewest of three reads 20 ms apart: a background thread's file open for a
    moment (the seal's JSON written after a commit) is no leak, and a leak shows in all three
    (CI saw 30 then 31 once, on 2 busy cores)."""
    counts = []
    for _ in range(3):
        counts.append(me.num_fds())
        time.sleep(0.02)
    return min(counts)


def _rss(p: Any) -> int:
    try:
        return p.memory_info().rss
    except Exception:  # noqa: BLE001 - a child that just exited
        return 0


# -- entry point of a crash-job rank (started by tools/reliability.py) -------------------------
def rank_main(spec_path: str) -> None:
    """``python -c 'import tools._reliability_workers as w; w.rank_main(SPEC)'``
    with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set: one rank of a crash job."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device() == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device() == "cuda" else "gloo")
    try:
        crash_job(rank, world, spec)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see tests/_support/dist.py: torch 2.13's exit-time teardown can abort


# -- fork soak: writers forked many times; count the ones stuck in Python's after-fork start ---
def fork_soak(rank: int, world: int, root: str, out_dir: str, mode: str, saves: int,
              start_timeout_s: float | None) -> None:
    """``saves`` async saves in one Checkpointer (a temporal writer is forked per save); counts
    the writers the WriterPool found stuck at start and forked again (its WARNING), the forks
    made while a torch.distributed worker thread was still busy after the wait, each save's wall
    time (save + blocking finalize), and whether every save committed. ``start_timeout_s`` None:
    the product's. Results: ``<out_dir>/forks_r<rank>.json``."""
    import logging
    import statistics

    from megatron_ckpt_ext import _runtime
    from megatron_ckpt_ext.save import writers

    if start_timeout_s is not None:
        writers.WRITER_START_TIMEOUT_S = start_timeout_s
    stuck: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "forked the writer again" in record.getMessage():
                stuck.append(record.getMessage())

    logging.getLogger("megatron_ckpt_ext").addHandler(Count(logging.WARNING))
    state = trial_state(1, rank)
    walls: list[float] = []
    t0 = time.perf_counter()
    with Checkpointer(CkptOptions(**MODES[mode], most_recent_k=2)) as ck:
        for it in range(1, saves + 1):
            t = time.perf_counter()
            ck.save(sharded(rank, world, state), root, iteration=it)
            ck.maybe_finalize(blocking=True)
            walls.append(time.perf_counter() - t)
        committed = len(ck.reports)
    Path(out_dir, f"forks_r{rank}.json").write_text(json.dumps({
        "rank": rank, "saves": saves, "committed": committed, "reforks": len(stuck),
        "forks_waited": _runtime.fork_waits()["waited"],
        "forks_unquiet": _runtime.fork_waits()["unquiet"],
        "start_timeout_s": writers.WRITER_START_TIMEOUT_S,
        "save_wall_s": {"median": round(statistics.median(walls), 4),
                        "max": round(max(walls), 3),
                        "over_1s": sum(w > 1.0 for w in walls)},
        "seconds": round(time.perf_counter() - t0, 1), "warnings": stuck[:5]}))
