#!/usr/bin/env python3
"""Reliability harness (issue 9): crash trials, writer death, soak, bad input.

    python tools/reliability.py crash --trials 50              # SIGKILL a 2-rank async run
    python tools/reliability.py death                          # kill / hang / fail the writer
    python tools/reliability.py soak --saves 200               # memory, shm, fds, children flat
    python tools/reliability.py badinput                       # every bad flag/config/path
    python tools/reliability.py forks --saves 2000             # writers stuck in their fork
    ... --device cuda [--world 1]                              # the same with CUDA tensors

Each prints a table, writes ``--json`` when given, and exits 1 when a failure count is not 0.
Rank bodies live in ``tools/_reliability_workers.py`` (importable by spawned writers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import _reliability_one_rank as one  # noqa: E402
from tools import _reliability_workers as rw  # noqa: E402
from tests._support.dist import free_port, run_ranks  # noqa: E402

RANDOM = "random"
ORPHAN_GRACE_S = 3.0  # after the ranks are killed, how long their children get to exit


# -- process bookkeeping -------------------------------------------------------------------------
def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """Live processes started under ``MCX_REL_TAG=tag`` (ranks and everything they started:
    forked or spawned children inherit the environment, even once re-parented to init)."""
    needle = f"MCX_REL_TAG={tag}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append((int(entry.name), (entry / "cmdline").read_bytes()
                              .replace(b"\0", b" ").decode(errors="replace")[:120]))
        except OSError:
            continue
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def world_for(device: str, requested: int | None) -> int:
    if requested:
        return requested
    if device == "cuda":
        import torch

        return min(2, torch.cuda.device_count())
    return 2


# -- crash trials --------------------------------------------------------------------------------
def plan_trials(trials: int, modes: list[str]) -> list[tuple[str, str]]:
    """Every deliberate phase in every mode, then random kill times: a cycle of the six phases
    and four random kills, the mode changing every cycle."""
    cycle = list(rw.PHASES) + [RANDOM] * 4
    return [(modes[(i // len(cycle)) % len(modes)], cycle[i % len(cycle)]) for i in range(trials)]


def expected_tracker(phase: str, start: int, kill_iter: int, saves: int) -> set[int]:
    """Trackers a killed job may leave: the commit protocol's promise for each phase."""
    if phase == "before_save":  # the previous save may still be uncommitted (async)
        return {kill_iter - 2, kill_iter - 1}
    if phase in ("staging", "write", "before_rename", "after_rename"):
        return {kill_iter - 1}  # save() committed the previous one first; this one is not
    if phase == "after_tracker":
        return {kill_iter}
    return set(range(start, start + saves + 1))  # random: anything from start on, never older


