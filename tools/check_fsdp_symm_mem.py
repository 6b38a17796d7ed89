#!/usr/bin/env python3
"""Two-GPU check of ``--fsdp-use-symm-mem``: NCCL symmetric kernels, loss parity, checkpoint.

Run on two GPUs of one host (new stack: torch 2.11 CUDA, megatron-core 0.19.2)::

    torchrun --nproc-per-node 2 tools/check_fsdp_symm_mem.py --out OUT_DIR

Phases, each bounded by ``--phase-timeout`` seconds (a hang dumps every thread's stack and exits):

1. ``train_off`` / ``train_on``: the same model (bf16 ``Linear`` units of a few MiB each, sharded
   one by one with megatron-core's experimental ``fully_shard`` through ``wrap_fsdp``; a LayerNorm
   left to the root unit), the same seed and data, ``--steps`` AdamW steps with the flag off, then
   on. The last ``--profile-steps`` steps run under ``torch.profiler``; CUDA kernels whose names
   hold ``ncclSymk`` and ``AllGather`` / ``ReduceScatter`` are counted: > 0 with the flag, 0
   without. Loss parity: every rank's loss at every step, flag on against off.
2. ``checkpoint``: the flag-on model and optimizer go through the Checkpointer (async save of
   :func:`fsdp_sharded_state_dict`; the next training step runs while the write does); then every
   saved tensor is overwritten, loaded back, compared bit for bit with the state at ``save()``,
   and the next step is re-run: its loss must equal the one computed before.

NVLink SHARP stays off: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set
here before torch starts (and checked), so the symmetric kernels seen are NCCL's non-multicast
ones. ``--checkpoint-only`` runs phase 2 without training (no forward pass), over gloo when there
is no GPU: the CPU test of the checkpoint path. Results: ``OUT_DIR/fsdp_symm_mem.json`` and a table
on stdout; exit status 0 when every check passes.
"""

from __future__ import annotations

import os

# Before torch (and NCCL) read them: the GPU machines run with NVLink SHARP/multicast off.
REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _name, _value in REQUIRED_ENV.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

RESULT_FILE = "fsdp_symm_mem.json"
SENTINEL = 7.0  # what the live state is overwritten with before a load
# Flag on against off is expected to be bit-exact on 2 ranks: all-gathers copy, and a two-way
# bf16 reduction rounds once whether NCCL averages (flag off) or sums before a halving (flag on,
# an exact scaling). Elsewhere these are the bounds torch.testing.assert_close uses for bf16,
# as Megatron-LM's own parity test does.
BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5


class SetupError(RuntimeError):
    """The run cannot start here; the message says what is missing and how to run it."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for fsdp_symm_mem.json")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="last steps of each run traced by torch.profiler (default 2)")
    p.add_argument("--hidden", type=int, default=2048,
                   help="Linear width: hidden^2 bf16 weights per unit, 8 MiB at 2048 (default)")
    p.add_argument("--layers", type=int, default=4, help="sharded Linear units (default 4)")
    p.add_argument("--batch", type=int, default=8, help="rows per micro-batch (default 8)")
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per step")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--phase-timeout", type=float, default=180.0,
                   help="seconds each phase may take before the run is aborted (default 180)")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="checkpoint root (default: a temporary folder, removed at the end)")
    p.add_argument("--sync-save", action="store_true", help="save synchronously (default async)")
    p.add_argument("--checkpoint-only", action="store_true",
                   help="only the checkpoint round trip (no training); runs on CPU over gloo")
    args = p.parse_args(argv)
    if args.steps < 2 or not 1 <= args.profile_steps < args.steps:
        p.error("need --steps >= 2 and 1 <= --profile-steps < --steps")
    return args


# -- set-up --------------------------------------------------------------------------------------
def check_env() -> dict[str, str]:
    wrong = {k: os.environ.get(k) for k, v in REQUIRED_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise SetupError(f"this check runs with {REQUIRED_ENV} (NVLink SHARP and multicast off, as "
                         f"on the GPU machines); the environment has {wrong}: unset them")
    return {k: os.environ[k] for k in REQUIRED_ENV}


def launch_facts() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SetupError("launch with torchrun: torchrun --nproc-per-node 2 "
                         "tools/check_fsdp_symm_mem.py --out DIR")
    world = int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise SetupError(f"needs 2 ranks (one GPU each), WORLD_SIZE is {world}: "
                         "torchrun --nproc-per-node 2 ...")
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0"))


def pick_device(args: argparse.Namespace, local_rank: int) -> Any:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 and args.checkpoint_only:
        return torch.device("cpu")
    if count == 0:
        raise SetupError("needs 2 CUDA GPUs and this machine has none (--fsdp-use-symm-mem is "
                         "GPU-only); --checkpoint-only runs the checkpoint round trip on CPU")
    if local_rank >= count:
        raise SetupError(f"needs one GPU per rank: local rank {local_rank}, {count} GPU(s) visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: Any, timeout_s: float) -> Any:
    """The default process group (NCCL on GPUs, gloo on CPU) and a 1-D device mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: symmetric memory needs the communicator
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kwargs)
    return init_device_mesh(device.type, (dist.get_world_size(),))


