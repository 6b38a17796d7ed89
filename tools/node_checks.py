"""Node checks: N ranks of one host, each check in the same run, one JSON of results.

    torchrun --standalone --nproc-per-node 4 tools/node_checks.py --out DIR             # CPU, gloo
    torchrun --standalone --nproc-per-node 8 tools/node_checks.py --out DIR \\
        --device cuda --ranks-per-device 8                                         # 8 on one GPU

Checks, in order, each with a fresh Checkpointer (cpu-shm staging, async saves) and its own
directory under ``--out``:

- ``admission_fits``: the first save is admitted against the node's measured memory and
  /dev/shm (its ``Checkpointer.admission`` figures: this node's ranks and bytes) and commits.
- ``admission_refused``: ``--ckpt-node-memory-limit-mib`` below the node's staging: every rank
  raises the same InsufficientHostMemory/InsufficientSharedMemory, naming the node and the knob.
- ``writer_killed``: the last rank's writer is SIGKILLed in the middle of a save's write; every
  rank's ``maybe_finalize`` raises CheckpointWriteError within ``--check-timeout-s`` (the
  seconds from the kill to the error, per rank), and the tracker still names the previous save.
- ``preempt_and_retention``: a loop saving every iteration under ``--exit-signal-handler``,
  ``--most-recent-k 2`` and ``--save-retain-interval 3``; SIGTERM to every rank and every
  process under it (their writers too, as a scheduler's job-wide signal); the loop ends on
  every rank at the same iteration, whose checkpoint is the latest, verifies
  (``python -m megatron_ckpt_ext verify``) and loads back, with exactly the retained ones left.

No check can hang the run: collectives time out after ``--collective-timeout-s``, each check's
waits after ``--check-timeout-s``, and the whole run is ended (stacks dumped) after
``--timeout-s``. The JSON (``DIR/node_checks.json``, rewritten after each check) has
``world_size``, ``ranks_per_device``, ``layout``, ``device``, ``versions``, ``command`` and per
check ``passed``, ``seconds`` and ``details``; the exit status is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import _bench_node as node  # noqa: E402

from megatron_ckpt_ext import CheckpointWriteError, Checkpointer, CkptOptions, backend  # noqa: E402
from megatron_ckpt_ext.errors import InsufficientHostMemory  # noqa: E402
from megatron_ckpt_ext.preflight import LIMIT_FLAG  # noqa: E402
from megatron_ckpt_ext.save.layout import read_tracker  # noqa: E402
from tools._reliability_workers import HOLD_S, Harness, hold_in_writer  # noqa: E402

SCHEMA = "megatron-ckpt-ext/node-checks/1"
MODES = {  # the production stack, and a fresh forked writer per save
    "persistent-shm": {"use_persistent_ckpt_worker": True},
    "temporal-shm": {},
}
KEEP_RECENT, RETAIN_EVERY = 2, 3  # preempt_and_retention's --most-recent-k, --save-retain-interval


@dataclass
class Run:
    args: argparse.Namespace
    layout: node.Layout
    ctl: node.Ctl
    device: torch.device
    rank: int
    host: str

    def options(self, **extra: Any) -> CkptOptions:
        return CkptOptions(async_save=True, async_ckpt_use_cpu_shm=True,
                           ckpt_assume_constant_structure=True, ckpt_timeout=self.args.ckpt_timeout,
                           **MODES[self.args.mode], **self.timeouts(), **extra)

    def timeouts(self) -> dict:
        """The Checkpointer's own collectives time out with the process groups."""
        return {"distributed_timeout_minutes": max(1, round(self.args.collective_timeout_s / 60))}

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """Distinct values per (rank, step), ``--mib-per-rank`` MiB of float32."""
        n = self.args.mib_per_rank * 2**18
        w = torch.arange(n, dtype=torch.float32, device=self.device).remainder_(65521)
        return {"w": w.add_(1000.0 * step + self.rank)}

    def sharded(self, tensors: dict[str, torch.Tensor]) -> dict:
        cls, world = backend.sharded_tensor_cls(), self.layout.world_size
        return {k: cls.from_rank_offsets(k, t, (0, self.rank, world)) for k, t in tensors.items()}

    def node_bytes(self) -> int:
        """What this host's ranks stage together for one save."""
        return self.layout.local_world_size * self.args.mib_per_rank * 2**20

    def root(self, check: str) -> Path:
        return Path(self.args.out, f"ckpt_{check}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSON and the checkpoints")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    node.add_ranks_per_device(p)
    p.add_argument("--mib-per-rank", type=int, default=4, help="state per rank (MiB)")
    p.add_argument("--mode", choices=tuple(MODES), default="persistent-shm",
                   help="persistent-shm: one long-lived writer per rank; temporal-shm: a fresh "
                   "forked writer per save")
    p.add_argument("--ckpt-timeout", type=int, default=60, help="--ckpt-timeout of the saves")
    p.add_argument("--check-timeout-s", type=float, default=60.0,
                   help="bound on each check's waits (a killed writer's error, a marker)")
    p.add_argument("--collective-timeout-s", type=float, default=120.0,
                   help="the process groups' timeout")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="the whole run: past it, every rank dumps its stacks and exits")
    p.add_argument("--preempt-at", type=int, default=7,
                   help="preempt_and_retention: the iteration after whose save SIGTERM is sent")
    p.add_argument("--only", nargs="*", choices=tuple(CHECKS), default=None,
                   help="run only these checks")
    args = p.parse_args(argv)
    if args.mib_per_rank < 1 or args.preempt_at < 1:
        p.error("--mib-per-rank and --preempt-at must be >= 1")
    return args