class CrashCampaign:
    """Runs crash jobs back to back on one checkpoint directory; each job verifies what the
    previous (killed) one left before it saves."""

    def __init__(self, work: Path, *, world: int, device: str, saves: int, seed: int,
                 random_window_s: float, log: Callable[[str], None] = print) -> None:
        self.work, self.world, self.device, self.saves = work, world, device, saves
        self.root = work / "ckpt"
        self.rng = random.Random(seed)
        self.random_window_s = random_window_s
        self.tag = f"mcxrel{os.getpid()}"
        self.log = log
        self.flip_every = 0  # every Nth killed job: flip a byte of its sealed snapshot
        self.lose_node_every = 0  # partner modes: every Nth killed job, node 0's memory lost
        self.nodes = Path("/dev/shm") / f"{self.tag}_nodes"  # partner modes: node<rank> dirs
        self.step_s = 0.0  # a training step between saves (kills then land between saves too)
        self.kill = "all"  # or "one" (one rank, the rest torn down after grace_s) or "mixed"
        self.grace_s = 2.0

    def _flip_sealed_byte(self, partner: bool) -> dict | None:
        """Damage the snapshot the killed job left (one byte of one buffer of one rank's seal,
        or in partner modes of a seal or of a partner's copy): the next job must not restore
        it. Returns what was flipped (None: nothing sealed)."""
        from megatron_ckpt_ext.staging.partner import replica_path
        from megatron_ckpt_ext.staging.retained import read_seal, seal_path

        held = [("own", r, seal_path(self._shm(r, partner), self.root, r))
                for r in range(self.world)]
        if partner:  # rank r's copy is on the next rank's node
            held += [("copy", r, replica_path(self._shm((r + 1) % self.world, True), self.root,
                                              r)) for r in range(self.world)]
        entries = [(kind, r, e) for kind, r, path in held if (s := read_seal(path)) is not None
                   for e in s.entries if e.path and e.nbytes]
        if not entries:
            return None
        kind, owner, entry = self.rng.choice(entries)
        at = self.rng.randrange(entry.nbytes)
        with open(entry.path, "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0x01]))
        return {"kind": kind, "rank": owner, "at": f"{entry.path}@{at}"}

    def _seals_or_copies_left(self) -> list[int | None]:
        """Partner modes: per rank, the newest iteration held of it in memory, its own seal on
        its node or its copy on the next (what a restart can restore it from)."""
        from megatron_ckpt_ext.staging.partner import replica_path
        from megatron_ckpt_ext.staging.retained import read_seal, seal_path

        out = []
        for r in range(self.world):
            held = [read_seal(seal_path(self._shm(r, True), self.root, r)),
                    read_seal(replica_path(self._shm((r + 1) % self.world, True), self.root, r))]
            out.append(max((s.iteration for s in held if s is not None), default=None))
        return out

    def _shm(self, rank: int, partner: bool) -> str:
        return str(self.nodes / f"node{rank}") if partner else "/dev/shm"

    def _lose_node(self) -> int:
        """Node 0 replaced: everything in its shared-memory directory gone (its ranks' seals and
        segments, the copies it held). Returns how many files."""
        node = self.nodes / "node0"
        names = os.listdir(node)
        for name in names:
            os.unlink(node / name)
        return len(names)

    def run(self, plan: list[tuple[str, str]]) -> dict:
        for r in range(self.world):
            (self.nodes / f"node{r}").mkdir(parents=True, exist_ok=True)
        try:
            trials = [self.trial(i, mode, phase) for i, (mode, phase) in enumerate(plan)]
            final = self.trial(len(plan), plan[0][0] if plan else "temporal", "none", saves=0)
            for i, t in enumerate(trials):  # what the next job found is this trial's outcome
                t["after"] = (trials[i + 1] if i + 1 < len(trials) else final)["found"]
                t["tracker_ok"] = self._tracker_ok(t)
            leftover_shm = [str(p) for p in rw.shm_segments(self.tag)]
            leftover_shm += [str(p) for p in sorted(self.nodes.glob("node*/*"))]
        finally:
            shutil.rmtree(self.nodes, ignore_errors=True)
        return summarize(trials, final, leftover_shm)

    def trial(self, i: int, mode: str, phase: str, *, saves: int | None = None) -> dict:
        out = self.work / f"t{i:03d}"
        out.mkdir(parents=True)
        kind, victim = one.choose(self.rng, self.kill if phase != "none" else "all", self.world)
        spec = {"root": str(self.root), "out": str(out), "mode": mode, "phase": phase,
                "nodes": str(self.nodes),
                "job_id": f"{self.tag}t{i}", "campaign": self.tag, "saves": self.saves if saves is None else saves,
                "kill_offset": self.rng.choice([2, 3]), "step_s": self.step_s,
                "hook_rank": 0 if phase in ("before_rename", "after_rename", "after_tracker")
                else i % self.world}
        if victim is not None:
            spec["hook_rank"] = one.hook_rank(phase, victim)
        (out / "spec.json").write_text(json.dumps(spec))
        tag = f"{self.tag}-{i}"
        procs = self._launch(out, tag)
        killer = None if victim is None else one.OneRankKill(
            victim, out, root=self.root, world=self.world, grace_s=self.grace_s)
        result = {"trial": i, "mode": mode, "phase": phase, "kill": kind,
                  **self._drive(procs, out, phase, killer or _kill_ranks)}
        if killer is not None:
            result.update(killer.record, hook_rank=spec["hook_rank"])
        result["orphans"] = self._reap_orphans(tag)
        partner = bool(rw.MODES[mode].get("ckpt_memory_partner"))
        if self.flip_every and i % self.flip_every == self.flip_every - 1:
            result["flipped"] = self._flip_sealed_byte(partner)
        if partner and phase != "none" and self.lose_node_every and \
                i % self.lose_node_every == self.lose_node_every - 1:
            result["lost_node"] = self._lose_node()
        result["seals_left"] = (self._seals_or_copies_left() if partner
                                else one.seals_left(self.root, self.world))
        result["found"] = _found(out, self.world)
        ready = _read_json(out / "ready.json") or {}
        result["start"] = ready.get("start")
        result["kill_iter"] = (ready["start"] + spec["kill_offset"]) if ready else None
        result["saves"] = spec["saves"]
        self.log(_trial_line(result))
        return result

    def _launch(self, out: Path, tag: str) -> list[subprocess.Popen]:
        port = free_port()
        code = ("import tools._reliability_workers as w; "
                f"w.rank_main({str(out / 'spec.json')!r})")
        procs = []
        for rank in range(self.world):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world),
                   "MCX_REL_TAG": tag, "MCX_TEST_DEVICE": self.device,
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            log = open(out / f"rank{rank}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
            procs[-1].log_path = log.name  # how a survivor of a one-rank kill failed
        return procs

    def _drive(self, procs: list[subprocess.Popen], out: Path, phase: str,
               kill: Callable[[list[subprocess.Popen]], bool]) -> dict:
        """Wait for the job to be ready, then ``kill`` it where the phase says (every rank, or
        one and then the rest). Returns what happened."""
        if not _wait(lambda: (out / "ready.json").exists(), procs, 240):
            return {"killed": _kill_ranks(procs), "hit": None, "note": "not ready"}
        if phase in rw.PHASES:
            hit = _wait(lambda: any(out.glob("hit_*")), procs, 180)
            names = sorted(p.name for p in out.glob("hit_*"))
            killed = kill(procs)
            return {"killed": killed, "hit": names[0] if hit and names else None,
                    "kill_after_ready_s": None}
        if phase == RANDOM:
            delay = self.rng.uniform(0.0, self.random_window_s)
            _wait(lambda: False, procs, delay)
            return {"killed": kill(procs), "hit": None, "kill_after_ready_s": round(delay, 3)}
        _wait(lambda: False, procs, 300)
        return {"killed": _kill_ranks(procs), "hit": None,
                "rcs": [p.returncode for p in procs]}

    def _reap_orphans(self, tag: str) -> list[str]:
        time.sleep(ORPHAN_GRACE_S)
        left = tagged_processes(tag)
        kill_pids([pid for pid, _ in left])
        return [f"{pid} {cmd}" for pid, cmd in left]

    def _tracker_ok(self, t: dict) -> bool:
        """The next job's tracker is what the phase promises (a job that never got going
        counts as a mismatch)."""
        if t["start"] is None:
            return False
        tracker = t["after"].get("tracker") or 0  # none yet: 0
        if t["phase"] in rw.PHASES and t["hit"]:
            return tracker in expected_tracker(t["phase"], t["start"], t["kill_iter"], t["saves"])
        return tracker >= t["start"]


def _wait(done: Callable[[], bool], procs: list[subprocess.Popen], timeout: float) -> bool:
    """Poll ``done()`` until true (True) or the timeout / every rank exiting (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        if all(p.poll() is not None for p in procs):
            return done()
        time.sleep(0.01)
    return False


def _kill_ranks(procs: list[subprocess.Popen]) -> bool:
    """SIGKILL every rank still running (the 'crash'); True when at least one was."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.kill()
    for p in procs:
        p.wait()
    return bool(running)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _found(out: Path, world: int) -> dict:
    """What the job found at its start, merged over ranks."""
    per_rank = [_read_json(out / f"verify_r{r}.json") for r in range(world)]
    if any(v is None for v in per_rank):
        return {"verified": False, "tracker": None, "torn": [], "errors": ["job did not verify"]}
    return {"verified": True, "tracker": per_rank[0]["tracker"],
            "checked": per_rank[0]["checked"],
            "torn": sorted({it for v in per_rank for it in v["torn"]}),
            "errors": [e for v in per_rank for e in v["errors"]],
            "incomplete": per_rank[0]["incomplete"],
            "shm_dead_owner_after_start": max(v["shm_dead_owner_after_start"] for v in per_rank),
            "tier": per_rank[0].get("tier"), "tiers": [v.get("tier") for v in per_rank],
            "summed_ahead": [v.get("summed_ahead") for v in per_rank],
            "fetched": [v.get("fetched") for v in per_rank],
            "memory_line": per_rank[0].get("memory_line")}


def _trial_line(t: dict) -> str:
    f = t["found"]
    return (f"trial {t['trial']:3d} {t['mode']:15s} {t['phase']:14s} killed={t['killed']!s:5s} "
            f"hit={t.get('hit')} start={t['start']} kill_iter={t['kill_iter']} | job found "
            f"tracker={f.get('tracker')} tier={f.get('tier')} torn={f.get('torn')} "
            f"orphans={len(t['orphans'])}{' flipped' if t.get('flipped') else ''}"
            f"{' node0-lost' if 'lost_node' in t else ''}"
            f"{' fetched' if any(f.get('fetched') or []) else ''}"
            f"{one.trial_note(t)}")


def _damage_restored(t: dict) -> bool:
    """Whether the next job restored the bytes flipped after this trial's kill: a rank's own
    seal restored where that rank did not fetch (a lost node 0 took its flipped seal with it),
    or a partner's copy that its rank fetched."""
    flipped, after = t.get("flipped"), t["after"]
    if not flipped or after.get("tier") != "memory":
        return False
    fetched = bool((after.get("fetched") or [None] * (flipped["rank"] + 1))[flipped["rank"]])
    if flipped["kind"] == "copy":
        return fetched
    return not fetched and not (flipped["rank"] == 0 and "lost_node" in t)


def summarize(trials: list[dict], final: dict, leftover_shm: list[str]) -> dict:
    outcomes = [t["after"] for t in trials]
    per_phase: dict[str, int] = {}
    for t in trials:
        if t["killed"] and (t["phase"] == RANDOM or t["hit"]):
            per_phase[t["phase"]] = per_phase.get(t["phase"], 0) + 1
    summary = {
        "trials": len(trials),
        "killed": sum(bool(t["killed"]) for t in trials),
        "kills_per_phase": per_phase,
        "successful_loads": sum(o["verified"] and o["tracker"] is not None and not o["torn"]
                                for o in outcomes),
        "fresh_starts_no_checkpoint_yet": sum(o["verified"] and o["tracker"] is None
                                              for o in outcomes),
        "torn_loads": sum(len(o["torn"]) for o in outcomes),
        "unverified": sum(not o["verified"] for o in outcomes),
        "tracker_mismatches": sum(not t["tracker_ok"] for t in trials),
        "committed_checkpoints_checked": sum(len(o.get("checked", [])) for o in outcomes),
        "resumes_from_memory": sum(o.get("tier") == "memory" for o in outcomes),
        "resumes_from_storage": sum(o.get("tier") == "storage" for o in outcomes),
        "sealed_snapshots_damaged": sum(bool(t.get("flipped")) for t in trials),
        "damaged_snapshots_restored": sum(_damage_restored(t) for t in trials),
        "nodes_lost": sum("lost_node" in t for t in trials),
        "resumes_with_a_fetched_snapshot": sum(o.get("tier") == "memory"
                                               and any(o.get("fetched") or []) for o in outcomes),
        "leftover_processes": sum(len(t["orphans"]) for t in trials),
        "shm_dead_owner_segments_after_next_start": sum(o.get("shm_dead_owner_after_start", 0)
                                                        for o in outcomes),
        "leftover_shm_segments_at_end": len(leftover_shm),
        **one.summarize(trials),
    }
    summary["failures"] = (summary["torn_loads"] + summary["unverified"]
                           + summary["damaged_snapshots_restored"]
                           + summary["memory_restores_without_every_seal_or_mixed_tiers"]
                           + summary["tracker_mismatches"] + summary["leftover_processes"]
                           + summary["shm_dead_owner_segments_after_next_start"]
                           + summary["leftover_shm_segments_at_end"])
    return {"summary": summary, "trials": trials, "final": final}


def cmd_crash(args: argparse.Namespace) -> dict:
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="mcx_crash_"))
    modes = args.modes.split(",")
    plan = plan_trials(args.trials, modes)
    campaign = CrashCampaign(work, world=world_for(args.device, args.world), device=args.device,
                             saves=args.saves, seed=args.seed, random_window_s=args.random_window)
    campaign.flip_every, campaign.step_s = args.flip_every, args.step_s
    campaign.lose_node_every = args.lose_node_every
    campaign.kill, campaign.grace_s = args.kill, args.grace
    t0 = time.perf_counter()
    result = campaign.run(plan)
    result["summary"]["wall_s"] = round(time.perf_counter() - t0, 1)
    result["summary"].update(device=args.device, world=campaign.world, modes=modes,
                             kill=args.kill)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