@contextlib.contextmanager
def phase(name: str, seconds: float, timings: dict[str, float]) -> Iterator[None]:
    """Bound a phase: past ``seconds`` every thread's stack is dumped and the process exits."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    started = time.perf_counter()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        timings[name] = round(time.perf_counter() - started, 3)


# -- model and data ------------------------------------------------------------------------------
def build_model(args: argparse.Namespace, device: Any) -> Any:
    """``layers`` x (Linear + GELU), then a LayerNorm: the Linears are the FSDP units; the
    LayerNorm stays with the root unit (its tiny vectors split unevenly across ranks)."""
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(args.hidden, args.hidden)
                                        for _ in range(args.layers))
            self.norm = nn.LayerNorm(args.hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = nn.functional.gelu(layer(x))
            return self.norm(x)

    torch.manual_seed(args.seed)
    return Stack().to(dtype=torch.bfloat16).to(device)


def batch(args: argparse.Namespace, rank: int, step: int, device: Any) -> tuple[Any, Any]:
    """This rank's inputs and targets for ``step`` (the same in every run)."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)
    shape = (args.microbatches, args.batch, args.hidden)
    x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return x.to(device, torch.bfloat16), y.to(device, torch.bfloat16)


@dataclass
class Trainer:
    args: argparse.Namespace
    rank: int
    device: Any
    model: Any
    optimizer: Any
    losses: list[list[float]] = field(default_factory=list)  # per step, per micro-batch

    def step(self, step: int) -> list[float]:
        import torch

        x, y = batch(self.args, self.rank, step, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for mb in range(self.args.microbatches):
            loss = torch.nn.functional.mse_loss(self.model(x[mb]).float(), y[mb].float())
            (loss / self.args.microbatches).backward()
            losses.append(loss.detach())
        self.optimizer.step()
        return [v.item() for v in losses]


def make_trainer(args: argparse.Namespace, rank: int, device: Any, mesh: Any,
                 use_symm_mem: bool) -> Trainer:
    import torch

    from megatron_ckpt_ext import CkptOptions
    from megatron_ckpt_ext.fsdp import wrap_fsdp

    model = build_model(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    wrap_fsdp(model, CkptOptions(fsdp_use_symm_mem=use_symm_mem), mesh=mesh,
              units=list(model.layers), optimizer=optimizer)
    return Trainer(args, rank, device, model, optimizer)


# -- phase 1: training with the flag off and on --------------------------------------------------
def train(trainer: Trainer) -> dict[str, Any]:
    """Run the steps; trace the last ones; return the NCCL kernel counts of the traced steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    args = trainer.args
    traced_from = args.steps - args.profile_steps
    for step in range(traced_from):
        trainer.losses.append(trainer.step(step))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for step in range(traced_from, args.steps):
            trainer.losses.append(trainer.step(step))
        torch.cuda.synchronize()
    return kernel_counts([event.name for event in prof.events()])


def kernel_counts(names: list[str]) -> dict[str, Any]:
    nccl = [n for n in names if "nccl" in n.lower()]
    symk = [n for n in nccl if "ncclSymk" in n]
    by_name: dict[str, int] = {}
    for n in nccl:
        by_name[n] = by_name.get(n, 0) + 1
    return {
        "symk_allgather": sum("AllGather" in n for n in symk),
        "symk_reducescatter": sum("ReduceScatter" in n for n in symk),
        "symk_total": len(symk),
        "nccl_total": len(nccl),
        "nccl_kernels": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:12]),
    }


def expected_collectives(args: argparse.Namespace, trainer: Trainer) -> dict[str, int]:
    """Per traced steps: every FSDP unit all-gathers in forward and again in backward, and
    reduce-scatters its gradients once per micro-batch (one kernel each per parameter group)."""
    from megatron_ckpt_ext import backend

    api = backend.megatron_fsdp_api()
    groups = sum(len(m.parameter_groups) for m in trainer.model.modules()
                 if isinstance(m, api.fsdp_module))
    per_step = groups * args.microbatches
    return {"allgather": 2 * per_step * args.profile_steps,
            "reducescatter": per_step * args.profile_steps}


def loss_parity(off: list[list[float]], on: list[list[float]]) -> dict[str, Any]:
    """This rank's flag-on losses against flag-off ones: bit-exact, or within bf16 tolerance."""
    import torch

    a = torch.tensor(off, dtype=torch.float64)
    b = torch.tensor(on, dtype=torch.float64)
    diff = (a - b).abs()
    within = bool(torch.all(diff <= BF16_ATOL + BF16_RTOL * a.abs()))
    return {"bit_exact": bool(torch.equal(a, b)), "max_abs_diff": float(diff.max()),
            "within_bf16_tolerance": within, "rtol": BF16_RTOL, "atol": BF16_ATOL}


# -- phase 2: checkpoint round trip --------------------------------------------------------------
def flat_state(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, tensor or value) for every leaf of a sharded state dict (ShardedTensor -> data)."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from flat_state(v, f"{prefix}{k}/")
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from flat_state(v, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/"), getattr(state, "data", state) if _is_sharded(state) else state


def _is_sharded(value: Any) -> bool:
    return type(value).__name__ == "ShardedTensor"


def snapshot(state: Any) -> dict[str, Any]:
    import torch

    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in flat_state(state)}


def scramble(state: Any, optimizer: Any) -> None:
    """Overwrite every saved tensor (and the learning rate) in place: a load must restore all."""
    import torch

    with torch.no_grad():
        for _, value in flat_state(state):
            if isinstance(value, torch.Tensor):
                value.fill_(SENTINEL)
    for group in optimizer.param_groups:
        group["lr"] = SENTINEL


def compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    import torch

    differ = [k for k in want if not _same(got.get(k), want[k])]
    tensors = [v for v in want.values() if isinstance(v, torch.Tensor)]
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "entries": len(want), "differ": differ[:10], "n_differ": len(differ),
            "missing": sorted(set(want) - set(got))[:10]}


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a.detach().cpu(), b.detach().cpu()))
    return a == b


