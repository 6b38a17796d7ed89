"""Megatron-LM's ``megatron.training``: where the installed copy can be hooked (the seams the
Megatron-LM adapter patches), found by feature detection; never raises."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping

from ._imports import MCORE_DIST, _attr, _import, _installed_version, _try_import
from .introspect import _code_names, _names_param

MLM_TRAINING = "megatron.training"
MLM_MODULES = ("checkpointing", "training", "async_utils", "arguments", "initialize")
# (module, attribute, names its code must look up): the seams megatron_lm.install() patches. A
# function seam counts only where the caller really looks the name up in that module's globals.
MLM_REQUIRED_SEAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("checkpointing", "save_checkpoint", ("dist_checkpointing", "schedule_async_save")),
    ("checkpointing", "dist_checkpointing", ()),
    ("checkpointing", "schedule_async_save", ()),
    ("checkpointing", "is_empty_async_queue", ()),
    ("training", "maybe_finalize_async_save", ()),
    ("training", "pretrain", ()),
    ("async_utils", "schedule_async_save", ()),
    ("async_utils", "maybe_finalize_async_save", ()),
    ("async_utils", "is_empty_async_queue", ()),
)


_MLM_PARSE_FNS = ("parse_and_validate_args", "parse_args")


@dataclass(frozen=True)
class MegatronSeams:
    """Where the installed ``megatron.training`` can be hooked (see :func:`megatron_training_seams`)."""

    mcore_version: str | None
    error: str | None  # why megatron.training cannot be imported; None when it can
    missing: tuple[str, ...]  # required seams not found, each "module.name (what is wrong)"
    pretrain_extra_args_provider: bool  # pretrain(..., extra_args_provider=...) is accepted
    parse_args_fn: str | None  # "arguments.<fn>" taking extra_args_provider (parse-then-pretrain)
    persistent_worker_init: bool  # initialize.init_persistent_async_worker is looked up there
    # Megatron's own async_utils.init_persistent_async_worker builds a telemetry bootstrap for the
    # worker (build_otel_worker_bootstrap -> warmup_persistent_caller(otel_bootstrap=...)): where
    # the adapter replaces that function, the worker it starts gets none.
    worker_otel_bootstrap: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.missing

    def describe_problem(self) -> str:
        """One sentence naming the Megatron version and what is missing (empty when ok)."""
        where = f"megatron.training of megatron-core {self.mcore_version or '(unknown version)'}"
        if self.error is not None:
            return f"{where} cannot be imported: {self.error}"
        if self.missing:
            return f"{where} lacks the seam(s) {', '.join(self.missing)}"
        return ""


def megatron_training_seams(*, modules: Mapping[str, Any] | None = None) -> MegatronSeams:
    """Probe ``megatron.training`` for the seams the adapter needs; never raises.

    ``modules`` maps the short names of :data:`MLM_MODULES` to module-like objects (tests pass
    stand-ins built from recorded signatures); by default the real modules are imported.
    """
    version = _installed_version("megatron", MCORE_DIST)
    if modules is None:
        modules, error = _import_mlm_modules()
        if error is not None:
            return MegatronSeams(version, error, (), False, None, False)
    try:
        return _probe_mlm(modules, version)
    except Exception as e:  # noqa: BLE001 - probing must never take the run down
        return MegatronSeams(version, f"probing failed: {type(e).__name__}: {e}", (), False,
                             None, False)


def megatron_training_module(short_name: str) -> ModuleType:
    """``megatron.training.<short_name>``; raises BackendUnavailable saying why not."""
    return _import(f"{MLM_TRAINING}.{short_name}")


def _import_mlm_modules() -> tuple[dict[str, Any], str | None]:
    modules: dict[str, Any] = {}
    for short in MLM_MODULES:
        module, error = _try_import(f"{MLM_TRAINING}.{short}")
        if module is None:
            return {}, f"importing {MLM_TRAINING}.{short} fails ({error})"
        modules[short] = module
    return modules, None


def _probe_mlm(modules: Mapping[str, Any], version: str | None) -> MegatronSeams:
    missing = tuple(m for m in (_seam_problem(modules, *s) for s in MLM_REQUIRED_SEAMS) if m)
    pretrain = _attr(modules.get("training"), "pretrain")
    parse_fn = next((name for name in _MLM_PARSE_FNS
                     if _names_param(_attr(modules.get("arguments"), name), "extra_args_provider")),
                    None)
    init_worker = _attr(modules.get("initialize"), "initialize_megatron")
    return MegatronSeams(
        mcore_version=version,
        error=None,
        missing=missing,
        pretrain_extra_args_provider=_names_param(pretrain, "extra_args_provider"),
        parse_args_fn=f"arguments.{parse_fn}" if parse_fn else None,
        persistent_worker_init=(_attr(modules.get("initialize"), "init_persistent_async_worker")
                                is not None
                                and "init_persistent_async_worker" in _code_names(init_worker)),
        worker_otel_bootstrap="build_otel_worker_bootstrap" in _code_names(
            _attr(modules.get("async_utils"), "init_persistent_async_worker")),
    )


def _seam_problem(modules: Mapping[str, Any], short: str, name: str,
                  looks_up: tuple[str, ...]) -> str | None:
    module = modules.get(short)
    value = _attr(module, name)
    label = f"{MLM_TRAINING}.{short}.{name}"
    if value is None:
        return f"{label} (absent)"
    if name == "dist_checkpointing":
        has_api = callable(_attr(value, "save")) and callable(_attr(value, "load"))
        return None if has_api else f"{label} (has no save/load)"
    if not callable(value):
        return f"{label} (not callable)"
    unused = [n for n in looks_up if n not in _code_names(value)]
    return f"{label} (does not look up {', '.join(unused)})" if unused else None


# -- the state Megatron's save_checkpoint would build (for Checkpointer.prepare) -----------------
_STATE_FN_PARAMS = ("args", "model", "optimizer", "opt_param_scheduler", "rng_state",
                    "optim_sd_kwargs", "model_sd_kwargs")


def builds_sharded_state(checkpointing: Any) -> bool:
    """Whether :func:`megatron_sharded_state` can build the state with this Megatron's
    ``checkpointing`` module (its ``generate_state_dict`` found by its parameters, and
    ``unwrap_model``): the launcher's first training step then prepares the first save."""
    generate = _attr(checkpointing, "generate_state_dict")
    return (generate is not None and all(_names_param(generate, p) for p in _STATE_FN_PARAMS)
            and callable(_attr(checkpointing, "unwrap_model")))