# -- worker death --------------------------------------------------------------------------------
DEATH_CASES = {
    "persistent-shm": ["kill", "kill_idle", "hang", "enospc", "fsize"],
    "temporal": ["kill", "hang", "enospc", "fsize"],
}


def death_case(mode: str, how: str, *, world: int, timeout_s: int = 60) -> dict:
    """One worker-death run: per-rank results and the checks, with failures counted."""
    with tempfile.TemporaryDirectory(prefix="mcx_death_") as tmp:
        t0 = time.perf_counter()
        try:
            run_ranks(rw.worker_death, world_size=world, timeout=180,
                      args=(str(Path(tmp, "ckpt")), mode, how, tmp, timeout_s))
        except Exception as e:  # noqa: BLE001 - a rank that crashed or hung is this case's failure
            return {"mode": mode, "how": how, "world": world,
                    "wall_s": round(time.perf_counter() - t0, 1), "max_seconds_to_error": -1.0,
                    "checks": {"ranks_finished": False}, "failures": 1,
                    "messages": [f"ranks did not finish: {type(e).__name__}: {e}"]}
        wall = time.perf_counter() - t0
        ranks = [json.loads(Path(tmp, f"death_r{r}.json").read_text()) for r in range(world)]
    bound = 3 + 10 if how == "hang" else 10.0  # seconds from save(2) to the error, every rank
    checks = {
        "error_on_every_rank": all(r["error"] for r in ranks),
        "error_within_bound": all(r["seconds_to_error"] <= bound for r in ranks),
        "tracker_still_previous": all(r["tracker_after_failure"] == 1 for r in ranks),
        "failed_save_not_committed": not any(r["iter2_committed"] for r in ranks),
        "previous_checkpoint_intact": all(r["previous_intact"] for r in ranks),
        "retry_commits": all(r["tracker_after_retry"] == 3 and r["retry_intact"] for r in ranks),
        "no_child_after_close": all(not r["children_after_close"] for r in ranks),
    }
    return {"mode": mode, "how": how, "world": world, "wall_s": round(wall, 1),
            "max_seconds_to_error": max(r["seconds_to_error"] for r in ranks),
            "checks": checks, "failures": sum(not ok for ok in checks.values()),
            "messages": [r["error"] for r in ranks]}


