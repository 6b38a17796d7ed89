#!/usr/bin/env python3
"""Run a functional recipe from configs/ (Megatron-LM functional-test style).

    python scripts/run_recipe.py configs/gpt_tiny_async_cpu_shm_constant.yaml [--keep] [--gpu]

``regular``: train N steps; the loss must be finite and decrease.
``ckpt-resume``: train 2N steps saving at N (and 2N); a fresh run loads the step-N checkpoint
through the tracker and trains to 2N; losses N+1..2N and the final parameters must be
bit-identical. Prints a pass/fail table and the per-save report; exits 1 on failure.

A run that fails prints the failed rank's own error (its traceback, not torchrun's summary) and
keeps the run directory, with the log it names; a passing run's directory is removed unless
``--keep`` or ``--run-dir`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ckpt_ext.errors import CkptOptionsError  # noqa: E402
from megatron_ckpt_ext.options import CkptOptions, load_yaml  # noqa: E402

RECIPE_KEYS = {"name", "description", "test_type", "nproc", "train_iters", "model", "ckpt_flags",
               "megatron_cfg", "compare", "timeout_s", "gpu"}
TEST_TYPES = ("regular", "ckpt-resume")


def load_recipe(path: str, *, gpu: bool = False) -> dict:
    """Parse and check a recipe: every problem is a clear error before anything starts."""
    if not Path(path).is_file():
        raise CkptOptionsError(f"recipe not found: {path}")
    recipe = load_yaml(path)
    if not isinstance(recipe, dict):
        raise CkptOptionsError(f"{path}: a recipe is a mapping of {sorted(RECIPE_KEYS)}")
    unknown = sorted(set(recipe) - RECIPE_KEYS)
    if unknown:
        raise CkptOptionsError(f"{path}: unknown recipe key(s) {unknown}; valid: {sorted(RECIPE_KEYS)}")
    if recipe.get("test_type") not in TEST_TYPES:
        raise CkptOptionsError(f"{path}: test_type must be one of {TEST_TYPES}, got {recipe.get('test_type')!r}")
    if gpu:
        recipe = {**recipe, **(recipe.get("gpu") or {}),
                  "model": {**recipe.get("model", {}), **(recipe.get("gpu") or {}).get("model", {})}}
    nproc = int(recipe.get("nproc", 2))
    available = _gpus() if gpu else (os.cpu_count() or 1)
    if nproc < 1 or nproc > available:
        raise CkptOptionsError(f"{path}: nproc {nproc} cannot run here ({available} "
                               f"{'GPUs' if gpu else 'CPU cores'} available)")
    if recipe.get("megatron_cfg") is not None:
        CkptOptions.from_config(recipe["megatron_cfg"])  # unknown knob / wrong type: error now
    return recipe


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(recipe: dict, run_dir: Path, name: str, iters: int, *, save: Path, save_interval: int,
          load: Path | None = None) -> dict:
    """One torchrun of scripts/pretrain_gpt.py; returns its metrics JSON."""
    metrics = run_dir / f"{name}.json"
    # --tee 3: every rank's lines reach the log prefixed "[default<rank>]:", so a failed rank's
    # own traceback can be told apart from torchrun's summary (--log-dir keeps torchrun's copies
    # in the run directory instead of a temporary one).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(recipe.get("nproc", 2)),
           "--master-port", str(_port()), "--tee", "3", "--log-dir", str(run_dir / f"{name}_ranks"),
           str(ROOT / "scripts" / "pretrain_gpt.py"),
           "--train-iters", str(iters), "--save", str(save), "--save-interval", str(save_interval),
           "--metrics-file", str(metrics)]
    for key, value in (recipe.get("model") or {}).items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else ([] if value is False else [flag, str(value)])
    cmd += list(recipe.get("ckpt_flags") or [])
    if recipe.get("megatron_cfg") is not None:
        cfg = run_dir / "megatron_cfg.yaml"
        cfg.write_text(json.dumps({"megatron_cfg": recipe["megatron_cfg"]}))
        cmd += ["--ckpt-config", str(cfg)]
    if load is not None:
        cmd += ["--load", str(load)]
    log = run_dir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    timeout = int(recipe.get("timeout_s", 600))
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"run {name!r} timed out after {timeout} s (recipe key timeout_s); "
                           f"{rank_error(log.read_text())}\nfull log: {log}") from None
    if proc.returncode != 0 or not metrics.exists():
        raise RuntimeError(f"run {name!r} failed (exit {proc.returncode}); "
                           f"{rank_error(log.read_text())}\nfull log: {log}")
    return json.loads(metrics.read_text())


_RANK_LINE = re.compile(r"^\[default(\d+)\]:(?:\[rank\d+\]: )?(.*)$")  # torch's excepthook adds [rankN]
_ROOT_CAUSE = re.compile(r"Root Cause.*?local_rank: (\d+)", re.S)


def rank_error(text: str, *, max_lines: int = 30) -> str:
    """The real error in a torchrun log written with ``--tee 3``: the last traceback of the rank
    torchrun names as the root cause (else of any rank), headed by its exception line; a rank
    that died without a traceback shows its last lines; else the log's last lines."""
    ranks: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _RANK_LINE.match(line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    root = _ROOT_CAUSE.search(text)
    order = ([int(root.group(1))] if root else []) + sorted(ranks)
    for rank in order:
        lines = ranks.get(rank, [])
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
        if starts:
            block = lines[starts[-1]:]
            error = next((line for line in block[1:] if line and not line.startswith(" ")), block[-1])
            return f"rank {rank}: {error}\n" + "\n".join(block[-max_lines:])
    if root and ranks.get(int(root.group(1))):
        rank = int(root.group(1))
        return f"rank {rank} exited; its last lines:\n" + "\n".join(ranks[rank][-10:])
    return "last lines of the log:\n" + "\n".join(text.splitlines()[-25:])


def losses(metrics: dict) -> list[float]:
    return [float.fromhex(v) for _, v in sorted(metrics["losses"].items(), key=lambda kv: int(kv[0]))]


def run_regular(recipe: dict, run_dir: Path) -> list[tuple[str, bool, str]]:
    n = int(recipe["train_iters"])
    m = train(recipe, run_dir, "regular", n, save=run_dir / "ckpt", save_interval=n)
    ls = losses(m)
    first, last = sum(ls[:3]) / 3, sum(ls[-3:]) / 3
    _write_reports(run_dir, {"regular": m})
    return [("loss finite", all(math.isfinite(x) for x in ls), f"{len(ls)} steps"),
            ("loss decreasing", last < first, f"mean first 3 {first:.4f} -> last 3 {last:.4f}")]


def run_ckpt_resume(recipe: dict, run_dir: Path) -> list[tuple[str, bool, str]]:
    n = int(recipe["train_iters"])
    full = train(recipe, run_dir, "full", 2 * n, save=run_dir / "full", save_interval=n)
    resume_dir = run_dir / "resume"
    resume_dir.mkdir()
    shutil.copytree(run_dir / "full" / f"iter_{n:07d}", resume_dir / f"iter_{n:07d}")
    (resume_dir / "latest_checkpointed_iteration.txt").write_text(f"{n}\n")
    resumed = train(recipe, run_dir, "resumed", 2 * n, save=resume_dir, save_interval=n, load=resume_dir)
    tail = {k: v for k, v in full["losses"].items() if int(k) > n}
    differ = [k for k in tail if resumed["losses"].get(k) != tail[k]]
    _write_reports(run_dir, {"full": full, "resumed": resumed})
    return [("resumed losses bit-identical", not differ and len(resumed["losses"]) == n,
             f"steps {n + 1}..{2 * n}" + (f", differ at {differ[:5]}" if differ else "")),
            ("final parameters bit-identical", full["param_digest"] == resumed["param_digest"],
             full["param_digest"][:12]),
            ("loss finite", all(math.isfinite(x) for x in losses(full)), f"{2 * n} steps")]


def _write_reports(run_dir: Path, runs: dict) -> None:
    rows = [{"run": name, **r} for name, m in runs.items() for r in m.get("reports", [])]
    (run_dir / "save_report.json").write_text(json.dumps(rows, indent=1))


def print_table(recipe: dict, checks: list, run_dir: Path) -> None:
    print(f"\nrecipe {recipe.get('name')} ({recipe['test_type']}, {recipe.get('nproc', 2)} ranks)")
    for what, ok, detail in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {what:34s} {detail}")
    rows = json.loads((run_dir / "save_report.json").read_text())
    if rows:
        print("\nper-save report (rank 0)")
        print(f"  {'run':8s} {'iter':>5s} {'mode':28s} {'MB':>8s} {'blocking s':>11s} {'durable s':>10s}")
        for r in rows:
            print(f"  {r['run']:8s} {r['iteration']:5d} {r['mode']:28s} {r['bytes'] / 1e6:8.2f} "
                  f"{r['blocking_s']:11.3f} {r['durable_s']:10.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--gpu", action="store_true", help="NCCL, one rank per GPU, the recipe's gpu: overrides")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, gpu=args.gpu)
    except CkptOptionsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"recipe_{recipe.get('name', 'x')}_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        runner = run_regular if recipe["test_type"] == "regular" else run_ckpt_resume
        checks = runner(recipe, run_dir)
        print_table(recipe, checks, run_dir)
        ok = all(c[1] for c in checks)
        kept = not ok or args.keep or args.run_dir  # the finally below removes it otherwise
        where = f"run dir {run_dir}" if kept else "its run dir is removed; --keep keeps it"
        print(f"\n{'PASSED' if ok else 'FAILED'}: {recipe.get('name')}  ({where})")
        return 0 if ok else 1
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"FAILED: {e}\n(run dir {run_dir} kept)", file=sys.stderr)
        return 1
    finally:
        if ok and not args.keep and not args.run_dir:  # a failed run keeps its logs
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