def gathered_parameters(model: Any) -> dict[str, Any]:
    """Every parameter whole, as Megatron-FSDP all-gathers it for compute (bf16 copies)."""
    import torch

    from megatron_ckpt_ext import backend

    api = backend.megatron_fsdp_api()
    full: dict[str, Any] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, api.fsdp_module):
                continue
            for group in module.parameter_groups:
                group.unshard_parameters()
                for pname, param in zip(group.parameter_names, group.unsharded_parameters):
                    full[f"{name}.{pname}" if name else pname] = param.detach().clone()
                group.reshard_parameters()
                group.release_unsharded_storage()
    return full


def whole_tensor_check(ck: Any, trainer: Trainer, root: Path) -> dict[str, Any]:
    """Load every parameter whole on every rank (a layout other than the saved one) and compare
    it, cast to the compute dtype, with the all-gathered parameter: this checks the global
    offsets the shards were saved at, which a same-layout round trip cannot see."""
    import torch

    from megatron_ckpt_ext import backend

    full = gathered_parameters(trainer.model)
    rank = torch.distributed.get_rank()
    st = backend.sharded_tensor_cls()
    like = {k: st.from_rank_offsets(f"model.{k}", torch.zeros(v.shape, dtype=torch.float32,
                                                              device=v.device), replica_id=rank)
            for k, v in full.items()}
    loaded = ck.load({"model": like}, root)["model"]
    differ = [k for k, v in full.items() if not torch.equal(loaded[k].to(v.dtype), v)]
    return {"params": len(full), "differ": differ[:10], "n_differ": len(differ)}