# -- checks: each returns (passed, details) on every rank after the same collectives ------------
def admission_fits(run: Run) -> tuple[bool, dict]:
    root = run.root("admission_fits")
    with Checkpointer(run.options(), save_dir=root) as ck:
        ck.save(run.sharded(run.state(1)), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        admission = dict(ck.admission or {})
    tracker = read_tracker(root)
    passed = ("fallback" not in admission and admission.get("node") == run.host
              and admission.get("node_ranks") == run.layout.local_world_size
              and admission.get("node_staging_bytes") == run.node_bytes()
              and admission.get("limit_bytes") is None and tracker == 1)
    return passed, {"admission": admission, "expected_node_staging_bytes": run.node_bytes(),
                    "tracker": tracker}


def admission_refused(run: Run) -> tuple[bool, dict]:
    root = run.root("admission_refused")
    limit_mib = max(1, run.node_bytes() // 2**20 // 2)
    t0, outcome = time.perf_counter(), ("none", "the first save was admitted")
    try:
        with Checkpointer(run.options(ckpt_node_memory_limit_mib=limit_mib), save_dir=root) as ck:
            ck.save(run.sharded(run.state(1)), root, iteration=1)
            ck.maybe_finalize(blocking=True)
    except InsufficientHostMemory as e:  # InsufficientSharedMemory is one too
        outcome = (type(e).__name__, str(e))
    seconds = run.ctl.gather(time.perf_counter() - t0)
    everyone = run.ctl.gather(outcome)
    kind, message = everyone[0]
    passed = (limit_mib * 2**20 < run.node_bytes() and kind != "none"
              and max(seconds) <= run.args.check_timeout_s
              and all(o == everyone[0] for o in everyone) and f"node {run.host} " in message
              and f"{LIMIT_FLAG} {limit_mib} caps" in message and read_tracker(root) is None)
    return passed, {"limit_mib": limit_mib, "node_staging_bytes": run.node_bytes(),
                    "error": kind, "message": message, "same_on_every_rank":
                    all(o == everyone[0] for o in everyone), "seconds_per_rank": seconds}


def writer_killed(run: Run) -> tuple[bool, dict]:
    root, victim = run.root("writer_killed"), run.layout.world_size - 1
    marker = Path(run.args.out, "writer_killed.pid")
    harness, bound = Harness(), run.args.check_timeout_s
    outcome: tuple[str, str] = ("none", "")
    with Checkpointer(run.options(), save_dir=root, hooks=harness) as ck:
        ck.save(run.sharded(run.state(1)), root, iteration=1)
        ck.maybe_finalize(blocking=True)
        if run.rank == victim:  # its writer says its pid, then holds inside the write
            hold = lambda fn: partial(hold_in_writer, str(marker), HOLD_S, fn)  # noqa: E731
            harness.wraps.append((lambda record: record.iteration == 2, hold))
        ck.save(run.sharded(run.state(2)), root, iteration=2)
        killed = _kill_writer(marker, bound) if run.rank == victim else None
        run.ctl.barrier()  # the kill is done (or failed) on the victim
        t0 = time.perf_counter()
        try:
            outcome = _finalize_or_raise(ck, bound)
        except CheckpointWriteError as e:
            outcome = ("CheckpointWriteError", str(e))
        seconds = time.perf_counter() - t0
    everyone = run.ctl.gather((outcome[0], round(seconds, 3), killed))
    tracker = read_tracker(root)
    passed = (all(kind == "CheckpointWriteError" and s <= bound for kind, s, _ in everyone)
              and everyone[victim][2] is not None and tracker == 1)
    return passed, {"victim_rank": victim, "killed_writer_pid": everyone[victim][2],
                    "errors": [kind for kind, _, _ in everyone], "bound_s": bound,
                    "seconds_to_raise_per_rank": [s for _, s, _ in everyone],
                    "message": outcome[1][:600], "tracker": tracker}


def _kill_writer(marker: Path, bound: float) -> int | None:
    """SIGKILL the writer that wrote its pid to ``marker`` (within ``bound`` seconds)."""
    deadline = time.monotonic() + bound
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the pid is written whole
    try:
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):  # no marker, or the writer was gone: the check fails
        return None
    return pid


def _finalize_or_raise(ck: Checkpointer, bound: float, poll_s: float = 0.1) -> tuple[str, str]:
    """Poll ``maybe_finalize`` (collective: the same count on every rank) for about ``bound``
    seconds; what happened when it neither raised nor committed."""
    for _ in range(int(bound / poll_s)):
        if ck.maybe_finalize():
            return ("committed", "the save whose writer was killed committed")
        time.sleep(poll_s)
    import psutil

    for child in psutil.Process().children(recursive=True):  # else the close waits on it
        child.kill()
    return ("none", f"no CheckpointWriteError within {bound:.0f} s")


def preempt_and_retention(run: Run) -> tuple[bool, dict]:
    root, last = run.root("preempt_and_retention"), run.args.preempt_at + 50
    mine = (run.host, os.getpid())
    pids = [pid for host, pid in run.ctl.gather(mine) if host == run.host]
    opts = run.options(exit_signal_handler=True, most_recent_k=KEEP_RECENT,
                       save_retain_interval=RETAIN_EVERY)
    live, iteration = run.state(0), 0
    with Checkpointer(opts, save_dir=root) as ck:
        for iteration in range(1, last + 1):
            for k, v in run.state(iteration).items():  # a training step
                live[k].copy_(v)
            ck.maybe_finalize()
            stop = ck.preempted()  # collective: any rank signalled
            ck.save(run.sharded(live), root, iteration=iteration)
            if stop:
                break
            if iteration == run.args.preempt_at and os.environ.get("LOCAL_RANK", "0") == "0":
                _sigterm_job(pids)
    exits = run.ctl.gather(iteration)
    kept = sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit())
    saved = list(range(1, iteration + 1))
    expected = sorted(set(saved[-KEEP_RECENT:]) | {i for i in saved if i % RETAIN_EVERY == 0})
    loaded = _loads_back(run, root, iteration)
    verify = _verify(root, run.args.check_timeout_s) if run.rank == 0 else None
    verify = run.ctl.gather(verify)[0]
    passed = (len(set(exits)) == 1 and run.args.preempt_at < iteration < last
              and read_tracker(root) == iteration and kept == expected
              and all(run.ctl.gather(loaded)) and verify["rc"] == 0)
    return passed, {"exit_iteration_per_rank": exits, "tracker": read_tracker(root),
                    "kept": kept, "expected_kept": expected, "loads_back": loaded,
                    "verify": verify, "signalled_pids": len(pids)}