def cmd_death(args: argparse.Namespace) -> dict:
    world = world_for(args.device, args.world)
    os.environ["MCX_TEST_DEVICE"] = args.device
    cases = []
    for mode in args.modes.split(","):
        for how in DEATH_CASES[mode]:
            if args.cases and how not in args.cases.split(","):
                continue
            case = death_case(mode, how, world=world)
            print(f"{mode:15s} {how:10s} failures={case['failures']} "
                  f"error after {case['max_seconds_to_error']:.2f} s | {case['messages'][-1]}")
            cases.append(case)
    return {"summary": {"cases": len(cases), "failures": sum(c["failures"] for c in cases),
                        "device": args.device, "world": world}, "cases": cases}


# -- soak ----------------------------------------------------------------------------------------
def soak_run(*, saves: int, mode: str, world: int, warmup: int = 20) -> dict:
    with tempfile.TemporaryDirectory(prefix="mcx_soak_") as tmp:
        t0 = time.perf_counter()
        run_ranks(rw.soak, world_size=world, timeout=60 + 3 * saves,
                  args=(str(Path(tmp, "ckpt")), mode, saves, tmp))
        wall = time.perf_counter() - t0
        ranks = [json.loads(Path(tmp, f"soak_r{r}.json").read_text()) for r in range(world)]
        left_in_root = len(list(Path(tmp, "ckpt").glob("iter_*")))
    return {"mode": mode, "saves": saves, "world": world, "wall_s": round(wall, 1),
            "warmup": warmup, "checkpoints_on_disk_at_end": left_in_root,
            "ranks": [soak_figures(r, warmup) for r in ranks]}


