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

Where a seam is missing, :func:`install` raises one :class:`MegatronAdapterError` naming the
Megatron version and the seam, and patches nothing. Importing this module never imports
megatron; it is importable (and useless) where ``megatron.training`` is absent.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import backend
from ._runtime import rank, warn_once
from .arguments import add_arguments
from .errors import BackendUnavailable, MegatronAdapterError
from .options import CkptOptions

__all__ = [
    "extra_args_provider",
    "install",
    "is_installed",
    "parse_and_validate_args",
    "reports",
    "uninstall",
]

logger = logging.getLogger(__name__)

_ITER_DIR = re.compile(r"iter_(\d{7})")
_DEFAULT_STRICT = ("assume_ok_unexpected", "StrictHandling.ASSUME_OK_UNEXPECTED")
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
_OPTIONAL_PATCHES = (("initialize", "init_persistent_async_worker"), ("training", "train_step"))


CheckpointerFactory = Callable[[CkptOptions], Any]


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


# -- state ---------------------------------------------------------------------------------------
@dataclass
class _PendingSave:
    """What Megatron's save_checkpoint gets back from ``dist_checkpointing.save`` when async:
    it collects Megatron's finalize callbacks, which run after our commit of ``iteration``."""

    iteration: int
    finalize_fns: list[Callable[[], Any]] = field(default_factory=list)

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        self.finalize_fns.append(fn)

    def run_finalize_fns(self) -> None:
        for fn in self.finalize_fns:
            fn()
        self.finalize_fns.clear()


@dataclass
class _State:
    installed: bool = False
    modules: dict[str, Any] = field(default_factory=dict)
    originals: dict[tuple[str, str], Any] = field(default_factory=dict)
    options: CkptOptions | None = None
    route_load: bool = True
    factory: CheckpointerFactory | None = None
    checkpointer: Any = None
    scheduled: dict[int, _PendingSave] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    closed_reports: list[dict] = field(default_factory=list)  # closed Checkpointers', kept
    stepped: bool = False  # train_step ran once in this process (staging prepared then)

    def reset(self, modules: dict[str, Any], *, options: CkptOptions | None, route_load: bool,
              factory: CheckpointerFactory) -> None:
        self.modules, self.options, self.route_load, self.factory = modules, options, route_load, factory
        self.checkpointer, self.scheduled, self.records, self.closed_reports = None, {}, [], []
        self.stepped = False

    def get_checkpointer(self) -> Any:
        if self.checkpointer is None:
            if self.options is None:
                self.options = CkptOptions.from_args(self.modules["checkpointing"].get_args())
            self.checkpointer = self.factory(self.options)
            _close_at_exit.register()
        _bind_dp_group(self.checkpointer)
        return self.checkpointer

    def close(self) -> None:
        if self.checkpointer is not None:
            _finalize(blocking=True)
            self.drop_checkpointer()

    def drop_checkpointer(self) -> None:
        self.closed_reports.extend(getattr(self.checkpointer, "reports", None) or [])
        self.checkpointer.close()
        self.checkpointer = None


_state = _State()
_lock = threading.RLock()


