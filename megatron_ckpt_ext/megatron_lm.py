"""The thin adapter for a Megatron-LM checkout: ``megatron.training`` saves through our Checkpointer.

One call, :func:`install` (or :func:`extra_args_provider`, which registers our flags and installs),
routes ``megatron.training``'s torch_dist checkpoint writes and reads through
:class:`megatron_ckpt_ext.checkpointer.Checkpointer`. Megatron's own ``save_checkpoint`` keeps
building the state dict, the RNG/rerun state and its finalize callbacks (tracker line, logging);
only these names, found by feature detection in ``backend.megatron_training_seams``, are replaced
where Megatron looks them up:

* ``checkpointing.dist_checkpointing`` -> a proxy whose ``save``/``load`` call the Checkpointer
  (everything else is the real module);
* ``checkpointing.schedule_async_save`` / ``is_empty_async_queue`` and
  ``training.maybe_finalize_async_save`` (plus their definitions in ``async_utils``) -> our
  schedule and finalize, so Megatron's finalize callbacks run after our atomic commit;
* ``initialize.init_persistent_async_worker`` -> builds our Checkpointer early (it owns the
  worker; Megatron's would be a second, idle one);
* ``training.train_step`` -> Megatron's, then, once after the first step, the Checkpointer
  prepares the staging for the state Megatron will save (the first save then costs a steady one).

Megatron's terminate (end of training) drains the saves but keeps the Checkpointer for the save
Megatron makes after its loop; it is closed at process exit or :func:`uninstall`.

The replacements and the adapter's state live in ``_mlm_seams.py``; this module installs and
removes them. Where a seam is missing, :func:`install` raises one :class:`MegatronAdapterError`
naming the Megatron version and the seam, and patches nothing. Importing this module never imports
megatron; it is importable (and useless) where ``megatron.training`` is absent.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable

from . import backend
from ._mlm_seams import _close_at_exit  # noqa: F401  (the exit hook, reached here by tests)
from ._mlm_seams import (CheckpointerFactory, _default_factory,
                         _DistCheckpointingProxy, _init_persistent_async_worker,
                         _is_empty_async_queue, _lock, _maybe_finalize_async_save,
                         _preparing_train_step, _schedule_async_save, _state,
                         _warming_setup)
from ._runtime import rank
from .arguments import add_arguments
from .debug import env_switch, profiled, trace_event, trace_gc
from .errors import BackendUnavailable, MegatronAdapterError
from .options import CkptOptions
from .save.report import gc_pauses

__all__ = [
    "extra_args_provider",
    "install",
    "is_installed",
    "parse_and_validate_args",
    "reports",
    "uninstall",
]

logger = logging.getLogger(__name__)

# (module, name) pairs replaced by install(); the optional ones are patched only where present.
_PATCHES = (
    ("checkpointing", "dist_checkpointing"),
    ("checkpointing", "schedule_async_save"),
    ("checkpointing", "is_empty_async_queue"),
    ("training", "maybe_finalize_async_save"),
    ("async_utils", "schedule_async_save"),
    ("async_utils", "maybe_finalize_async_save"),
    ("async_utils", "is_empty_async_queue"),
)
_OPTIONAL_PATCHES = (("initialize", "init_persistent_async_worker"), ("training", "train_step"),
                     ("training", "setup_model_and_optimizer"))


# -- public API ----------------------------------------------------------------------------------
def install(
    *,
    options: CkptOptions | None = None,
    route_load: bool = True,
    checkpointer_factory: CheckpointerFactory | None = None,
    modules: dict[str, Any] | None = None,
) -> None:
    """Route megatron.training's torch_dist saves (and loads) through our Checkpointer.

    ``options`` default to ``CkptOptions.from_args(get_args())`` at the first save, so the flags
    Megatron parsed (ours or its own spelling of them) decide. ``route_load=False`` leaves loads
    to stock megatron-core (our checkpoints are plain torch_dist). ``checkpointer_factory`` and
    ``modules`` are for tests. Idempotent; raises :class:`MegatronAdapterError` where a seam is
    missing, before patching anything.
    """
    with _lock:
        if _state.installed:
            return
        mods = modules if modules is not None else _real_modules()
        seams = backend.megatron_training_seams(modules=mods)
        if not seams.ok:
            raise MegatronAdapterError(
                f"megatron-ckpt-ext cannot hook Megatron-LM: {seams.describe_problem()}. "
                "Use a megatron-core release the adapter supports (0.19.x is tested), or drop "
                "install()/extra_args_provider and save with stock Megatron."
            )
        _state.reset(mods, options=options, route_load=route_load,
                     factory=checkpointer_factory or _default_factory)
        _apply_patches(mods)
        _state.installed = True
    logger.info("megatron-ckpt-ext: megatron.training checkpointing routed through Checkpointer")


def uninstall() -> None:
    """Restore every patched name and close the Checkpointer (drains pending saves first)."""
    with _lock:
        if not _state.installed:
            return
        try:
            _state.close()
        finally:
            for (short, name), original in _state.originals.items():
                setattr(_state.modules[short], name, original)
            _state.originals.clear()
            _state.installed = False


def is_installed() -> bool:
    return _state.installed


def reports() -> list[dict]:
    """Per-save records: the adapter's own (``blocking_s`` inside Megatron's save) merged with
    the Checkpointer's ``reports`` where it has them."""
    ours = [dict(r) for r in _state.records]
    # every Checkpointer of this run (after uninstall() a later install makes a new one),
    # matched by iteration, the latest report of an iteration winning
    theirs = [*_state.closed_reports, *(getattr(_state.checkpointer, "reports", None) or [])]
    by_iteration = {extra.get("iteration"): extra for extra in theirs}
    for record in ours:
        extra = by_iteration.get(record.get("iteration"))
        if extra is not None:
            record["checkpointer"] = dict(extra)
    return ours


