"""The provider's async calls queue: built with every value that matters passed explicitly, its
writers inspected, stopped and unblocked, and the start-up tricks that keep the persistent
writer's first save fast (fork instead of spawn, no re-import of ``__main__``, no second clone)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import queue as queue_mod
import signal
import sys
import threading
from typing import Any, Callable, Iterator

from .._runtime import ignore_job_signals, rank
from ..debug import env_switch
from ..errors import BackendUnavailable
from ._imports import MCORE_DC, MCORE_STRATEGIES, NVRX_ASYNC
from .introspect import _source_has, call_with_supported
from .mcore import async_calls_queue_cls, filesystem_writer_async_cls

logger = logging.getLogger("megatron_ckpt_ext.backend")


def new_async_calls_queue(
    *,
    persistent: bool,
    is_daemon: bool = True,
    cpu_shm_mode: bool = False,
    cpu_priority: int | None = None,
    io_priority: int | None = None,
) -> Any:
    """A provider AsyncCallsQueue with the values that matter passed explicitly.

    ``persistent`` and ``is_daemon`` are always passed (their defaults flipped between releases);
    the others only when asked for. What the backend does not accept is dropped: callers check
    :func:`detect` (and warn) before asking.
    """
    if not persistent:
        _quiet_temporal_deprecation()
    kwargs: dict[str, Any] = {"persistent": persistent, "is_daemon": is_daemon}
    if cpu_shm_mode:
        kwargs["cpu_shm_mode"] = True
    if cpu_priority is not None:
        kwargs["cpu_priority"] = cpu_priority
    if io_priority is not None:
        kwargs["io_priority"] = io_priority
    return call_with_supported(async_calls_queue_cls(), **kwargs)


class _FirstOnRankZero(logging.Filter):
    """nvrx's queue logs "The TemporalAsyncCaller will be deprecated soon." at WARNING for every
    temporal save, on every rank: the first one passes on rank 0, the repeats and the other
    ranks' are dropped. Nothing else of that logger is touched."""

    TEXT = "TemporalAsyncCaller will be deprecated"

    def __init__(self) -> None:
        super().__init__()
        self.passed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.TEXT not in record.getMessage():
            return True
        if self.passed or rank() != 0:
            return False
        self.passed = True
        return True


_NVRX_QUEUE_LOGGER = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"


def _quiet_temporal_deprecation() -> None:
    nvrx_logger = logging.getLogger(_NVRX_QUEUE_LOGGER)
    if not any(isinstance(f, _FirstOnRankZero) for f in nvrx_logger.filters):
        nvrx_logger.addFilter(_FirstOnRankZero())


@contextlib.contextmanager
def persistent_worker_forks(queue: Any, *, cpu_shm_mode: bool) -> Any:
    """Within this block, nvrx's persistent writer is started with ``fork`` instead of ``spawn``
    where that is safe: the worker will not use CUDA (nvrx's ``cpu_shm_mode``) or CUDA is not
    initialised in this process. Returns whether it applied (``yield``-ed value).

    A spawned worker imports torch, nvrx and megatron-core before it takes a request, inside a
    trainer's first save; a forked one has them already (docs/notes/benchmarks.md, "How we got
    here"). Cost: the worker shares the trainer's pages copy-on-write."""

    import torch

    module = sys.modules.get(type(queue).__module__)  # the module whose mp starts the worker
    mp = getattr(module, "mp", None)
    safe = cpu_shm_mode or not (torch.cuda.is_available() and torch.cuda.is_initialized())
    if mp is None or not hasattr(mp, "get_context") or not safe:
        _start_resource_tracker()
        yield False
        return

    class _ForkInsteadOfSpawn:
        def __getattr__(self, name: str) -> Any:
            return getattr(mp, name)

        @staticmethod
        def get_context(method: str | None = None) -> Any:
            return mp.get_context("fork" if method == "spawn" else method)

    module.mp = _ForkInsteadOfSpawn()
    try:
        yield True
    finally:
        module.mp = mp