def megatron_sharded_state(checkpointing: Any, args: Any, model: Any, optimizer: Any,
                           opt_param_scheduler: Any) -> Any | None:
    """The sharded state dict Megatron's ``save_checkpoint`` would build for these objects now,
    through the module's own ``generate_state_dict`` and sharding metadata, with its RNG and
    rerun state (objects: they stage nothing, but the save's plan and structure name them, so
    a state without them never matches the first save's). Collective where Megatron's RNG
    gathering is (``--data-parallel-random-init``). None where this Megatron has no such
    function (found by its parameters), or for a checkpoint format other than torch_dist."""
    if not builds_sharded_state(checkpointing):
        return None
    if getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        return None
    generate = _attr(checkpointing, "generate_state_dict")
    # save_checkpoint unwraps the model (DDP, Float16Module) before it builds the state: the
    # wrapped modules' state names every tensor under "module." (seen on the H100: 400 of 400
    # prepared buffers named otherwise than the save's tensors, so the first save allocated)
    unwrap = _attr(checkpointing, "unwrap_model")
    build_metadata = _attr(checkpointing, "_build_sharded_state_dict_metadata")
    metadata = build_metadata(args) if callable(build_metadata) else None
    kwargs = dict(metadata=metadata) if metadata is not None else None
    extra = {}
    rerun = _rerun_state(checkpointing, args)
    if rerun is not None and _names_param(generate, "rerun_state"):
        extra["rerun_state"] = rerun
    return generate(args, unwrap(model), optimizer, opt_param_scheduler,
                    _rng_state(checkpointing, args), optim_sd_kwargs=kwargs,
                    model_sd_kwargs=kwargs, **extra)


# what Megatron-LM's save_checkpoint imports inside its first async save (0.19: the
# distillation logits saver; 24-26 ms of that save where the wheels were installed uncompiled)
FIRST_SAVE_IMPORTS = ["megatron.training.distillation"]


def import_first_save_modules(args: Any) -> list[str]:
    """Import now what Megatron-LM's ``save_checkpoint`` would import inside its first async
    save, so that save does not pay it; returns the names imported (a missing one is skipped:
    that Megatron does not import it either)."""
    if not getattr(args, "async_save", False):
        return []
    done = []
    for name in FIRST_SAVE_IMPORTS:
        if name in sys.modules or _try_import(name)[0] is None:
            continue
        done.append(name)
    return done


def _rng_state(checkpointing: Any, args: Any) -> Any:
    """What ``save_checkpoint`` passes as ``rng_state``: Megatron's ``get_rng_state`` called
    with the arguments its signature names (older ones take the format or a flag alone); None
    with ``--no-save-rng`` or where it cannot be called so."""
    get = _attr(checkpointing, "get_rng_state")
    if get is None or getattr(args, "no_save_rng", False):
        return None
    mpu = _attr(checkpointing, "mpu")
    if _names_param(get, "tp_group") and _names_param(get, "pp_group") and mpu is not None:
        return get(args.ckpt_format, mpu.get_tensor_model_parallel_group(),
                   mpu.get_pipeline_model_parallel_group())
    if _names_param(get, "ckpt_format"):
        return get(args.ckpt_format)
    if _names_param(get, "use_dist_ckpt"):
        return get(True)
    return None


def _rerun_state(checkpointing: Any, args: Any) -> Any:
    """What ``save_checkpoint`` passes as ``rerun_state`` (None where the machine or its
    ``state_dict`` parameters are not this Megatron's)."""
    machine = _attr(checkpointing, "get_rerun_state_machine")
    state_dict = _attr(machine() if callable(machine) else None, "state_dict")
    if not (_names_param(state_dict, "data_iterator") and _names_param(state_dict, "ckpt_format")):
        return None
    return state_dict(data_iterator=None, ckpt_format=args.ckpt_format)
