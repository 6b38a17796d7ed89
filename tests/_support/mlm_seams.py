"""Megatron-LM's megatron.training seams, recorded from its real sources, and stand-in modules
built from a recording (tests/unit/test_backend_mlm.py pins the recording against the sources;
the adapter's tests and the megatron-core main compat pass probe the stand-ins).

``RECORDED`` holds, per Megatron-LM release, each seam function's parameters and the names its
code looks up; ``extract`` re-extracts them (with ``ast``) from a source file.
"""

from __future__ import annotations

import ast
import os
import subprocess
import types
from pathlib import Path

from tests._support import ROOT

__all__ = ["MIRROR", "PROBED", "RECORDED", "SEAM_NAMES", "WHEEL_0192", "extract", "extract_release",
           "git_show", "modules_from", "wheel_reader"]

# The unpacked megatron-core 0.19.2 wheel (scripts/test.sh unpacks it there) and a Megatron-LM git
# clone with its core_r0.8.0/core_r0.16.0/core_r0.19.0 branches (no package ships megatron/training
# of those releases): the tests that read them skip, saying so, where they are absent.
WHEEL_0192 = Path(os.environ.get("MCORE0192_DIR") or ROOT / ".ext" / "mcore-0.19.2")
MIRROR = Path(os.environ.get("MLM_MIRROR") or ROOT / ".ext" / "megatron-lm.git")

# Per module: attribute -> ["module"] (a module with save/load), ["imported"] (a name bound by
# an import; resolved from the module it comes from), or [params, looked-up seam names].
SEAM_NAMES = ("dist_checkpointing", "schedule_async_save", "is_empty_async_queue",
              "maybe_finalize_async_save", "init_persistent_async_worker")
PROBED = {
    "checkpointing": ("save_checkpoint", "dist_checkpointing", "schedule_async_save",
                      "is_empty_async_queue"),
    "training": ("pretrain", "maybe_finalize_async_save"),
    "async_utils": ("schedule_async_save", "maybe_finalize_async_save", "is_empty_async_queue",
                    "init_persistent_async_worker"),
    "arguments": ("parse_and_validate_args", "parse_args"),
    "initialize": ("initialize_megatron", "init_persistent_async_worker"),
}

RECORDED: dict[str, dict[str, dict[str, list]]] = {
    "0.19.2": {
        "checkpointing": {
            "save_checkpoint": [["iteration", "model", "optimizer", "opt_param_scheduler",
                                 "num_floating_point_operations_so_far", "checkpointing_context",
                                 "pipeline_rank", "expert_rank", "tensor_rank",
                                 "pipeline_parallel", "expert_parallel", "non_persistent_ckpt",
                                 "train_data_iterator", "preprocess_common_state_dict_fn",
                                 "release", "tp_group", "pp_group", "dp_cp_group", "dp_group",
                                 "expt_dp_group", "rng_state_key_prefix"],
                                ["dist_checkpointing", "is_empty_async_queue",
                                 "schedule_async_save"]],
            "dist_checkpointing": ["module"],
            "schedule_async_save": ["imported"],
            "is_empty_async_queue": ["imported"],
        },
        "training": {
            "pretrain": [["cfg_container", "train_valid_test_dataset_provider", "model_type",
                          "forward_step_func", "model_provider", "process_non_loss_data_func",
                          "get_embedding_ranks", "get_position_embedding_ranks",
                          "non_loss_data_func", "store", "inprocess_call_wrapper",
                          "p2p_communicator", "pg_collection", "skip_model_parallel_init"],
                         ["maybe_finalize_async_save"]],
            "maybe_finalize_async_save": ["imported"],
        },
        "async_utils": {
            "schedule_async_save": [["async_request"], []],
            "maybe_finalize_async_save": [["blocking", "terminate"], ["is_empty_async_queue"]],
            "is_empty_async_queue": [[], []],
            "init_persistent_async_worker": [["rank", "mp_mode"], []],
        },
        "arguments": {
            "parse_and_validate_args": [["extra_args_provider", "ignore_unknown_args",
                                         "args_defaults"], []],
            "parse_args": [["extra_args_provider", "ignore_unknown_args"], []],
        },
        "initialize": {
            "initialize_megatron": [["allow_no_cuda", "skip_mpu_initialization",
                                     "get_embedding_ranks", "get_position_embedding_ranks",
                                     "store", "skip_model_parallel_init", "seed_pp_group",
                                     "seed_dp_group", "seed_tp_group", "seed_ep_group",
                                     "seed_etp_group", "skip_random_seed"],
                                    ["init_persistent_async_worker"]],
            "init_persistent_async_worker": ["imported"],
        },
    },
}