def soak_figures(rank: dict, warmup: int) -> dict:
    """Drift of each figure after warm-up, relative to the first sample past it."""
    samples = [s for s in rank["samples"] if s["save"] >= warmup]
    base = samples[0]
    drift = {k: max(abs(s[k] - base[k]) / base[k] if base[k] else float(s[k] != 0)
                    for s in samples)
             for k in ("rss", "children_rss", "shm_bytes")}
    return {"samples": len(samples), "base": base, "last": samples[-1],
            "max_drift": {k: round(v, 5) for k, v in drift.items()},
            "fds": sorted({s["fds"] for s in samples}),
            "children": sorted({s["children"] for s in samples}),
            "verified": rank["verified"], "mismatched": rank["mismatched"]}


def soak_failures(result: dict, tolerance: float = 0.02) -> int:
    failures = 0
    for r in result["ranks"]:
        failures += sum(v > tolerance for v in r["max_drift"].values())
        failures += (len(r["fds"]) != 1) + (len(r["children"]) != 1) + len(r["mismatched"])
        failures += len(r["verified"]) != result["saves"] // 20
    return failures


def cmd_soak(args: argparse.Namespace) -> dict:
    os.environ["MCX_TEST_DEVICE"] = args.device
    result = soak_run(saves=args.saves, mode=args.mode, world=world_for(args.device, args.world))
    result["failures"] = soak_failures(result)
    for r in result["ranks"]:
        print(f"rss {r['base']['rss']/1e6:.1f}->{r['last']['rss']/1e6:.1f} MB, shm "
              f"{r['base']['shm_bytes']/1e6:.3f}->{r['last']['shm_bytes']/1e6:.3f} MB, drift "
              f"{r['max_drift']}, fds {r['fds']}, children {r['children']}, verified "
              f"{r['verified']}")
    return {"summary": {"failures": result["failures"], "saves": args.saves}, "soak": result}