class _CloseAtExit:
    """Closes the adapter's Checkpointer when the trainer's process exits, if no save is pending
    (the Checkpointer outlives Megatron's terminate for the end-of-training save). A pending save
    is left as it is: draining it needs every rank, and a process leaving on an error must not
    wait for ranks still training. Only in the process that registered (not in forks)."""

    def __init__(self) -> None:
        self._pid: int | None = None

    def register(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            atexit.register(self.run, self._pid)

    @staticmethod
    def run(pid: int) -> None:
        with _lock:
            checkpointer = _state.checkpointer
            if os.getpid() != pid or checkpointer is None or not getattr(checkpointer, "idle", True):
                return
            try:
                _state.drop_checkpointer()
            except Exception as e:  # noqa: BLE001 - at exit: say it, never raise
                logger.warning("megatron-ckpt-ext: closing the Checkpointer at exit failed: %s", e)


_close_at_exit = _CloseAtExit()


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


def _default_factory(options: CkptOptions) -> Any:
    from .checkpointer import Checkpointer

    return Checkpointer(options, dp_group=_dp_group(), save_dir=_save_dir())


def _save_dir() -> str | None:
    """Megatron's ``--save``, so the Checkpointer checks it and takes its job lock at start-up
    (else at the first save), or None."""
    get_args = getattr(_state.modules.get("checkpointing"), "get_args", None)
    try:
        save = getattr(get_args(), "save", None) if callable(get_args) else None
    except Exception:  # noqa: BLE001 - Megatron's args not parsed yet: the first save locks
        return None
    return save if isinstance(save, (str, os.PathLike)) else None


def _dp_group() -> Any:
    """Megatron's data-parallel group (with context parallel), or None before
    ``initialize_model_parallel`` ran: the early Checkpointer is built in initialize_megatron
    before the groups exist, and gets the group at its first use (:func:`_bind_dp_group`)."""
    mpu = getattr(_state.modules["checkpointing"], "mpu", None)
    if mpu is None:
        return None
    ready = getattr(mpu, "model_parallel_is_initialized", None)
    if ready is not None and not ready():
        return None
    return mpu.get_data_parallel_group(with_context_parallel=True)


def _bind_dp_group(checkpointer: Any) -> None:
    if getattr(checkpointer, "dp_group", True) is None:
        checkpointer.dp_group = _dp_group()


def _apply_patches(modules: dict[str, Any]) -> None:
    replacements: dict[str, Any] = {
        "dist_checkpointing": _DistCheckpointingProxy(modules["checkpointing"].dist_checkpointing),
        "schedule_async_save": _schedule_async_save,
        "is_empty_async_queue": _is_empty_async_queue,
        "maybe_finalize_async_save": _maybe_finalize_async_save,
        "init_persistent_async_worker": _init_persistent_async_worker,
        "train_step": _preparing_train_step(getattr(modules.get("training"), "train_step", None)),
    }
    present = [p for p in _OPTIONAL_PATCHES if hasattr(modules.get(p[0]), p[1])]
    for short, name in (*_PATCHES, *present):
        _state.originals[(short, name)] = getattr(modules[short], name)
        setattr(modules[short], name, replacements[name])


# -- the seams -----------------------------------------------------------------------------------
class _DistCheckpointingProxy:
    """``megatron.core.dist_checkpointing`` with ``save``/``load`` routed to our Checkpointer."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def save(self, sharded_state_dict: Any, checkpoint_dir: str, *args: Any, **kwargs: Any) -> Any:
        iteration = _iteration_of(checkpoint_dir)
        if iteration is None:
            warn_once(f"mlm-save-{checkpoint_dir}", f"megatron-ckpt-ext: {checkpoint_dir} "
                      "is not an iter_NNNNNNN directory; saved by stock megatron-core.")
            return self._real.save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        return _save(sharded_state_dict, checkpoint_dir, iteration, **kwargs)

    def load(self, sharded_state_dict: Any, checkpoint_dir: str, *args: Any, **kwargs: Any) -> Any:
        iteration = _iteration_of(checkpoint_dir)
        strict = str(kwargs.get("strict", _DEFAULT_STRICT[0]))
        if not _state.route_load or iteration is None or strict not in _DEFAULT_STRICT:
            return self._real.load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        checkpointer = _state.get_checkpointer()
        return checkpointer.load(sharded_state_dict, os.path.dirname(checkpoint_dir),
                                 iteration=iteration)


def _iteration_of(checkpoint_dir: Any) -> int | None:
    match = _ITER_DIR.fullmatch(os.path.basename(os.path.normpath(str(checkpoint_dir))))
    return int(match.group(1)) if match else None


def _save(sharded_state_dict: Any, checkpoint_dir: str, iteration: int, *,
          async_sharded_save: bool = False, content_metadata: Any = None, **_ignored: Any) -> Any:
    """Megatron's ``dist_checkpointing.save(...)`` call, served by the Checkpointer.

    Megatron's strategy, validation and preprocessing arguments are ignored: the Checkpointer
    builds its own strategy from the options and validates its cached structure itself.
    """
    if content_metadata is not None:  # what dist_checkpointing.save would store, same key
        sharded_state_dict[backend.mcore_content_metadata_key()] = content_metadata
    checkpointer = _state.get_checkpointer()
    start = time.perf_counter()
    checkpointer.save(sharded_state_dict, os.path.dirname(checkpoint_dir), iteration=iteration)
    is_async = bool(async_sharded_save and _state.options is not None and _state.options.async_save)
    if not is_async:
        _finalize(blocking=True)
    _state.records.append({"iteration": iteration, "async": is_async,
                           "blocking_s": time.perf_counter() - start})
    if not async_sharded_save:
        return None  # Megatron's sync path asserts None and writes its tracker line itself
    return _PendingSave(iteration)


def _schedule_async_save(request: Any) -> None:
    """Megatron hands back what ``_save`` returned; its callbacks wait for our commit."""
    if not isinstance(request, _PendingSave):
        raise MegatronAdapterError(
            f"megatron-ckpt-ext: schedule_async_save got a {type(request).__name__}, not a save "
            "made through the adapter; a caller bypassed the adapter's dist_checkpointing (for "
            "ckpt formats other than torch_dist use stock Megatron: uninstall() first)."
        )
    if _state.options is not None and not _state.options.async_save:
        request.run_finalize_fns()  # already committed by _save
        return
    _state.scheduled[request.iteration] = request


def _is_empty_async_queue() -> bool:
    return not _state.scheduled


def _maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Finalize what our Checkpointer committed, then Megatron's callbacks for those saves.

    ``terminate`` (Megatron's end of training) drains every pending save but keeps the
    Checkpointer, its writer and its staging: Megatron saves once more after its training loop
    (the end-of-training save), which then costs a steady save instead of a first one. The
    Checkpointer is closed when the process exits (or at :func:`uninstall`)."""
    _finalize(blocking=blocking or terminate)
    cleanup = getattr(_state.modules.get("checkpointing"), "finalize_deletion_processes", None)
    if callable(cleanup):
        cleanup(blocking=blocking or terminate)


def _finalize(*, blocking: bool) -> list[int]:
    if _state.checkpointer is None:
        return []
    committed = list(_state.checkpointer.maybe_finalize(blocking=blocking))
    for iteration in committed:
        pending = _state.scheduled.pop(iteration, None)
        if pending is not None:
            pending.run_finalize_fns()
    return committed


def _preparing_train_step(original: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Megatron's ``train_step``; after this process's first step returns (the optimizer's
    state exists from then on), the Checkpointer prepares its staging for the state the first
    save will stage (:meth:`Checkpointer.prepare`: node admission, then allocation and pinning in
    a background thread), so the first save copies into ready memory like a steady one. Every
    rank takes its first step, so the admission collective is entered by all."""
    if original is None:
        return None
    arguments = backend.call_arguments(original)
    if arguments is None:
        return original

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if not _state.stepped:
            _state.stepped = True
            _prepare_after_first_step(arguments(*args, **kwargs))
        return result

    return train_step


def _prepare_after_first_step(arguments: dict[str, Any]) -> None:
    checkpointing = _state.modules.get("checkpointing")
    get_args = getattr(checkpointing, "get_args", None)
    margs = get_args() if callable(get_args) else None
    model = arguments.get("model")
    if margs is None or model is None or not getattr(margs, "save", None):
        return
    start = time.perf_counter()
    state = backend.megatron_sharded_state(checkpointing, margs, model, arguments.get("optimizer"),
                                           arguments.get("opt_param_scheduler"))
    if state is None:
        logger.debug("megatron-ckpt-ext: this Megatron builds no sharded state outside its save; "
                     "the first save allocates its staging")
        return
    with _lock:
        _state.get_checkpointer().prepare(state)
    if rank() == 0:
        logger.info("megatron-ckpt-ext: staging for the first save prepared after the first "
                    "training step (state built in %.3f s; allocation continues in the "
                    "background)", time.perf_counter() - start)


def _init_persistent_async_worker(rank: int, mp_mode: str = "spawn") -> None:
    """Megatron calls this in ``initialize_megatron`` (with ``--async-save
    --use-persistent-ckpt-worker``), before the model is built. Instead of Megatron's worker we
    build the Checkpointer here: its writer process and write-results queue start now and warm up
    while the model is built, not inside the first save."""
    logger.debug("megatron-ckpt-ext: Megatron's persistent worker replaced on rank %d (%s) by the "
                 "Checkpointer's, started now", rank, mp_mode)
    with _lock:
        _state.get_checkpointer()
