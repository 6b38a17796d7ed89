"""Seam detection for megatron.training (backend.megatron_training_seams).

megatron.training of megatron-core 0.19.2 does not import on this CPU machine (its import chain
needs triton), so the seams are tested against signatures recorded from the real sources:
``RECORDED`` below holds, per Megatron-LM release, each seam function's parameters and the names
its code looks up. ``test_recording_matches_real_sources`` re-extracts them (with ``ast``) from
the unpacked 0.19.2 wheel and the Megatron-LM mirror's release branches when those are present,
so the recording cannot drift from the sources. Stand-in modules are then built from the
recording (real functions with those signatures and lookups) and probed by the same
``inspect``-based code the adapter runs on a GPU machine.
"""

from __future__ import annotations

import ast
import os
import subprocess
import types
from pathlib import Path

import pytest

from megatron_ckpt_ext import backend

_ROOT = Path(__file__).resolve().parents[2]
# The unpacked megatron-core 0.19.2 wheel (scripts/test.sh unpacks it there) and a Megatron-LM git
# clone with its core_r0.8.0/core_r0.16.0/core_r0.19.0 branches (no package ships megatron/training
# of those releases): the tests that read them skip, saying so, where they are absent.
WHEEL_0192 = Path(os.environ.get("MCORE0192_DIR") or _ROOT / ".ext" / "mcore-0.19.2")
MIRROR = Path(os.environ.get("MLM_MIRROR") or _ROOT / ".ext" / "megatron-lm.git")

# Per module: attribute -> ["module"] (a module with save/load), ["imported"] (a name bound by
# an import; resolved from the module it comes from), or [params, looked-up seam names].
_SEAM_NAMES = ("dist_checkpointing", "schedule_async_save", "is_empty_async_queue",
               "maybe_finalize_async_save", "init_persistent_async_worker")
_PROBED = {
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
        if isinstance(child, ast.Name) and child.id in _SEAM_NAMES:
            found.add(child.id)
        stack.extend(ast.iter_child_nodes(child))
    return found


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def extract(source: str, names: tuple[str, ...]) -> dict[str, list]:
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


def _git_show(ref: str, path: str) -> str | None:
    if not MIRROR.exists():
        return None
    result = subprocess.run(["git", "-C", str(MIRROR), "show", f"{ref}:{path}"],
                            capture_output=True, text=True, check=False)
    return result.stdout if result.returncode == 0 else None


def _extract_release(read: callable) -> dict[str, dict[str, list]] | None:
    out = {}
    for short, names in _PROBED.items():
        source = read(f"megatron/training/{short}.py")
        if source is None:
            return None
        out[short] = extract(source, names)
    return out


def _wheel_reader(path: str) -> str | None:
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


# -- tests ---------------------------------------------------------------------------------------
def test_recording_matches_real_sources_of_the_0_19_2_wheel():
    real = _extract_release(_wheel_reader)
    if real is None:
        pytest.skip(f"megatron-core 0.19.2 sources not unpacked at {WHEEL_0192} (MCORE0192_DIR)")
    assert real == RECORDED["0.19.2"]


def test_recording_matches_mirror_branch_core_r0_19_0():
    real = _extract_release(lambda p: _git_show("core_r0.19.0", p))
    if real is None:
        pytest.skip(f"Megatron-LM mirror not at {MIRROR} (MLM_MIRROR: a git clone of Megatron-LM)")
    assert real == RECORDED["0.19.2"]


def test_0_19_2_has_every_seam_and_is_parse_then_pretrain():
    seams = backend.megatron_training_seams(modules=modules_from(RECORDED["0.19.2"]))
    assert seams.ok, seams.describe_problem()
    assert seams.missing == ()
    assert seams.pretrain_extra_args_provider is False
    assert seams.parse_args_fn == "arguments.parse_and_validate_args"
    assert seams.persistent_worker_init is True


def test_0_16_pretrain_takes_extra_args_provider_from_the_real_branch():
    real = _extract_release(lambda p: _git_show("core_r0.16.0", p))
    if real is None:
        pytest.skip(f"Megatron-LM mirror not at {MIRROR} (MLM_MIRROR: a git clone of Megatron-LM)")
    seams = backend.megatron_training_seams(modules=modules_from(real))
    assert seams.pretrain_extra_args_provider is True
    assert seams.parse_args_fn == "arguments.parse_args"  # 0.16 has no parse_and_validate_args
    assert seams.ok, seams.describe_problem()


@pytest.mark.parametrize(("short", "name"), [
    ("checkpointing", "schedule_async_save"),
    ("training", "maybe_finalize_async_save"),
    ("async_utils", "is_empty_async_queue"),
])
def test_a_missing_seam_is_named(short, name):
    mods = modules_from(RECORDED["0.19.2"])
    delattr(mods[short], name)
    seams = backend.megatron_training_seams(modules=mods)
    assert not seams.ok
    assert seams.missing == (f"megatron.training.{short}.{name} (absent)",)
    assert f"megatron.training.{short}.{name}" in seams.describe_problem()


def test_save_checkpoint_that_no_longer_calls_dist_checkpointing_is_a_missing_seam():
    recording = {k: dict(v) for k, v in RECORDED["0.19.2"].items()}
    params, _ = recording["checkpointing"]["save_checkpoint"]
    recording["checkpointing"]["save_checkpoint"] = [params, ["schedule_async_save"]]
    seams = backend.megatron_training_seams(modules=modules_from(recording))
    assert seams.missing == ("megatron.training.checkpointing.save_checkpoint "
                             "(does not look up dist_checkpointing)",)


def test_dist_checkpointing_without_save_is_a_missing_seam():
    mods = modules_from(RECORDED["0.19.2"])
    mods["checkpointing"].dist_checkpointing = types.ModuleType("stub")
    seams = backend.megatron_training_seams(modules=mods)
    assert seams.missing == ("megatron.training.checkpointing.dist_checkpointing (has no save/load)",)


def test_without_megatron_training_detection_reports_why_and_never_raises():
    seams = backend.megatron_training_seams()
    if backend.detect().megatron_training and seams.error is None:
        pytest.skip("megatron.training imports here")
    assert not seams.ok
    assert "megatron.training" in seams.error
    assert "cannot be imported" in seams.describe_problem()


def test_oldest_branches_without_async_utils_are_refused_by_name():
    real = {}
    for short, names in _PROBED.items():
        source = _git_show("core_r0.8.0", f"megatron/training/{short}.py")
        if source is None and not MIRROR.exists():
            pytest.skip(f"Megatron-LM mirror not at {MIRROR} (MLM_MIRROR: a git clone of Megatron-LM)")
        real[short] = extract(source, names) if source is not None else {}
    seams = backend.megatron_training_seams(modules=modules_from(real))
    assert not seams.ok
    assert any(m.startswith("megatron.training.async_utils.") for m in seams.missing), seams.missing
