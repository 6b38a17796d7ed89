"""megatron-core main (Megatron-LM's next release) against our seams, from its own sources.

The sources are Megatron-LM's ``megatron/`` at the commit scripts/unpack_mcore_main.sh pins,
unpacked into ``.ext/mcore-main`` (``MCORE_MAIN_DIR``). ``megatron.training`` of main does not
import here (it needs the whole ``megatron.core``, whose ``__init__`` needs triton), so its seams
are read with ``ast`` and probed through stand-ins by the same code the adapter runs on a GPU host
(tests/unit/test_backend_mlm.py's recording machinery). Where the sources are absent these tests
skip saying so, except in the matrix's main pass (``MCE_MCORE_SOURCE`` set), where they fail.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path

import pytest

from megatron_ckpt_ext import backend
from megatron_ckpt_ext.arguments import add_arguments
from tests._support.mlm_seams import PROBED, extract, modules_from

ROOT = Path(__file__).resolve().parents[2]
MAIN = Path(os.environ.get("MCE_MCORE_SOURCE") or os.environ.get("MCORE_MAIN_DIR")
            or ROOT / ".ext" / "mcore-main")
PINNED = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # scripts/unpack_mcore_main.sh

# Megatron-LM spellings our parser also defines on purpose: add_arguments defers to a host parser
# that already has them (the same meaning; options.py names the Megatron spelling). Any other flag
# of ours that main defines is a clash.
SHARED_WITH_MEGATRON = frozenset({
    "--async-ckpt-cpu-priority", "--async-ckpt-io-priority", "--async-ckpt-use-cpu-shm",
    "--async-save", "--ckpt-assume-constant-structure", "--ckpt-fully-parallel-load",
    "--dist-ckpt-workers", "--distributed-timeout-minutes", "--exit-on-missing-checkpoint",
    "--exit-signal", "--exit-signal-handler", "--logging-level", "--most-recent-k",
    "--no-check-for-nan-in-loss-and-grad", "--no-ckpt-fully-parallel-save", "--no-load-rng",
    "--no-save-rng", "--save-retain-interval", "--use-persistent-ckpt-worker",
})
# main's new checkpoint and telemetry flags (training/config/training_config.py's dataclass
# fields and training/arguments.py): none may be ours.
MAIN_NEW_FLAGS = ("--ckpt-fully-parallel-load-per-rank-objects", "--ckpt-pg-tensors-cache-path",
                  "--ckpt-pg-tensors-cache-create", "--otel-enabled", "--otel-service-name",
                  "--otel-span-groups")
# What main removed from dist_checkpointing (dict_utils helpers, ShardedTensor methods, utils
# helpers, the load strategy's and planner's stream_ckpt_dequant): our package must use none.
REMOVED_IN_MAIN = {
    "dict_utils.py": ("inspect_types", "nested_items_iter", "dict_map", "dict_map_with_key"),
    "mapping.py": ("global_slice", "max_allowed_chunks"),
    "utils.py": ("extract_sharded_tensors_or_nonpersistent", "debug_msg"),
    "strategies/torch.py": ("stream_ckpt_dequant", "_intermediate_read_items"),
}


def _main_dir() -> Path:
    if not (MAIN / "megatron" / "core").is_dir():
        message = (f"megatron-core main sources not at {MAIN} "
                   "(bash scripts/unpack_mcore_main.sh .ext/mcore-main; MEGATRON_LM_GIT)")
        if os.environ.get("MCE_MCORE_SOURCE"):
            pytest.fail(message)
        pytest.skip(message)
    return MAIN


def _read(rel: str) -> str:
    return (_main_dir() / "megatron" / rel).read_text()


def test_sources_are_the_pinned_commit():
    marker = _main_dir() / "MEGATRON_LM_COMMIT"
    assert marker.read_text().strip() == PINNED


def _main_seams_recording() -> dict[str, dict[str, list]]:
    recording = {short: extract(_read(f"training/{short}.py"), names)
                 for short, names in PROBED.items()}
    # the worker bootstrap's telemetry: a lookup outside the seam names extract() collects
    init = next(node for node in ast.parse(_read("training/async_utils.py")).body
                if isinstance(node, ast.FunctionDef) and node.name == "init_persistent_async_worker")
    if any(isinstance(n, ast.Name) and n.id == "build_otel_worker_bootstrap" for n in ast.walk(init)):
        params, looks_up = recording["async_utils"]["init_persistent_async_worker"]
        recording["async_utils"]["init_persistent_async_worker"] = [
            params, [*looks_up, "build_otel_worker_bootstrap"]]
    return recording


def test_main_keeps_every_seam_of_the_adapter():
    seams = backend.megatron_training_seams(modules=modules_from(_main_seams_recording()))
    assert seams.ok, seams.describe_problem()
    # parse-then-pretrain, like 0.19: pretrain takes a config container, not extra_args_provider
    assert seams.pretrain_extra_args_provider is False
    assert seams.parse_args_fn == "arguments.parse_and_validate_args"
    assert seams.persistent_worker_init is True
    # main's worker bootstrap hands nvrx an otel_bootstrap; the adapter's replacement does not
    assert seams.worker_otel_bootstrap is True


def test_save_checkpoint_of_main_still_routes_through_the_seams():
    recording = _main_seams_recording()
    _, looks_up = recording["checkpointing"]["save_checkpoint"]
    assert {"dist_checkpointing", "schedule_async_save", "is_empty_async_queue"} <= set(looks_up)


def test_load_reader_seam_is_in_main():
    # backend/load_reader.py replaces strategies/torch.py's module-level _get_filesystem_reader,
    # which TorchDistLoadShardedStrategy.load looks up by name.
    tree = ast.parse(_read("core/dist_checkpointing/strategies/torch.py"))
    top = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert "_get_filesystem_reader" in top
    load = next(n for n in top["TorchDistLoadShardedStrategy"].body
                if isinstance(n, ast.FunctionDef) and n.name == "load")
    assert any(isinstance(n, ast.Name) and n.id == "_get_filesystem_reader" for n in ast.walk(load))


def _main_flags() -> set[str]:
    flags: set[str] = set()
    for path in (_main_dir() / "megatron" / "training").rglob("*.py"):
        text = path.read_text()
        flags |= set(re.findall(r"['\"](--[a-z0-9][a-z0-9-]*)['\"]", text))
        if "config" in path.parts:  # dataclass fields become flags (argument_utils)
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and not node.target.id.startswith("_"):
                    flags.add("--" + node.target.id.replace("_", "-"))
    return flags


def test_our_flags_do_not_clash_with_mains():
    main = _main_flags()
    assert set(MAIN_NEW_FLAGS) <= main  # the extraction sees main's new flags
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ours = {o for action in parser._actions for o in action.option_strings} - {"-h", "--help"}
    assert not (ours & set(MAIN_NEW_FLAGS))
    clashes = (ours & main) - SHARED_WITH_MEGATRON
    assert not clashes, f"flags of ours that megatron-core main defines too: {sorted(clashes)}"


def test_our_package_uses_nothing_main_removed():
    for rel, names in REMOVED_IN_MAIN.items():
        source = _read(f"core/dist_checkpointing/{rel}")
        still = [n for n in names if re.search(rf"\b{n}\b", source)]
        assert not still, f"main's {rel} still has {still}: REMOVED_IN_MAIN is wrong"
    removed = {n for names in REMOVED_IN_MAIN.values() for n in names}
    used = {}
    probes = ROOT / "megatron_ckpt_ext" / "backend" / "detection.py"  # may name them, to detect
    for path in (ROOT / "megatron_ckpt_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else (
                node.id if isinstance(node, ast.Name) else
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and path != probes else None)
            if name in removed:
                used.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    assert not used, f"uses what megatron-core main removed: {used}"