def create_grads_and_step(trainer: Trainer) -> None:
    """Without a forward pass (CPU): give every parameter a gradient and take one optimizer
    step, so the optimizer state exists and differs from its initial values."""
    import torch

    with torch.no_grad():
        for p in trainer.model.parameters():
            p.grad = torch.full_like(p, 0.01, dtype=getattr(p, "grad_dtype", None) or p.dtype)
    trainer.optimizer.step()


def checkpoint_roundtrip(args: argparse.Namespace, trainer: Trainer, root: Path,
                         next_step: int | None) -> dict[str, Any]:
    from megatron_ckpt_ext import Checkpointer, CkptOptions
    from megatron_ckpt_ext.fsdp import fsdp_sharded_state_dict, load_fsdp_state_dict

    model, optimizer = trainer.model, trainer.optimizer
    with Checkpointer(CkptOptions(async_save=not args.sync_save)) as ck:
        state = fsdp_sharded_state_dict(model, optimizer)
        want = snapshot(state)
        ck.save(state, root, iteration=args.steps)
        loss_before = trainer.step(next_step) if next_step is not None else None  # write runs
        scramble(state, optimizer)  # the saved bytes must be those of save() time
        ck.maybe_finalize(blocking=True)
        loaded = ck.load(fsdp_sharded_state_dict(model, optimizer), root)
        load_fsdp_state_dict(model, loaded, optimizer)
        result = compare(snapshot(fsdp_sharded_state_dict(model, optimizer)), want)
        result["mode"] = ck.reports[-1]["mode"] if ck.reports else None
        result["whole_tensors"] = whole_tensor_check(ck, trainer, root)
    if next_step is not None:
        loss_after = trainer.step(next_step)
        result.update(next_loss_before=loss_before, next_loss_after_load=loss_after,
                      resume_bit_exact=loss_before == loss_after)
    return result


# -- results -------------------------------------------------------------------------------------
def versions(device: Any) -> dict[str, Any]:
    import torch

    from megatron_ckpt_ext import backend

    caps = backend.detect()
    ok, reason = backend.fsdp_symm_mem_support()
    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "megatron_core": caps.mcore_version, "nvidia_resiliency_ext": caps.nvrx_version,
             "fsdp_symm_mem_support": ok, "fsdp_symm_mem_detail": reason}
    if device.type == "cuda":
        facts.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(device),
                     nccl=_nccl_version())
    return facts