# -- extraction from real sources (pins RECORDED) ------------------------------------------------
def _looked_up(node: ast.AST) -> set[str]:
    """Seam names a function's own body looks up (nested defs excluded, like co_names)."""
    found: set[str] = set()
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, ast.Name) and child.id in SEAM_NAMES:
            found.add(child.id)
        stack.extend(ast.iter_child_nodes(child))
    return found


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def extract(source: str, names: tuple[str, ...]) -> dict[str, list]:
    """``names``' entries (a recording's shape) read from one module's source."""
    tree = ast.parse(source)
    out: dict[str, list] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            out[node.name] = [_params(node), sorted(_looked_up(node))]
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or alias.name
                if bound in names and bound not in out:
                    is_module = bound == "dist_checkpointing"
                    out[bound] = ["module"] if is_module else ["imported"]
    return out


def git_show(ref: str, path: str) -> str | None:
    """``path`` at ``ref`` in the Megatron-LM mirror; None where the mirror or the file is absent."""
    if not MIRROR.exists():
        return None
    result = subprocess.run(["git", "-C", str(MIRROR), "show", f"{ref}:{path}"],
                            capture_output=True, text=True, check=False)
    return result.stdout if result.returncode == 0 else None


def extract_release(read: callable) -> dict[str, dict[str, list]] | None:
    """A release's recording from ``read(path)`` (None where a probed module is absent)."""
    out = {}
    for short, names in PROBED.items():
        source = read(f"megatron/training/{short}.py")
        if source is None:
            return None
        out[short] = extract(source, names)
    return out


def wheel_reader(path: str) -> str | None:
    """``path`` in the unpacked 0.19.2 wheel; None where it is not unpacked."""
    file = WHEEL_0192 / path
    return file.read_text() if file.exists() else None


# -- stand-in modules built from a recording -----------------------------------------------------
def _function(name: str, params: list[str], looks_up: list[str]) -> types.FunctionType:
    args = ", ".join(f"{p}=None" for p in params)
    body = "; ".join(looks_up) or "pass"
    namespace: dict = {}
    exec(f"def {name}({args}):\n    {body}\n", namespace)
    return namespace[name]


def modules_from(recording: dict[str, dict[str, list]]) -> dict[str, types.ModuleType]:
    """Stand-in ``megatron.training`` modules: real functions with the recorded signatures and
    look-ups, so the adapter's ``inspect``-based probes run on them as on the real ones."""
    dc = types.ModuleType("megatron.core.dist_checkpointing")
    dc.save = dc.load = lambda *a, **k: None
    mods = {short: types.ModuleType(f"megatron.training.{short}") for short in recording}
    for short, attrs in recording.items():
        for name, spec in attrs.items():
            if spec == ["module"]:
                setattr(mods[short], name, dc)
            elif spec != ["imported"]:
                setattr(mods[short], name, _function(name, *spec))
    for short, attrs in recording.items():  # imports resolve to async_utils' definitions
        for name, spec in attrs.items():
            if spec == ["imported"]:
                setattr(mods[short], name, getattr(mods["async_utils"], name))
    return mods