def extra_args_provider(parser: Any) -> Any:
    """Megatron's ``extra_args_provider``: add our flags (the host's win) and install."""
    return _add_and_install(parser)


def _add_and_install(parser: Any) -> Any:
    add_arguments(parser)
    install()
    return parser


def parse_and_validate_args(*, extra_args_provider: Callable[[Any], Any] | None = None,
                            **kwargs: Any) -> Any:
    """Parse-then-pretrain style (megatron-core >= 0.19): Megatron's own parse function, with our
    flags added after the caller's provider, and the adapter installed. Returns Megatron's args."""
    seams = backend.megatron_training_seams()
    if seams.parse_args_fn is None:
        raise MegatronAdapterError(
            f"megatron-ckpt-ext cannot find Megatron-LM's argument parser: "
            f"{seams.describe_problem() or 'no arguments.parse_* takes extra_args_provider'}. "
            "Pass megatron_ckpt_ext.megatron_lm.extra_args_provider to pretrain() instead."
        )
    module_name, fn_name = seams.parse_args_fn.split(".")
    parse = getattr(backend.megatron_training_module(module_name), fn_name)
    return parse(extra_args_provider=_chain(extra_args_provider), **kwargs)


def _chain(user: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    def provider(parser: Any) -> Any:
        if user is not None:
            parser = user(parser)
        return _add_and_install(parser)

    return provider


def _real_modules() -> dict[str, Any]:
    try:
        return {short: backend.megatron_training_module(short) for short in backend.MLM_MODULES}
    except BackendUnavailable as e:
        version = backend.detect().mcore_version or "(not installed)"
        raise MegatronAdapterError(
            f"megatron-ckpt-ext cannot hook Megatron-LM: megatron.training of megatron-core "
            f"{version} is not importable here ({e}). Install megatron-core >= 0.19 (it ships "
            "megatron.training) or run from a Megatron-LM checkout."
        ) from e


def _profiled_save_checkpoint(folder: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``MCX_PROFILE_SAVES``: Megatron's ``save_checkpoint`` (as training.py calls it) under
    cProfile, appended as "megatron save_checkpoint iteration N" (docs/DEBUGGING.md)."""
    @functools.wraps(original)
    def save_checkpoint(iteration: Any, *args: Any, **kwargs: Any) -> Any:
        return profiled(folder, f"megatron save_checkpoint iteration {iteration}", rank(),
                        original, iteration, *args, **kwargs)

    return save_checkpoint


def _profiled_load_checkpoint(folder: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``MCX_PROFILE_LOADS``: Megatron's ``load_checkpoint`` (as training.py calls it) under
    cProfile, appended to ``load_profile_rank<R>.txt`` (docs/DEBUGGING.md)."""
    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        return profiled(folder, "megatron load_checkpoint", rank(), original, *args,
                        stem="load_profile", lines=80, **kwargs)

    return load_checkpoint


def _around_save_checkpoint(original: Callable[..., Any], *,
                            pause_gc: bool) -> Callable[..., Any]:
    """Megatron's ``save_checkpoint`` with, on entry, the copies of the last save's tensors
    issued while it builds its state dict (``Checkpointer.stage_ahead``, save/ahead.py: the save
    takes them only if its tensors are those, unchanged; what it did not take is given back on
    the way out), and with Python's cyclic collector paused while it runs (its own state
    building around our save triggers collections too: ``save/report.py: gc_pauses``;
    ``MCX_GC_IN_SAVE=1`` leaves it running)."""
    trace = env_switch("MCX_WRITER_TRACE")
    trace_gc(trace, rank=rank())

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        with gc_pauses(None) if pause_gc else contextlib.nullcontext():
            checkpointer = _state.checkpointer
            ahead = (hasattr(checkpointer, "stage_ahead") and not kwargs.get("non_persistent_ckpt")
                     and checkpointer.stage_ahead())
            ahead_s = time.time() - start
            try:
                return original(*args, **kwargs)
            finally:
                if ahead:
                    checkpointer.drop_ahead()
                if trace:
                    _trace_window(trace, start, ahead_s)

    return save_checkpoint


def _trace_window(folder: str, start: float, ahead_s: float) -> None:
    """``MCX_WRITER_TRACE``: Megatron's whole ``save_checkpoint`` as one event, with the time
    staging ahead took on entry and what a device synchronize right after it waits (Megatron's
    timer synchronizes there too, so this adds no wait of its own)."""
    import torch

    returned = time.time()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    trace_event(folder, "save_checkpoint", rank=rank(), start=start,
                ahead_s=round(ahead_s, 4), body_s=round(returned - start, 4),
                sync_after_s=round(time.time() - returned, 4))


def _apply_patches(modules: dict[str, Any]) -> None:
    replacements: dict[str, Any] = {
        "dist_checkpointing": _DistCheckpointingProxy(modules["checkpointing"].dist_checkpointing),
        "schedule_async_save": _schedule_async_save,
        "is_empty_async_queue": _is_empty_async_queue,
        "maybe_finalize_async_save": _maybe_finalize_async_save,
        "init_persistent_async_worker": _init_persistent_async_worker,
        "train_step": _preparing_train_step(getattr(modules.get("training"), "train_step", None)),
        "setup_model_and_optimizer": _warming_setup(
            getattr(modules.get("training"), "setup_model_and_optimizer", None)),
    }
    present = [p for p in _OPTIONAL_PATCHES if hasattr(modules.get(p[0]), p[1])]
    folder = env_switch("MCX_PROFILE_SAVES")
    original = getattr(modules.get("training"), "save_checkpoint", None)
    wrapped = original
    if callable(original):
        wrapped = _around_save_checkpoint(wrapped, pause_gc=env_switch("MCX_GC_IN_SAVE") != "1")
    if folder and callable(original):
        # Megatron's whole save_checkpoint (its own state building around our save), profiled
        wrapped = _profiled_save_checkpoint(folder, wrapped)
    if wrapped is not original:
        replacements["save_checkpoint"] = wrapped
        present.append(("training", "save_checkpoint"))
    load = getattr(modules.get("training"), "load_checkpoint", None)
    if env_switch("MCX_PROFILE_LOADS") and callable(load):
        replacements["load_checkpoint"] = _profiled_load_checkpoint(
            env_switch("MCX_PROFILE_LOADS"), load)
        present.append(("training", "load_checkpoint"))
    for short, name in (*_PATCHES, *present):
        _state.originals[(short, name)] = getattr(modules[short], name)
        setattr(modules[short], name, replacements[name])