def _start_resource_tracker() -> None:
    """Before a worker is spawned: start multiprocessing's resource tracker, whose start-up
    (inside the spawn otherwise) unblocks SIGTERM and SIGINT on this thread, so the worker would
    start without the job's signals blocked (``forks_die_with_this_process``) and die of them."""
    from multiprocessing import resource_tracker

    with contextlib.suppress(Exception):  # noqa: BLE001 - the signals' block is best effort
        resource_tracker.ensure_running()


@contextlib.contextmanager
def spawn_skips_main() -> Any:
    """Within this block, processes started with the ``spawn`` method do not re-import the
    training script (``__main__``).

    A spawned child normally imports the parent's ``__main__`` module by path before it runs; for
    a Megatron-LM ``pretrain_gpt.py`` that is all of megatron.training (seconds), paid by the
    persistent writer at start-up, before it can take the first save. The writer needs nothing
    from ``__main__`` (requests carry functions of megatron-core, nvrx and this package, and
    pickled bytes), so while it is started ``sys.modules["__main__"]`` is a bare module without
    ``__file__``/``__spec__``: multiprocessing then has no main to re-import. Set
    ``MCX_SPAWN_IMPORTS_MAIN=1`` to keep the default behaviour."""
    import types

    if env_switch("MCX_SPAWN_IMPORTS_MAIN") == "1":
        yield
        return
    main = sys.modules.get("__main__")
    bare = types.ModuleType("__main__")
    bare.__spec__ = None
    sys.modules["__main__"] = bare
    try:
        yield
    finally:
        sys.modules["__main__"] = main


_CLONES_CPU: dict[str, bool] = {}


def writer_clones_cpu_tensors(writer_cls: type | None = None) -> bool:
    """Whether the async writer's ``prepare_write_data`` clones every CPU tensor it is given
    (nvrx >= 0.7's FileSystemWriterAsync does, so a persistent worker never reads live training
    tensors; megatron-core's own writer clones only views). Read from the source, cached."""
    if writer_cls is None:
        try:
            writer_cls = filesystem_writer_async_cls()
        except BackendUnavailable:
            return False
    key = f"{writer_cls.__module__}.{writer_cls.__qualname__}"
    if key not in _CLONES_CPU:
        fn = getattr(writer_cls, "prepare_write_data", None)
        _CLONES_CPU[key] = (_source_has(fn, "ten.clone()", default=False)
                            and _source_has(fn, 'device.type == "cpu"', default=False))
    return _CLONES_CPU[key]