def _sigterm_job(pids: list[int]) -> None:
    """SIGTERM every rank of this host and every process under it, writers included (as a
    scheduler's job-wide signal); this process last."""
    import psutil

    me = os.getpid()
    targets = []
    for pid in sorted(pids, key=lambda p: p == me):
        proc = psutil.Process(pid)
        targets += [*proc.children(recursive=True), proc]
    for proc in targets:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass


def _loads_back(run: Run, root: Path, iteration: int) -> bool:
    like = {k: torch.zeros_like(v) for k, v in run.state(0).items()}
    with Checkpointer(CkptOptions(**run.timeouts())) as ck:
        got = ck.load(run.sharded(like), root)
    return all(torch.equal(got[k].to(v.device), v) for k, v in run.state(iteration).items())


def _verify(root: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "megatron_ckpt_ext", "verify", str(root)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": None, "output": f"verify took over {timeout:.0f} s"}
    return {"rc": done.returncode, "output": (done.stdout + done.stderr)[-600:]}


CHECKS: dict[str, Callable[[Run], tuple[bool, dict]]] = {
    "admission_fits": admission_fits, "admission_refused": admission_refused,
    "writer_killed": writer_killed, "preempt_and_retention": preempt_and_retention}


# -- driver ---------------------------------------------------------------------------------------
def run_check(run: Run, name: str) -> dict:
    """One check on every rank: its result, or the error of any rank that raised."""
    run.ctl.barrier()
    t0 = time.perf_counter()
    try:
        passed, details = CHECKS[name](run)
        error = None
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        passed, details, error = False, {}, f"{type(e).__name__}: {e}"[:1000]
    seconds = time.perf_counter() - t0
    errors = run.ctl.gather(error)
    if any(errors):
        details["errors_per_rank"] = errors
    return {"passed": passed and not any(errors), "seconds": round(max(run.ctl.gather(seconds)), 3),
            "details": details}


def header(run: Run) -> dict:
    caps = backend.detect()
    return {"schema": SCHEMA, "world_size": run.layout.world_size,
            "ranks_per_device": run.layout.ranks_per_device, "layout": node.layout_json(run.layout),
            "device": node.describe_device(run.device), "host": run.host, "mode": run.args.mode,
            "mib_per_rank": run.args.mib_per_rank,
            "versions": {"torch": torch.__version__, "megatron-core": caps.mcore_version,
                         "nvrx": caps.nvrx_version, "python": platform.python_version(),
                         "cuda": torch.version.cuda},
            "command": node.command_line(run.layout), "checks": {}}


def _write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)  # no run outlives it
    layout = node.init(args.device, args.ranks_per_device, args.collective_timeout_s / 60)
    run = Run(args, layout, node.Ctl(), node.device_of(layout), dist.get_rank(),
              socket.gethostname())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result, path = header(run), out / "node_checks.json"
    for name in args.only or CHECKS:
        if run.rank == 0:  # what a run ended by --timeout-s leaves for this check
            result["checks"][name] = {"passed": False, "seconds": None,
                                      "details": {"status": "did not finish"}}
            _write(path, result)
        result["checks"][name] = run_check(run, name)
        if run.rank == 0:
            print(f"{name}: {'PASS' if result['checks'][name]['passed'] else 'FAIL'} "
                  f"({result['checks'][name]['seconds']} s)", flush=True)
    result["passed"] = all(c["passed"] for c in result["checks"].values())
    if run.rank == 0:
        _write(path, result)
        print(f"{'all checks passed' if result['passed'] else 'FAILED'}: {path}", flush=True)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
