"""One-rank kills for the crash trials of ``tools/reliability.py`` (``crash --kill one|mixed``).

A cluster loses one process far more often than all of them: one rank's trainer dies (SIGKILL,
with its writer children) while the other ranks live; they block in a collective or fail on it;
the launcher then tears the job down (torchrun: SIGTERM to every worker left, SIGKILL after a
wait) and the job is restarted. What the survivors leave may differ from what the killed rank
left: a survivor's snapshot may be sealed for an iteration while the killed rank's is not, and
the all-or-nothing agreement of the memory tier must then read storage on every rank.

This module chooses the victim, kills it and tears the rest down (recording how each survivor
ended), reads which iteration each rank left sealed in /dev/shm, and counts, over the trials,
how the next job's restore agreed with those seals.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

KILLS = ("all", "one", "mixed")
TERM_WAIT_S = 5.0  # after the launcher's SIGTERM, how long a survivor gets before SIGKILL
# Phases whose hold point any rank reaches (the rename and the tracker are rank 0's alone).
ANY_RANK_PHASES = ("before_save", "staging", "write", "before_rename")


def choose(rng: random.Random, kill: str, world: int) -> tuple[str, int | None]:
    """(how this trial kills: "all" or "one", the victim rank for "one"). ``kill="all"`` draws
    nothing from ``rng`` (the every-rank trials keep their sequence)."""
    if kill == "all":
        return "all", None
    kind = kill if kill == "one" else rng.choice(("all", "one"))
    return kind, (rng.randrange(world) if kind == "one" else None)


def hook_rank(phase: str, victim: int) -> int:
    """Where a one-rank trial holds its phase: on the victim where any rank reaches that point
    (it is killed there), else on rank 0 (the victim is then killed while rank 0 is held)."""
    return victim if phase in ANY_RANK_PHASES else 0


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class OneRankKill:
    """Kills ``victim`` (its trainer and every process it started), gives the survivors
    ``grace_s`` to exit by themselves, then tears them down as torchrun does (SIGTERM, then
    SIGKILL after :data:`TERM_WAIT_S`). ``record`` says what happened."""

    def __init__(self, victim: int, out: Path, *, root: Path, world: int,
                 grace_s: float) -> None:
        self.victim, self.out, self.grace_s = victim, out, grace_s
        self.root, self.world = root, world
        self.record: dict[str, Any] = {"victim": victim}

    def __call__(self, procs: list[subprocess.Popen]) -> bool:
        target = procs[self.victim]
        if target.poll() is not None:  # the job ended before the kill landed
            self.record["victim_alive"] = False
            return _teardown(procs, self.record, 0.0, time.monotonic())
        children = descendants(target.pid)
        self.record["victim_at"] = _progress(self.out, self.victim)
        self.record["seals_at_kill"] = seals_left(self.root, self.world)
        target.kill()
        for pid in children:  # its writers (they also die with it: PR_SET_PDEATHSIG)
            _signal(pid, signal.SIGKILL)
        target.wait()
        self.record.update(victim_alive=True, victim_children_killed=len(children))
        _teardown(procs, self.record, self.grace_s, time.monotonic())
        return True


def _teardown(procs: list[subprocess.Popen], record: dict, grace_s: float,
              killed_at: float) -> bool:
    """Survivors: wait ``grace_s`` for them to exit by themselves, then SIGTERM, then SIGKILL.
    Records per survivor how it ended; True when any had to be signalled."""
    survivors = [(r, p) for r, p in enumerate(procs) if r != record["victim"]]
    ended: dict[int, tuple[str, float | None]] = {}
    deadline = killed_at + grace_s
    while True:
        for r, p in survivors:  # each exit timed as it is seen
            if r not in ended and p.poll() is not None:
                ended[r] = ("exited", round(time.monotonic() - killed_at, 2))
        if len(ended) == len(survivors) or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    failed = {r: _last_error(p) for r, p in survivors}  # what each had said by the teardown
    for sig, wait in ((signal.SIGTERM, TERM_WAIT_S), (signal.SIGKILL, 30.0)):
        alive = [(r, p) for r, p in survivors if p.poll() is None]
        for _, p in alive:
            p.send_signal(sig)
        for r, p in alive:
            try:
                p.wait(timeout=wait)
                ended[r] = (signal.Signals(sig).name, round(time.monotonic() - killed_at, 2))
            except subprocess.TimeoutExpired:
                pass
    record["survivors"] = [{"rank": r, "ended_by": ended.get(r, ("alive", None))[0],
                            "after_s": ended.get(r, (None, None))[1], "rc": p.returncode,
                            "error_by_teardown": failed[r], "error": _last_error(p)}
                           for r, p in survivors]
    return any(s["ended_by"] != "exited" for s in record["survivors"])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _progress(out: Path, rank: int) -> dict | None:
    """Where the rank last said it was (tools/_reliability_workers.py writes it)."""
    try:
        return json.loads((out / f"progress_r{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _last_error(proc: subprocess.Popen) -> str | None:
    """The last line of the rank's log that names an error (how a survivor failed)."""
    log = getattr(proc, "log_path", None)
    if log is None:
        return None
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return None
    errors = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
    return errors[-1][:300] if errors else None