def cmd_forks(args: argparse.Namespace) -> dict:
    """Many temporal writer forks in one run: every save must commit; the writers found stuck in
    Python's after-fork start (and forked again) are counted, not failures."""
    os.environ["MCX_TEST_DEVICE"] = args.device
    world = world_for(args.device, args.world)
    with tempfile.TemporaryDirectory(prefix="mcx_forks_") as tmp:
        run_ranks(rw.fork_soak, world_size=world, timeout=args.saves * 2 + 600,
                  args=(str(Path(tmp, "ckpt")), tmp, "temporal", args.saves, args.start_timeout))
        ranks = [json.loads(Path(tmp, f"forks_r{r}.json").read_text()) for r in range(world)]
    failures = sum(r["committed"] != args.saves for r in ranks)
    reforks = sum(r["reforks"] for r in ranks)
    print(f"{args.saves} saves x {world} ranks: {reforks} writer forks stuck at start and forked "
          f"again; {failures} rank(s) with a save not committed")
    return {"summary": {"failures": failures, "saves": args.saves, "world": world,
                        "writer_forks": args.saves * world, "reforked": reforks,
                        "forks_waited": sum(r["forks_waited"] for r in ranks),
                        "forks_unquiet": sum(r["forks_unquiet"] for r in ranks),
                        "start_timeout_s": ranks[0]["start_timeout_s"],
                        "save_wall_median_s": max(r["save_wall_s"]["median"] for r in ranks),
                        "save_wall_max_s": max(r["save_wall_s"]["max"] for r in ranks),
                        "saves_over_1s": max(r["save_wall_s"]["over_1s"] for r in ranks),
                        "seconds": max(r["seconds"] for r in ranks),
                        "python": sys.version.split()[0]},
            "ranks": ranks}


# -- bad input -----------------------------------------------------------------------------------
TRAINER = ROOT / "scripts" / "pretrain_gpt.py"
RECIPE = ROOT / "scripts" / "run_recipe.py"
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1"]


class BadCase:
    """One bad input: the trainer (or recipe runner) arguments, with ``{work}``/``{good}``
    placeholders, and a regex the error must match. ``stage="parse"`` cases fail before any
    process group exists, so they can run in-process (fast, CI)."""

    def __init__(self, name: str, argv: list[str], expect: str, *, stage: str = "run",
                 tool: Path = TRAINER, setup: Callable[[Path], None] | None = None) -> None:
        self.name, self.argv, self.expect, self.stage = name, argv, expect, stage
        self.tool, self.setup = tool, setup

    def args(self, work: Path) -> list[str]:
        return [a.format(work=work, good=work / "good") for a in self.argv]