def _nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def all_ranks(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def verdicts(result: dict[str, Any]) -> dict[str, bool]:
    checks: dict[str, bool] = {}
    if "kernels" in result:
        off, on = result["kernels"]["off"], result["kernels"]["on"]
        checks["symk_off_zero"] = off["symk_allgather"] == 0 and off["symk_reducescatter"] == 0
        checks["symk_on_allgather"] = on["symk_allgather"] > 0
        checks["symk_on_reducescatter"] = on["symk_reducescatter"] > 0
        checks["loss_parity"] = all(p["within_bf16_tolerance"] for p in result["loss_parity"])
    if "roundtrip" in result:
        trips = result["roundtrip"]
        checks["roundtrip_bit_exact"] = all(t["n_differ"] == 0 and not t["missing"] for t in trips)
        checks["whole_tensors_match"] = all(t["whole_tensors"]["n_differ"] == 0 for t in trips)
        if "resume_bit_exact" in trips[0]:
            checks["resume_loss_bit_exact"] = all(t["resume_bit_exact"] for t in trips)
    return checks


def table(result: dict[str, Any]) -> str:
    rows = [("check", "flag off", "flag on", "ok")]
    ok = result["checks"]
    if "kernels" in result:
        off, on = result["kernels"]["off"], result["kernels"]["on"]
        exp = result["kernels"]["expected_on"]
        rows += [
            ("ncclSymk AllGather kernels", off["symk_allgather"],
             f"{on['symk_allgather']} (of {exp['allgather']})",
             ok["symk_off_zero"] and ok["symk_on_allgather"]),
            ("ncclSymk ReduceScatter kernels", off["symk_reducescatter"],
             f"{on['symk_reducescatter']} (of {exp['reducescatter']})",
             ok["symk_off_zero"] and ok["symk_on_reducescatter"]),
            ("all NCCL kernels (traced steps)", off["nccl_total"], on["nccl_total"], ""),
        ]
        parity = result["loss_parity"]
        worst = max(p["max_abs_diff"] for p in parity)
        exact = all(p["bit_exact"] for p in parity)
        rows.append(("loss parity, max |on - off|", "", f"{worst:.3g}"
                     + (" (bit-exact)" if exact else " (bf16 tolerance)"), ok["loss_parity"]))
    if "roundtrip" in result:
        trip = result["roundtrip"][0]
        rows.append(("checkpoint round trip (rank 0)", "",
                     f"{trip['tensors']} tensors, {trip['bytes'] / 2**20:.1f} MiB, "
                     f"{sum(t['n_differ'] for t in result['roundtrip'])} differ",
                     ok["roundtrip_bit_exact"]))
        rows.append(("whole parameters loaded = all-gathered", "",
                     f"{trip['whole_tensors']['params']} params, "
                     f"{sum(t['whole_tensors']['n_differ'] for t in result['roundtrip'])} differ",
                     ok["whole_tensors_match"]))
        if "resume_loss_bit_exact" in ok:
            same = ok["resume_loss_bit_exact"]
            rows.append(("loss of the next step after load", "",
                         "same as before save" if same else "DIFFERENT", same))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    cells = [rows[0]] + [tuple("yes" if c is True else "NO" if c is False else c for c in r)
                         for r in rows[1:]]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


def write_result(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{RESULT_FILE}.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(out / RESULT_FILE)


# -- the run -------------------------------------------------------------------------------------
def run_training(args: argparse.Namespace, rank: int, device: Any, mesh: Any,
                 result: dict[str, Any], timings: dict[str, float]) -> Trainer:
    import torch

    runs: dict[str, Trainer] = {}
    kernels: dict[str, Any] = {}
    for label, flag in (("off", False), ("on", True)):
        with phase(f"train_{label}", args.phase_timeout, timings):
            runs[label] = make_trainer(args, rank, device, mesh, use_symm_mem=flag)
            kernels[label] = train(runs[label])
        if label == "off":
            off_losses = runs.pop("off").losses  # free the flag-off model before the next run
            torch.cuda.empty_cache()
    kernels["expected_on"] = expected_collectives(args, runs["on"])
    result["kernels"] = kernels  # rank 0's trace (both ranks launch the same collectives)
    result["loss_parity"] = all_ranks(loss_parity(off_losses, runs["on"].losses))
    result["losses_rank0"] = {"off": off_losses, "on": runs["on"].losses}
    return runs["on"]


def checkpoint_root(args: argparse.Namespace, rank: int) -> tuple[Path, bool]:
    """(root, whether this run owns it and removes it): rank 0 picks, every rank agrees."""
    if args.ckpt_dir is not None:
        return args.ckpt_dir, False
    picked = tempfile.mkdtemp(prefix="mcx_fsdp_ckpt_") if rank == 0 else None
    return Path(all_ranks(picked)[0]), True


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    env = check_env()
    rank, world, local_rank = launch_facts()
    device = pick_device(args, local_rank)
    timings: dict[str, float] = {}
    with phase("init", args.phase_timeout, timings):
        mesh = init_distributed(device, args.phase_timeout)
    result: dict[str, Any] = {"versions": versions(device), "env": env, "world": world,
                              "config": {k: str(v) for k, v in vars(args).items()},
                              "timings_s": timings}
    root, owned = checkpoint_root(args, rank)
    try:
        run_phases(args, rank, device, mesh, root, result, timings)
    except BaseException as e:
        if rank == 0:  # keep what was measured, and why it stopped
            write_result(args.out, {**result, "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        if owned and rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    result["checks"] = verdicts(result)
    result["ok"] = all(result["checks"].values())
    if rank == 0:
        write_result(args.out, result)
        print(table(result), flush=True)
        verdict = "PASS" if result["ok"] else "FAIL"
        print(f"result: {args.out / RESULT_FILE} ({verdict})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


def run_phases(args: argparse.Namespace, rank: int, device: Any, mesh: Any, root: Path,
               result: dict[str, Any], timings: dict[str, float]) -> None:
    if args.checkpoint_only:
        trainer = make_trainer(args, rank, device, mesh, use_symm_mem=False)
        create_grads_and_step(trainer)
        next_step = None
    else:
        trainer = run_training(args, rank, device, mesh, result, timings)
        next_step = args.steps
    with phase("checkpoint", args.phase_timeout, timings):
        result["roundtrip"] = all_ranks(checkpoint_roundtrip(args, trainer, root, next_step))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except SetupError as e:
        print(f"check_fsdp_symm_mem: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
