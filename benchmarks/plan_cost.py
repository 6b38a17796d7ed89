"""What a steady save's blocking phases cost on a GPT-shaped state, CPU or GPU, in one run: our
Checkpointer as configured, then the same with a diagnostic switch turned on (default
``MCX_CONVERT_EVERY_SAVE=1``: megatron-core converts every shard anew, as stock does), so the
ratio is measured on the same machine in the same process.

    torchrun --standalone --nproc-per-node 1 benchmarks/plan_cost.py --json plan_cost.json

The state mirrors what Megatron-LM's ``save_checkpoint`` hands over for a GPT with stacked layers:
per layer key one shard per layer on a prepended axis, the embeddings and final norm, three
optimizer tensors per parameter (``exp_avg``, ``exp_avg_sq``, ``fp32_param``), an RNG
ShardedObject and the common objects (args, scheduler). ``--layers 8`` gives 400 tensors, the
134M recipe's count; ``--hidden`` sets their size (small by default: planning, not copying, is
measured). Per variant: every save's ``phases``, and the medians of saves 3.. (the first save
plans a new structure, the second is nvrx's second validation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ckpt_ext import Checkpointer, CkptOptions, backend  # noqa: E402

LAYER_PARAMS = {  # name -> shape in units of the hidden size H
    "self_attention.linear_proj.weight": (1, 1), "self_attention.linear_proj.bias": (1,),
    "self_attention.linear_qkv.weight": (3, 1), "self_attention.linear_qkv.bias": (3,),
    "self_attention.linear_qkv.layer_norm_weight": (1,),
    "self_attention.linear_qkv.layer_norm_bias": (1,),
    "mlp.linear_fc1.weight": (4, 1), "mlp.linear_fc1.bias": (4,), "mlp.linear_fc2.weight": (1, 4),
    "mlp.linear_fc2.bias": (1,), "mlp.linear_fc1.layer_norm_weight": (1,),
    "mlp.linear_fc1.layer_norm_bias": (1,),
}


class GptState:
    """The tensors of a GPT-shaped model and its optimizer, and the sharded state built from them
    each save (a new dict each time, as Megatron-LM builds one)."""

    def __init__(self, layers: int, hidden: int, device: str) -> None:
        h, self.layers = hidden, layers
        make = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device=device)  # noqa
        self.model: dict[str, list] = {
            "embedding.word_embeddings.weight": [(None, make(5 * h, h))],
            "embedding.position_embeddings.weight": [(None, make(h, h))],
            "decoder.final_layernorm.weight": [(None, make(h))],
            "decoder.final_layernorm.bias": [(None, make(h))],
        }
        for name, units in LAYER_PARAMS.items():
            shape = tuple(u * h for u in units)
            self.model["decoder.layers." + name] = [(i, make(*shape)) for i in range(layers)]
        self.optim = {f"optimizer.state.{m}.{k}": [(i, t.float()) for i, t in v]
                      for k, v in self.model.items() for m in ("exp_avg", "exp_avg_sq", "fp32_param")}

    def step(self) -> None:
        for shards in list(self.model.values()) + list(self.optim.values()):
            for _, t in shards:
                t.add_(0.01)

    def _sharded(self, key: str, shards: list) -> object:
        st = backend.sharded_tensor_cls()
        if shards[0][0] is None:
            return st.from_rank_offsets(key, shards[0][1], replica_id=0)
        return [st.from_rank_offsets(key, t, (0, i, self.layers), replica_id=0,
                                     prepend_axis_num=1) for i, t in shards]

    def sharded_state_dict(self, iteration: int) -> dict:
        from megatron.core.dist_checkpointing import ShardedObject

        rng = ShardedObject("rng_state", {"torch": torch.get_rng_state(), "py": list(range(625))},
                            (1,), (0,), replica_id=0)
        return {"model": {k: self._sharded(k, v) for k, v in self.model.items()},
                "optimizer": {"state": {k: self._sharded(k, v) for k, v in self.optim.items()},
                              "param_groups": [{"lr": 3e-4, "params": list(range(len(self.model)))}]},
                "rng_state": [rng], "iteration": iteration, "checkpoint_version": 3.0,
                "args": argparse.Namespace(**{f"arg{i}": i for i in range(300)}),
                "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": iteration}}


# --breakdown: the functions a steady save's planning runs, timed by wrapping them (module,
# attribute, label); absent ones (another megatron-core or nvrx) are skipped
BREAKDOWN = (
    ("megatron.core.dist_checkpointing.serialization", "save_preprocess", "save_preprocess"),
    ("megatron.core.dist_checkpointing.strategies.torch",
     "_replace_state_dict_keys_with_sharded_keys", "replace_keys"),
    ("megatron.core.dist_checkpointing.strategies.torch", "mcore_to_pyt_state_dict",
     "mcore_to_pyt"),
    ("megatron.core.dist_checkpointing.strategies.torch", "TorchDistSaveShardedStrategy.async_save",
     "async_save"),
    ("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
     "FileSystemWriterAsync.prepare_write_data", "prepare_write_data"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async",
     "FileSystemWriterAsync.prepare_write_data", "prepare_write_data"),
    ("megatron_ckpt_ext.backend.replay", "_replay", "replay"),
    ("megatron_ckpt_ext.backend.replay", "_objects_planner", "replay_objects"),
    ("megatron_ckpt_ext.backend.replay", "_fingerprint", "replay_fingerprint"),
    ("megatron_ckpt_ext.save.steps", "run_agreed", "run_agreed"),
    ("megatron_ckpt_ext.save.steps", "build", "write_path_build"),
)
TIMES: dict[str, list[float]] = {}


def install_breakdown() -> None:
    import functools
    import importlib
    import time

    for module, attr, label in BREAKDOWN:
        try:
            owner = importlib.import_module(module)
            for part in attr.split(".")[:-1]:
                owner = getattr(owner, part)
            fn = getattr(owner, attr.split(".")[-1])
        except (ImportError, AttributeError):
            continue

        def timed(*a, _fn=fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                TIMES.setdefault(_label, []).append(time.perf_counter() - t)

        functools.update_wrapper(timed, fn)
        setattr(owner, attr.split(".")[-1], timed)


def run_variant(state: GptState, options: CkptOptions, saves: int, switch: dict) -> dict:
    old = {k: os.environ.get(k) for k in switch}
    os.environ.update(switch)
    root = tempfile.mkdtemp(prefix="plan_cost_")
    TIMES.clear()
    try:
        with Checkpointer(options, save_dir=root) as ck:
            ck.prepare(state.sharded_state_dict(0))
            ck.wait_prepared(120)
            marks = []
            for s in range(1, saves + 1):
                state.step()
                marks.append({k: len(v) for k, v in TIMES.items()})
                ck.save(state.sharded_state_dict(s), root, iteration=s)
                ck.maybe_finalize(blocking=True)
            reports = [{"iteration": r["iteration"], "blocking_s": r["blocking_s"],
                        "phases": r["phases"], "plan": r["stage_detail"].get("plan")}
                       for r in ck.reports]
            # per function, the median of its time per save over saves 3.. (calls summed)
            start = marks[2] if len(marks) > 2 else {}
            breakdown = {k: round(sum(v[start.get(k, 0):]) / max(1, saves - 2), 6)
                         for k, v in TIMES.items()}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    steady = reports[2:] or reports
    med = lambda key: statistics.median(  # noqa: E731
        r["phases"][key] if key != "blocking_s" else r["blocking_s"] for r in steady)
    return {"switch": switch, "saves": reports, "breakdown_mean_s": breakdown,
            "steady_median": {k: round(med(k), 5) for k in ("blocking_s", "plan_s", "stage_s",
                                                             "prepare_dir_s", "schedule_s")}}


def process_group(port: int) -> None:
    """The gloo process group these probes run in: torchrun's, or one of this process alone
    (``MASTER_PORT`` default ``port``) when run as a plain script."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--baseline-switch", default="MCX_CONVERT_EVERY_SAVE=1",
                   help="NAME=VALUE of a registered MCX_* switch for the baseline variant")
    p.add_argument("--json", default=None)
    p.add_argument("--breakdown", action="store_true",
                   help="time the functions a steady save's planning runs (breakdown_mean_s)")
    args = p.parse_args(argv)
    if args.breakdown:
        install_breakdown()
    process_group(29561)
    name, value = args.baseline_switch.split("=", 1)
    from megatron_ckpt_ext.debug import env_switch
    env_switch(name)  # a misspelt switch fails here
    state = GptState(args.layers, args.hidden, args.device)
    options = CkptOptions(async_save=True, use_persistent_ckpt_worker=True,
                          async_ckpt_use_cpu_shm=True, ckpt_assume_constant_structure=True,
                          dist_ckpt_workers=1)
    counted: list[int] = []
    backend.map_sharded_tensors(state.sharded_state_dict(0), lambda t: counted.append(1) or t)
    ours = run_variant(state, options, args.saves, {})
    base = run_variant(state, options, args.saves, {name: value})
    caps = backend.detect()
    result = {"command": "torchrun --standalone --nproc-per-node 1 benchmarks/plan_cost.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": args.device, "tensors": len(counted), "layers": args.layers,
              "hidden": args.hidden, "versions": {"megatron-core": caps.mcore_version, "nvrx": caps.nvrx_version,
                                                  "torch": torch.__version__},
              "ours": ours, "baseline": base,
              "plan_ratio": round(ours["steady_median"]["plan_s"]
                                  / base["steady_median"]["plan_s"], 3),
              "blocking_ratio": round(ours["steady_median"]["blocking_s"]
                                      / base["steady_median"]["blocking_s"], 3)}
    if dist.get_rank() == 0:
        print(json.dumps({k: result[k] for k in ("tensors", "plan_ratio", "blocking_ratio")}))
        print("ours", ours["steady_median"], {k: round(v * 1e3, 2) for k, v in ours["breakdown_mean_s"].items()})
        print("baseline", base["steady_median"], {k: round(v * 1e3, 2) for k, v in base["breakdown_mean_s"].items()})
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