def seals_left(root: Path, world: int, shm_dir: str = "/dev/shm") -> list[int | None]:
    """The iteration each rank left sealed for ``root`` (None: no seal)."""
    from megatron_ckpt_ext.staging.retained import read_seal, seal_path

    seals = [read_seal(seal_path(shm_dir, root, r)) for r in range(world)]
    return [s.iteration if s is not None else None for s in seals]


def agreement(t: dict) -> dict:
    """How the next job's restore of trial ``t`` stood to the seals the killed job left:
    ``sealed`` every / some / none of the ranks held the tracker's iteration sealed; ``wrong``
    when memory was used though a rank held no seal of it, or the ranks' tiers differ."""
    after, seals = t["after"], t.get("seals_left")
    tracker, tiers = after.get("tracker"), after.get("tiers") or [after.get("tier")]
    if seals is None or tracker is None:
        return {"sealed": None, "wrong": False}
    held = sum(s == tracker for s in seals)
    sealed = "every" if held == len(seals) else "some" if held else "none"
    wrong = len(set(tiers)) > 1 or (tiers[0] == "memory" and sealed != "every")
    return {"sealed": sealed, "stale_seals": sum(s is not None and s < tracker for s in seals),
            "wrong": wrong}


def summarize(trials: list[dict]) -> dict:
    """The one-rank counts over ``trials`` (each with ``after`` set): victims, how survivors
    ended, and the seal cases of the restore."""
    one = [t for t in trials if t.get("kill") == "one" and t.get("victim_alive")]
    ends: dict[str, int] = {}
    for t in one:
        for s in t["survivors"]:
            ends[s["ended_by"]] = ends.get(s["ended_by"], 0) + 1
    cases = [(t, agreement(t)) for t in trials]
    some = [t for t, a in cases if a["sealed"] == "some"]
    return {
        "one_rank_kills": len(one),
        "one_rank_kills_per_victim": _count(str(t["victim"]) for t in one),
        "one_rank_victim_held_at_phase": sum(t["phase"] in ANY_RANK_PHASES for t in one
                                             if t.get("hit")),
        "one_rank_victim_was_at": _count((t.get("victim_at") or {}).get("at", "?")
                                         for t in one),
        "one_rank_restores_by_tier": _count(str(t["after"].get("tier")) for t in one),
        "survivors_ended_by": ends,
        "survivors_failed_by_teardown": sum(bool(s.get("error_by_teardown"))
                                            for t in one for s in t["survivors"]),
        "restores_with_every_rank_sealed": sum(a["sealed"] == "every" for _, a in cases),
        "restores_with_some_ranks_sealed": len(some),
        "some_sealed_read_storage": sum(t["after"].get("tier") == "storage" for t in some),
        "some_sealed_in_one_rank_kills": sum(t.get("kill") == "one" for t in some),
        "survivor_seals_dropped_on_the_way_out": sum(_dropped(t) for t in one),
        "every_sealed_undamaged_read_storage": sum(
            a["sealed"] == "every" and not t.get("flipped") and t["after"].get("tier") != "memory"
            for t, a in cases),
        "restores_with_no_rank_sealed": sum(a["sealed"] == "none" for _, a in cases),
        "ranks_with_stale_seals": sum(a.get("stale_seals", 0) for _, a in cases),
        "memory_restores_without_every_seal_or_mixed_tiers": sum(a["wrong"] for _, a in cases),
    }


def trial_note(t: dict) -> str:
    """The one-rank part of a trial's line: the victim, where it was, how the others ended,
    the seals left per rank."""
    note = f" seals={t.get('seals_left')}"
    if t.get("kill") != "one":
        return note
    at = t.get("victim_at") or {}
    ends = ",".join(f"r{s['rank']}:{s['ended_by']}" for s in t.get("survivors", []))
    return f"{note} victim=r{t['victim']}@{at.get('at')}:{at.get('it')} survivors={ends}"


def _dropped(t: dict) -> int:
    """Survivors that held a seal when the victim was killed and none after the teardown (a
    survivor's own exit path removed it)."""
    at, left = t.get("seals_at_kill") or [], t.get("seals_left") or []
    return sum(1 for s in t["survivors"] if s["rank"] < len(at) and at[s["rank"]] is not None
               and left[s["rank"]] is None)


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))