@contextlib.contextmanager
def writer_keeps_snapshots(is_snapshot: Callable[[Any], bool]) -> Any:
    """Within this block, ``Tensor.clone()`` with no arguments returns the tensor itself for
    tensors ``is_snapshot`` accepts (this save's staged copies), and clones everything else.

    nvrx 0.7's writer clones every CPU tensor of a save request (``_clone_or_dequantize_if_
    needed``) to snapshot live training tensors. Ours are already snapshots owned by the save
    until its commit, so that clone is a second full copy on the critical path, copied once more
    to reach the persistent worker (docs/notes/benchmarks.md, "How we got here"). Used only
    around the request's planning, only where :func:`writer_clones_cpu_tensors`;
    ``MCX_KEEP_WRITER_CLONES=1`` keeps the clones."""

    import torch

    if env_switch("MCX_KEEP_WRITER_CLONES") == "1" or not writer_clones_cpu_tensors():
        yield False
        return
    original = torch.Tensor.clone

    def clone(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and is_snapshot(self):
            return self
        return original(self, *args, **kwargs)

    torch.Tensor.clone = clone
    try:
        yield True
    finally:
        torch.Tensor.clone = original


def warm_up_writer_imports() -> None:
    """Import, in a writer process, the modules a save request's functions live in (run by the
    persistent worker's warm-up request, so the first save does not wait for these imports).
    A spawned worker ran no after-fork hook: it ignores the job's termination signals here (they
    were blocked from its first instant: ``forks_die_with_this_process``)."""
    ignore_job_signals()
    for name in (f"{MCORE_STRATEGIES}.filesystem_async", f"{MCORE_STRATEGIES}.torch",
                 f"{NVRX_ASYNC}.filesystem_async", "megatron_ckpt_ext.strategy"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a missing optional module is not an error here
            logger.debug("writer warm-up: %s not imported: %s", name, e)


# The queue of nvrx 0.4-0.7 and megatron-core's own share these shapes: ``async_calls`` (a deque
# of (idx, caller, request)), a temporal caller's forked ``process`` per save, a persistent
# caller's long-lived ``process`` with ``comp_q`` (finished call indices, read into ``cur_item``)
# and ``preload_q`` (the hand-over the trainer joins). Anything else reads as "running", so an
# unknown shape degrades to the timeout, never to a false error.
def persistent_caller(queue: Any) -> Any:
    return getattr(queue, "persistent_caller", None) if getattr(queue, "persistent", False) else None


def async_writer_state(queue: Any) -> tuple[str, str]:
    """This rank's writer for the oldest pending call: ("done" | "running" | "dead", detail)."""
    calls = getattr(queue, "async_calls", None)
    if not calls:
        caller = persistent_caller(queue)  # idle: is the persistent worker still there?
        return ("dead", _writer_exit_text(caller.process)) if _writer_died(caller) else ("done", "")
    caller = calls[0].async_caller
    process = getattr(caller, "process", None)
    if hasattr(caller, "comp_q"):  # persistent: done once it reported the call
        if caller.cur_item is None:
            with contextlib.suppress(queue_mod.Empty):
                caller.cur_item = caller.comp_q.get_nowait()
        if caller.cur_item is not None or process is None:
            return "done", ""
        alive = process.is_alive() and not _exited(process.pid)
        return ("running", "") if alive else ("dead", _writer_exit_text(process))
    if process is None or process.is_alive():
        return ("done", "") if process is None else ("running", "")
    return ("done", "") if process.exitcode == 0 else ("dead", _writer_exit_text(process))


def forked_writer(queue: Any, pid: int) -> tuple[Any, Any, bool] | None:
    """(caller, process, persistent) of this queue's writer process ``pid``; None when it is
    not one of them."""
    callers = [call.async_caller for call in getattr(queue, "async_calls", ())]
    for caller in filter(None, [*callers, persistent_caller(queue)]):
        process = getattr(caller, "process", None)
        if process is not None and process.pid == pid:
            return caller, process, hasattr(caller, "comp_q")
    return None


def newest_writer_pid(queue: Any) -> int | None:
    """The pid of the writer process of the newest pending call (a temporal caller's), else of
    the persistent worker; None when there is none."""
    calls = getattr(queue, "async_calls", None)
    caller = calls[-1].async_caller if calls else persistent_caller(queue)
    process = getattr(caller, "process", None)
    return None if process is None else process.pid


@contextlib.contextmanager
def remember_process_calls() -> Iterator[None]:
    """Processes started inside this block keep their target and arguments as ``_mcx_call``
    (``multiprocessing`` drops them at ``start()``), so :func:`refork_temporal_writer` can start
    the same call again; they are the provider's, after its preload."""
    import multiprocessing.process as mp_process

    original = mp_process.BaseProcess.start

    def start(self: Any) -> None:
        self._mcx_call = (self._target, self._args, self._kwargs)
        original(self)

    mp_process.BaseProcess.start = start
    try:
        yield
    finally:
        mp_process.BaseProcess.start = original


def refork_temporal_writer(caller: Any) -> Any:
    """Kill a temporal caller's forked writer and fork it again with the same target and
    arguments (kept by :func:`remember_process_calls`); the new process. Only for a writer that
    never ran a line (see ``ForkStarts``): the request's staged buffers are still the
    trainer's. None when the call was not remembered (the writer is then left as it is)."""
    old = caller.process
    call = getattr(old, "_mcx_call", None)
    if call is None:
        return None
    old.kill()
    old.join(timeout=10)
    target, args, kwargs = call
    new = type(old)(target=target, args=args, kwargs=kwargs, daemon=old.daemon)
    with remember_process_calls():
        new.start()
    caller.process = new
    return new


def _writer_died(caller: Any) -> bool:
    process = getattr(caller, "process", None)
    return process is not None and (not process.is_alive() or _exited(process.pid))


def _exited(pid: int | None) -> bool:
    """Whether ``pid`` has exited (a zombie, or gone), read from /proc: multiprocessing's own
    ``is_alive()`` says True for a child whose exit was reaped by another handle (its waitpid
    then fails), which left a SIGKILLed persistent worker taken for alive at the next save."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return os.path.isdir("/proc/self")  # no /proc entry: gone (where /proc exists at all)
    return state in (b"Z", b"X")


def _writer_exit_text(process: Any) -> str:
    code = process.exitcode
    if code is None:  # seen exited in /proc before multiprocessing collected its status
        with contextlib.suppress(Exception):
            process.join(timeout=1.0)
        code = process.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"writer pid {process.pid} was killed by {signal.Signals(-code).name}"
    return f"writer pid {process.pid} exited with code {code}; its traceback is in that rank's log"


def stop_async_writers(queue: Any) -> None:
    """Kill this queue's writer processes and forget its calls, so nothing waits on them (the
    queue's own close would join a dead worker's queue forever)."""
    callers = [call.async_caller for call in getattr(queue, "async_calls", ())]
    callers.append(persistent_caller(queue))
    for caller in filter(None, callers):
        process = getattr(caller, "process", None)
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
            caller.process = None
        for name in ("queue", "preload_q", "comp_q"):  # no exit-time flush into a dead pipe
            with contextlib.suppress(Exception):
                getattr(caller, name).cancel_join_thread()
    with contextlib.suppress(AttributeError):
        queue.async_calls.clear()


@contextlib.contextmanager
def unblock_hand_over_if_worker_dies(queue: Any, *, poll_s: float = 0.05,
                                     give_up: Callable[[], bool] | None = None) -> Any:
    """While a request is handed to the persistent worker, the trainer joins the worker's
    preload queue; if the worker dies meanwhile, release that join (the next maybe_finalize then
    reports the dead worker on every rank) instead of waiting forever. ``give_up()`` True (a
    worker that never started): kill the worker, which releases the join the same way."""
    caller = persistent_caller(queue)
    if caller is None or not hasattr(caller, "preload_q"):
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            if stop.is_set():  # the hand-over ended while this iteration woke: nothing to do
                return
            if give_up is not None and not _writer_died(caller) and give_up():
                with contextlib.suppress(AttributeError, OSError):
                    caller.process.kill()
            if _writer_died(caller):
                with contextlib.suppress(ValueError):  # the worker had already released it
                    caller.preload_q.task_done()
                return

    watcher = threading.Thread(target=watch, name="mcx-preload-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        # not joined: the watcher ends at its next wake-up, and acts only while stop is unset;
        # joining it made the trainer wait for that thread to be scheduled on every save
        stop.set()


# What one rank writes alone between megatron-core's collectives: in a save's planning, rank 0's
# common state and each rank's sharded objects; in its finalization, rank 0's global metadata (the
# storage writer's ``finish``, before a broadcast) and ``metadata.json`` (``save_config``, before
# a barrier).
_LONE_WRITES = ((f"{MCORE_STRATEGIES}.common", "TorchCommonSaveStrategy", "save_common"),
                (f"{MCORE_STRATEGIES}.common", "TorchCommonSaveStrategy", "save_sharded_objects"),
                (f"{MCORE_STRATEGIES}.filesystem_async", "FileSystemWriterAsync", "finish"),
                (f"{NVRX_ASYNC}.filesystem_async", "FileSystemWriterAsync", "finish"),
                (f"{MCORE_DC}.serialization", None, "save_config"))


@contextlib.contextmanager
def lone_writes_deferred(errors: list[BaseException]) -> Iterator[None]:
    """Within this block, the writes one rank makes alone inside megatron-core's save and
    finalization do not raise: their error is appended to ``errors`` and megatron-core goes on to
    its next collective. Raised there, the error would leave the other ranks waiting in that
    collective (a full disk under rank 0); the caller agrees over ranks on ``errors`` afterwards
    and fails every rank."""
    patched = []
    for module_name, cls_name, name in _LONE_WRITES:
        module = sys.modules.get(module_name)  # not imported: not what this save runs
        owner = getattr(module, cls_name, None) if cls_name else module
        original = vars(owner).get(name) if owner is not None else None
        if callable(original):
            setattr(owner, name, _deferring(original, errors))
            patched.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def _deferring(fn: Callable[..., Any], errors: list[BaseException]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any of them: the caller raises it on every rank
            errors.append(e)
            return None
    return call
