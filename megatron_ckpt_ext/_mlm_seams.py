"""The adapter's state and the functions it puts in place of Megatron-LM's (installed by
:func:`megatron_ckpt_ext.megatron_lm.install`): the ``dist_checkpointing`` proxy, our save,
schedule and finalize, the ``train_step`` wrapper that prepares the staging, the early
Checkpointer in place of Megatron's persistent worker, and the close at process exit. The
module-level ``_state`` is the one :mod:`.megatron_lm` re-exports and tests read."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import backend
from ._runtime import Recent, rank, warn_once
from .debug import env_switch
from .errors import MegatronAdapterError
from .options import CkptOptions
from .save.layout import parse_iteration

__all__: list[str] = []

logger = logging.getLogger(__name__)

_EARLY = "Megatron's initialisation"  # where the launcher prepares a restore seconds early
_DEFAULT_STRICT = ("assume_ok_unexpected", "StrictHandling.ASSUME_OK_UNEXPECTED")

CheckpointerFactory = Callable[[CkptOptions], Any]


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
    records: list[dict] = field(default_factory=Recent)  # the last Recent.KEPT
    closed_reports: list[dict] = field(default_factory=Recent)  # closed Checkpointers', kept
    stepped: bool = False  # train_step ran once in this process (staging prepared then)
    step_seam: bool = False  # train_step wrapped: it prepares the first save after one step
    restore_prepared: bool = False  # prepare_restore was asked (once per process)

    def reset(self, modules: dict[str, Any], *, options: CkptOptions | None, route_load: bool,
              factory: CheckpointerFactory) -> None:
        self.modules, self.options, self.route_load, self.factory = modules, options, route_load, factory
        self.checkpointer, self.scheduled = None, {}
        self.records, self.closed_reports = Recent(), Recent()
        self.stepped = self.restore_prepared = self.step_seam = False

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

    def drop_checkpointer(self, *, after_error: bool = False) -> None:
        self.closed_reports.extend(getattr(self.checkpointer, "reports", None) or [])
        if after_error:  # the sealed snapshot stays for the restart (Checkpointer.close)
            self.checkpointer.close(after_error=True)
        else:
            self.checkpointer.close()
        self.checkpointer = None


_state = _State()
_lock = threading.RLock()


class _CloseAtExit:
    """Closes the adapter's Checkpointer when the trainer's process exits, if no save is pending
    (the Checkpointer outlives Megatron's terminate for the end-of-training save). A pending save
    is left as it is: draining it needs every rank, and a process leaving on an error must not
    wait for ranks still training. A process leaving on an uncaught exception (Python recorded
    it in ``sys.last_value`` before the exit handlers run) keeps its sealed snapshot for the
    restart. Only in the process that registered (not in forks)."""

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
            failed = getattr(sys, "last_value", None) is not None
            try:
                _state.drop_checkpointer(after_error=failed)
            except Exception as e:  # noqa: BLE001 - at exit: say it, never raise
                logger.warning("megatron-ckpt-ext: closing the Checkpointer at exit failed: %s", e)


_close_at_exit = _CloseAtExit()


# -- the Checkpointer Megatron's calls reach ------------------------------------------------
def _default_factory(options: CkptOptions) -> Any:
    from .checkpointer import Checkpointer

    return Checkpointer(options, dp_group=_dp_group(), save_dir=_save_dir())


def _save_dir() -> str | None:
    """Megatron's ``--save``, so the Checkpointer checks it and takes its job lock at start-up
    (else at the first save), or None."""
    return _dir_arg("save")


def _dir_arg(name: str) -> str | None:
    """Megatron's ``--save`` or ``--load``, or None (not given, or its args not parsed yet: the
    first save locks, and a load warms nothing ahead)."""
    value = _arg(name)
    return value if isinstance(value, (str, os.PathLike)) else None


def _arg(name: str) -> Any:
    """Megatron's parsed argument ``name``, or None (absent, or not parsed yet)."""
    get_args = getattr(_state.modules.get("checkpointing"), "get_args", None)
    try:
        return getattr(get_args(), name, None) if callable(get_args) else None
    except Exception:  # noqa: BLE001
        return None


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
        if hasattr(checkpointer, "prepare_at_load"):
            checkpointer.prepare_at_load = _prepares_at_load()
        if hasattr(checkpointer, "pin_at_load"):  # else the first step's prepare() pins it
            checkpointer.pin_at_load = (env_switch("MCX_PIN_ADOPTED") == "load"
                                        or checkpointer.prepare_at_load)
        return checkpointer.load(sharded_state_dict, os.path.dirname(checkpoint_dir),
                                 iteration=iteration)


def _prepares_at_load() -> bool:
    """Whether the load prepares the first save's staging (allocated and pinned in the
    background beside Megatron's first training step): not without ``--save`` (nothing is ever
    staged), nor where the first training step will (``train_step`` wrapped and Megatron's state
    buildable), as in a run that starts fresh: after the first step nothing of it competes with
    the step's first allocations, cuBLAS set-up and kernel loads for the driver
    (docs/MEGATRON_LM.md, thirty-third session). ``MCX_PREPARE_AT_LOAD=1`` keeps it at the load."""
    if _save_dir() is None:
        return False
    if env_switch("MCX_PREPARE_AT_LOAD") == "1" or _state.stepped or not _state.step_seam:
        return True
    return not backend.builds_sharded_state(_state.modules.get("checkpointing"))