def _write(rel: str, text: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return setup


# Every run-stage case points --save at the good checkpoint with a save every step, so a case
# that did not fail would write over it; the table ends by checking it is byte-identical.
_OVER_GOOD = ["--save", "{good}", "--save-interval", "1", "--train-iters", "4", *TINY]
BAD_CASES = [
    BadCase("--dist-ckpt-workers 0", ["--dist-ckpt-workers", "0", *_OVER_GOOD],
            r"argument --dist-ckpt-workers: must be an integer >= 1, got 0", stage="parse"),
    BadCase("--dist-ckpt-workers two", ["--dist-ckpt-workers", "two", *_OVER_GOOD],
            r"argument --dist-ckpt-workers: must be an integer >= 1, got 'two'", stage="parse"),
    BadCase("--async-ckpt-io-priority 9", ["--async-ckpt-io-priority", "9", *_OVER_GOOD],
            r"--async-ckpt-io-priority: must be an integer in \[0, 7\], got 9", stage="parse"),
    BadCase("--async-ckpt-cpu-priority -21", ["--async-ckpt-cpu-priority=-21", *_OVER_GOOD],
            r"--async-ckpt-cpu-priority: must be an integer in \[-20, 19\], got -21",
            stage="parse"),
    BadCase("--logging-level 99", ["--logging-level", "99", *_OVER_GOOD],
            r"--logging-level: must be an integer in \[0, 50\], got 99", stage="parse"),
    BadCase("--distributed-timeout-minutes 0", ["--distributed-timeout-minutes", "0", *_OVER_GOOD],
            r"--distributed-timeout-minutes: must be an integer >= 1, got 0", stage="parse"),
    BadCase("--ckpt-timeout 0", ["--ckpt-timeout", "0", *_OVER_GOOD],
            r"--ckpt-timeout: must be an integer >= 1, got 0", stage="parse"),
    BadCase("misspelt flag --asynch-save", ["--asynch-save", *_OVER_GOOD],
            r"unrecognized arguments: --asynch-save", stage="parse"),
    BadCase("--tensor-model-parallel-size 2", ["--tensor-model-parallel-size", "2", *_OVER_GOOD],
            r"--tensor-model-parallel-size: this trainer runs data parallel only", stage="parse"),
    BadCase("--save-interval without --save", ["--save-interval", "1", "--train-iters", "2"],
            r"--save-interval needs --save DIR", stage="parse"),
    BadCase("malformed YAML (--ckpt-config)", ["--ckpt-config", "{work}/bad.yaml", *_OVER_GOOD],
            r"malformed YAML in .*bad\.yaml line \d+", stage="parse",
            setup=_write("bad.yaml", "megatron_cfg:\n  async_save: [true\n  load_rng: false\n")),
    BadCase("wrong type in config (async_save: 'yes')",
            ["--ckpt-config", "{work}/type.yaml", *_OVER_GOOD],
            r"--async-save \(config key 'async_save'\) must be true or false, got 'yes'",
            stage="parse", setup=_write("type.yaml", "megatron_cfg:\n  async_save: 'yes'\n")),
    BadCase("config file missing", ["--ckpt-config", "{work}/nope.yaml", *_OVER_GOOD],
            r"config file not found: .*nope\.yaml", stage="parse"),
    BadCase("unknown config key in a recipe (asynch_save)", ["{work}/typo.yaml"],
            r"unknown checkpoint config key 'asynch_save'; did you mean 'async_save'",
            stage="parse", tool=RECIPE, setup=_write(
                "typo.yaml", "name: typo\ntest_type: regular\nnproc: 1\ntrain_iters: 2\n"
                "megatron_cfg: {asynch_save: true}\n")),
    BadCase("unwritable --save (/proc)", ["--save", "/proc/mcx_ckpt", "--save-interval", "1",
                                          "--train-iters", "2", "--async-save", *TINY],
            r"--save /proc/mcx_ckpt: the checkpoint directory is not writable \(\w+Error: "
            r".*(Permission denied|No such file or directory|Read-only).*Fix: point --save"),
    BadCase("--save under a regular file", ["--save", "{work}/afile/ckpt", "--save-interval", "1",
                                            "--train-iters", "2", *TINY],
            r"--save \S*afile/ckpt: \S*afile is a file, not a directory\. Fix: point --save at "
            r"a directory",
            setup=_write("afile", "not a directory\n")),
    # without --exit-on-missing-checkpoint these start from scratch, as Megatron-LM does
    BadCase("missing --load directory (--exit-on-missing-checkpoint)",
            ["--load", "{work}/absent", "--exit-on-missing-checkpoint", *_OVER_GOOD],
            r"--load .*absent: no committed checkpoint to load: .*absent does not exist "
            r"\(--exit-on-missing-checkpoint is set\)"),
    BadCase("--load without a tracker (--exit-on-missing-checkpoint)",
            ["--load", "{work}/empty", "--exit-on-missing-checkpoint", *_OVER_GOOD],
            r"no committed checkpoint to load: .*empty holds no latest_checkpointed_iteration.txt",
            setup=_write("empty/README", "x\n")),
    BadCase("--load whose tracker names a missing checkpoint", ["--load", "{work}/dangling",
                                                                *_OVER_GOOD],
            r"checkpoint .*iter_0000007 does not exist; the tracker .* names it\. Fix:",
            setup=_write("dangling/latest_checkpointed_iteration.txt", "7\n")),
    BadCase("--load at a checkpoint directory, not its save root",
            ["--load", "{good}/iter_0000002", *_OVER_GOOD],
            r"iter_0000002 is a checkpoint directory \(iteration 2\), not a save root.*"
            r"point --load at \S*good"),
    BadCase("--load whose tracker is garbage", ["--load", "{work}/garbage", *_OVER_GOOD],
            r"latest_checkpointed_iteration.txt holds 'seven\\n', not an iteration number",
            setup=_write("garbage/latest_checkpointed_iteration.txt", "seven\n")),
    BadCase("--load a checkpoint of another model shape",
            ["--load", "{good}", *_OVER_GOOD[:-len(TINY)], *TINY[:2], "--hidden-size", "48",
             *TINY[4:]],
            r"does not fit the state this job builds: Global shape mismatch .* Fix: build it "
            r"with that run's model arguments"),
]


def make_good_checkpoint(work: Path) -> str:
    """A committed 2-step checkpoint the bad cases must leave untouched; returns its digest."""
    good = work / "good"
    r = _trainer(TRAINER, ["--save", str(good), "--save-interval", "2", "--train-iters", "2",
                           "--async-save", *TINY], work)
    if r.returncode != 0 or not (good / "latest_checkpointed_iteration.txt").exists():
        raise RuntimeError(f"could not make the good checkpoint: {r.stdout[-2000:]}")
    return tree_digest(good)


def tree_digest(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _trainer(tool: Path, argv: list[str], work: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    return subprocess.run([sys.executable, str(tool), *argv], cwd=work, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def error_line(output: str, expect: str) -> tuple[str, bool]:
    """The line that says what went wrong (the one matching ``expect``, else the last error),
    shortened to 300 characters for the table, and whether a full line matched ``expect``."""
    import re

    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if re.search(expect, ln):
            return ln[:300], True
    errors = [ln for ln in lines if "rror" in ln or "error:" in ln]
    return (errors or lines or [""])[-1][:300], False


def run_case(case: BadCase, work: Path, *, inprocess: bool = False) -> dict:
    if case.setup is not None:
        case.setup(work)
    if inprocess and case.stage == "parse" and case.tool == TRAINER:
        rc, out = _in_process(case.args(work))
    else:
        r = _trainer(case.tool, case.args(work), work)
        rc, out = r.returncode, r.stdout
    message, matched = error_line(out, case.expect)
    # a start-up error is one line naming the fix and exit 2, not a traceback
    clean = rc == 2 and "Traceback" not in out
    return {"case": case.name, "rc": rc, "message": message, "ok": matched and clean}


def _in_process(argv: list[str]) -> tuple[int, str]:
    """pretrain_gpt.main(argv) up to its first error (parse-stage cases never reach the process
    group); returns (exit code, what it printed or raised)."""
    import contextlib
    import io

    sys.path.insert(0, str(TRAINER.parent))
    import pretrain_gpt

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            pretrain_gpt.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            return code, err.getvalue() + ("" if isinstance(e.code, int) else str(e.code))
        except Exception as e:  # noqa: BLE001 - the error is what we record
            return 1, f"{err.getvalue()}{type(e).__name__}: {e}"
    return 0, err.getvalue()


def badinput_table(work: Path, *, inprocess: bool = False,
                   cases: list[BadCase] | None = None) -> list[dict]:
    digest = make_good_checkpoint(work)
    rows = [run_case(case, work, inprocess=inprocess) for case in cases or BAD_CASES]
    same = tree_digest(work / "good") == digest
    rows.append({"case": "good checkpoint byte-identical after every case", "rc": 0,
                 "message": "unchanged" if same else "CHANGED", "ok": same})
    return rows


def cmd_badinput(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mcx_bad_"))
    rows = badinput_table(work)
    shutil.rmtree(work, ignore_errors=True)
    for row in rows:
        print(f"{'ok ' if row['ok'] else 'BAD'} {row['case']:50s} rc={row['rc']} | {row['message']}")
    return {"summary": {"cases": len(rows), "failures": sum(not r["ok"] for r in rows)},
            "rows": rows}


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=int, default=None, help="ranks (default 2; on CUDA min(2, GPUs))")
    p.add_argument("--json", default=None, help="write the full result here")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("crash", help="SIGKILL an async run at every phase and at random")
    c.add_argument("--trials", type=int, default=50)
    c.add_argument("--modes", default="persistent-shm,temporal")
    c.add_argument("--saves", type=int, default=20, help="saves per job (one per step)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--random-window", type=float, default=2.5,
                   help="random kills land uniformly within this many seconds of the job's start")
    c.add_argument("--flip-every", type=int, default=0,
                   help="every Nth trial, flip a byte of the snapshot the killed job sealed in "
                   "/dev/shm (the next job must not restore it)")
    c.add_argument("--lose-node-every", type=int, default=0,
                   help="partner modes: every Nth trial, after the kill, empty node 0's "
                   "shared-memory directory (a replaced node: its seals and the copies it held "
                   "gone); the next job restores from the partner's copy or from storage")
    c.add_argument("--step-s", type=float, default=0.0,
                   help="seconds of 'training' after each save (the crash jobs save every step)")
    c.add_argument("--kill", choices=one.KILLS, default="all",
                   help="all: SIGKILL every rank; one: SIGKILL one random rank (and its writers), "
                   "the rest torn down after --grace as a launcher does (SIGTERM, then SIGKILL); "
                   "mixed: either, at random per trial")
    c.add_argument("--grace", type=float, default=2.0,
                   help="seconds the other ranks get to exit by themselves after a one-rank kill")
    c.add_argument("--out", default=None)
    c.add_argument("--keep", action="store_true")
    d = sub.add_parser("death", help="kill, hang or fail the async writer mid-save")
    d.add_argument("--modes", default="persistent-shm,temporal")
    d.add_argument("--cases", default=None, help="comma list of kill,kill_idle,hang,enospc,fsize")
    s = sub.add_parser("soak", help="many saves: memory, shm, fds, children flat")
    s.add_argument("--saves", type=int, default=200)
    s.add_argument("--mode", default="persistent-shm", choices=sorted(rw.MODES))
    sub.add_parser("badinput", help="bad flags, values, configs and paths: the messages")
    f = sub.add_parser("forks", help="many temporal writer forks: the ones stuck at start")
    f.add_argument("--saves", type=int, default=2000)
    f.add_argument("--start-timeout", type=float, default=None,
                   help="seconds before a silent writer counts as stuck (default: the product's)")
    args = p.parse_args(argv)
    if args.cmd == "soak" and args.saves < 40:
        p.error("soak --saves: at least 40 (20 warm-up saves, then samples every 10)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = {"crash": cmd_crash, "death": cmd_death, "soak": cmd_soak, "badinput": cmd_badinput,
           "forks": cmd_forks}
    result = run[args.cmd](args)
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if result["summary"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