def _iteration_of(checkpoint_dir: Any) -> int | None:
    return parse_iteration(os.path.basename(os.path.normpath(str(checkpoint_dir))))


def _save(sharded_state_dict: Any, checkpoint_dir: str, iteration: int, *,
          async_sharded_save: bool = False, content_metadata: Any = None,
          preprocess_common_before_consistancy_check: Any = None, **_ignored: Any) -> Any:
    """Megatron's ``dist_checkpointing.save(...)`` call, served by the Checkpointer.

    Megatron's strategy and validation arguments are ignored: the Checkpointer builds its own
    strategy from the options and validates its cached structure itself. Megatron's
    preprocessing of the common state goes to every comparison of the ranks' common states.
    """
    if content_metadata is not None:  # what dist_checkpointing.save would store, same key
        sharded_state_dict[backend.mcore_content_metadata_key()] = content_metadata
    checkpointer = _state.get_checkpointer()
    start = time.perf_counter()
    checkpointer.save(sharded_state_dict, os.path.dirname(checkpoint_dir), iteration=iteration,
                      preprocess_common=preprocess_common_before_consistancy_check)
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


def _warming_setup(original: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Megatron's ``setup_model_and_optimizer``, which builds the model and the optimizer and
    then loads ``--load``. On entry (the device is set and the process group is up by then),
    where the route loads, the restore is prepared in the background while the model is built
    (:func:`_prepare_restore`), unless it was prepared earlier, in ``initialize_megatron``
    (:func:`_init_persistent_async_worker`)."""
    if original is None:
        return None

    @functools.wraps(original)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        _prepare_restore("the model build")
        return original(*args, **kwargs)

    return setup_model_and_optimizer


def _prepare_restore(before: str) -> None:
    """Once per process, where ``--load`` is given and the route loads:
    :meth:`Checkpointer.prepare_restore` of it (a sealed snapshot of this node mapped, pinned
    and summed, or the storage read's chunks and layouts made, on background threads), unless
    ``MCX_PREPARE_RESTORE=0`` (``build``: only at the model build, never in Megatron's
    initialisation). ``before``: what it runs ahead of, for the debug line."""
    load = _dir_arg("load")
    if load is None or not _state.route_load or _state.restore_prepared:
        return
    _state.restore_prepared = True
    t0 = time.perf_counter()
    with _lock:
        checkpointer = _state.get_checkpointer()
        t1 = time.perf_counter()
        prepare = env_switch("MCX_PREPARE_RESTORE") != "0"
        if prepare and hasattr(checkpointer, "prepare_restore"):
            early = before == _EARLY  # the copy ahead by default only there (docs/MEMORY.md)
            checkpointer.prepare_restore(load, early=early)
    if rank() == 0:  # (a diagnostic: Megatron's own timers show what the build took)
        logger.debug("megatron-ckpt-ext: before %s: checkpointer %.3f s, restore %s %.3f s",
                     before, t1 - t0, "prepared (started) in" if prepare
                     else "not prepared (MCX_PREPARE_RESTORE=0)", time.perf_counter() - t1)


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

    _state.step_seam = True
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
    # what Megatron's save passes as preprocess_common_before_consistancy_check (found by name)
    common = getattr(_state.modules.get("training"), "preprocess_common_state_dict", None)
    with _lock:
        _state.get_checkpointer().prepare(state, preprocess_common=common)
    backend.import_first_save_modules(margs)  # (not inside the first save's stall)
    if rank() == 0:
        logger.info("megatron-ckpt-ext: staging for the first save prepared after the first "
                    "training step (state built, admitted and handed to the background in "
                    "%.3f s; allocation continues there)", time.perf_counter() - start)


def _init_persistent_async_worker(rank: int, mp_mode: str = "spawn") -> None:
    """Megatron calls this in ``initialize_megatron`` (with ``--async-save
    --use-persistent-ckpt-worker``), before the model is built. Instead of Megatron's worker we
    build the Checkpointer here: its writer process and write-results queue start now and warm up
    while the model is built, not inside the first save."""
    logger.debug("megatron-ckpt-ext: Megatron's persistent worker replaced on rank %d (%s) by the "
                 "Checkpointer's, started now", rank, mp_mode)
    with _lock:
        _state.get_checkpointer()
    if env_switch("MCX_PREPARE_RESTORE") not in ("build", "0") and _device_set_early():
        # the restore prepared now, seconds before the model build
        _prepare_restore(_EARLY)


def _device_set_early() -> bool:
    """This rank's CUDA device set now, as ``initialize_megatron`` sets it moments later
    (``torch.cuda.set_device(args.local_rank)``, ``LOCAL_RANK``), so that a restore prepared
    before it works on that device; False (nothing set) without CUDA or where ``local_rank``
    names no visible device (Megatron then fails on its own; the restore is prepared at the
    model build)."""
    local_rank = _arg("local_rank")
    if not isinstance(local_rank, int) or _dir_arg("load") is None or not _state.route_load:
        return False
    import torch

    if not torch.cuda.is_available() or not 0 <= local_rank < torch.cuda.device_count():
        return False
    torch.cuda.set_device(local_rank)
    return True
