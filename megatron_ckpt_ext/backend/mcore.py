"""megatron-core's dist_checkpointing as the checkpointer uses it: accessors that raise
:class:`BackendUnavailable` saying how to fix the environment, the shapes of save requests and
state dicts, and the writers' global write-results queues."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

from ..debug import env_switch
from ..errors import BackendMismatch, BackendUnavailable
from ._imports import MCORE_DC, MCORE_STRATEGIES, NVRX_ASYNC, _import
from .detection import Capabilities, detect
from .introspect import _name, _parameters, _takes, call_with_supported

logger = logging.getLogger("megatron_ckpt_ext.backend")


def _require_mcore() -> Capabilities:
    caps = detect()
    if not caps.mcore_dist_ckpt_importable:
        raise BackendUnavailable(
            f"megatron.core.dist_checkpointing is not usable: {caps.mcore_error}"
        )
    return caps


def _provider_attr(kind: str, name: str) -> Any:
    caps = _require_mcore()
    if caps.async_provider == "sync":
        raise BackendUnavailable(
            f"no async checkpointing backend here ({caps.nvrx_error}; megatron-core "
            f"{caps.mcore_version} has no strategies.async_utils): save synchronously, or "
            "pip install 'nvidia-resiliency-ext>=0.4'."
        )
    modules = {
        ("nvrx", "core"): f"{NVRX_ASYNC}.core", ("nvrx", "fs"): f"{NVRX_ASYNC}.filesystem_async",
        ("mcore", "core"): f"{MCORE_STRATEGIES}.async_utils",
        ("mcore", "fs"): f"{MCORE_STRATEGIES}.filesystem_async",
    }
    return getattr(_import(modules[(caps.async_provider, kind)]), name)


def dist_checkpointing() -> ModuleType:
    """``megatron.core.dist_checkpointing`` (save/load/ShardedTensor)."""
    _require_mcore()
    return _import(MCORE_DC)


def sharded_tensor_cls() -> type:
    return dist_checkpointing().ShardedTensor


def async_calls_queue_cls() -> type:
    """AsyncCallsQueue of the async provider (nvrx when usable, else megatron-core's)."""
    return _provider_attr("core", "AsyncCallsQueue")


def async_request_cls() -> type:
    """AsyncRequest of the async provider, the type :func:`async_calls_queue_cls` runs."""
    return _provider_attr("core", "AsyncRequest")


def filesystem_writer_async_cls() -> type:
    return _provider_attr("fs", "FileSystemWriterAsync")


def get_write_results_queue(*, mp_mode: str = "spawn") -> Any:
    """The provider's write-results queue; ``mp_mode`` is passed where it is accepted."""
    fs_get = _provider_attr("fs", "__dict__")
    fn = fs_get.get("get_write_results_queue") or fs_get.get("_get_write_results_queue")
    if fn is None:
        raise BackendUnavailable("the async backend has no write-results queue")
    return call_with_supported(fn, mp_mode=mp_mode)


def torch_dist_save_strategy_cls() -> type:
    _require_mcore()
    return _import(f"{MCORE_STRATEGIES}.torch").TorchDistSaveShardedStrategy


def torch_dist_load_strategy_cls() -> type:
    _require_mcore()
    return _import(f"{MCORE_STRATEGIES}.torch").TorchDistLoadShardedStrategy


def fully_parallel_save_wrapper_cls() -> type:
    _require_mcore()
    return _import(f"{MCORE_STRATEGIES}.fully_parallel").FullyParallelSaveStrategyWrapper


def fully_parallel_load_wrapper_cls() -> type:
    _require_mcore()
    return _import(f"{MCORE_STRATEGIES}.fully_parallel").FullyParallelLoadStrategyWrapper


def mcore_content_metadata_key() -> str:
    """The common-state key under which ``dist_checkpointing.save`` stores ``content_metadata``."""
    _require_mcore()
    return getattr(_import(f"{MCORE_DC}.serialization"), "_CONTENT_METADATA_KEY", "content_metadata")


def adapt_async_request(request: Any) -> Any:
    """``request`` as the provider's AsyncRequest, so the provider's queue can run it.

    megatron-core 0.16 strategies return megatron-core's own AsyncRequest; nvrx's persistent
    worker only runs requests of nvrx's class (it silently skips others and the trainer would wait
    forever). Same fields, so a conversion is exact; unknown fields raise :class:`BackendMismatch`.
    """
    target = async_request_cls()
    if isinstance(request, target):
        return request
    values = request._asdict()
    unknown = sorted(set(values) - set(target._fields))
    if unknown:
        raise BackendMismatch(
            f"cannot run a {_name(type(request))} on {_name(target)}: fields {unknown} unknown to "
            "the async backend; install matching megatron-core and nvidia-resiliency-ext versions."
        )
    return target(**values)


def without_host_preload(request: Any) -> Any:
    """``request`` without its preload function when that would only move CPU tensors to the
    CPU; the request unchanged otherwise (or where ``MCX_KEEP_PRELOAD=1``).

    megatron-core's own async writer (used with megatron-core 0.16, or 0.19 without nvrx) hands
    the queue ``partial(preload_tensors, write_buckets, True)``: copy each bucket's tensors to
    the host, then a CUDA device synchronize. After our staging every tensor is already in host
    memory, so the preload and its synchronize do nothing useful, yet the trainer joins on a
    persistent worker running them (figures: docs/notes/staging.md). nvrx 0.7's own writer
    builds its buckets in its preload: another shape, left alone. Recognised by shape (a
    ``functools.partial`` of a function named ``preload_tensors`` over a list of write
    buckets), never by version."""
    import functools

    import torch

    preload = getattr(request, "preload_fn", None)
    if preload is None or env_switch("MCX_KEEP_PRELOAD") == "1":
        return request
    if not (isinstance(preload, functools.partial)
            and getattr(preload.func, "__name__", "") == "preload_tensors"
            and preload.args and isinstance(preload.args[0], list)):
        return request
    try:
        for bucket in preload.args[0]:
            _file_name, _storage_key, (_bytes_data, tensor_data) = bucket
            for _item, tensor in tensor_data:
                if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                    return request
    except (TypeError, ValueError):  # another bucket layout: leave it to the backend
        return request
    return request._replace(preload_fn=None)


def with_data(sharded_tensor: Any, data: Any) -> Any:
    """A shallow copy of ``sharded_tensor`` holding ``data`` (same shape and dtype: a staged
    copy), without re-running its dataclass validation as ``dataclasses.replace`` does for
    every tensor of every save."""
    new = copy.copy(sharded_tensor)
    new.data = data
    return new


def validate_sharding(sharded_state_dict: Any, preprocess_common: Any = None) -> bool:
    """Collective: megatron-core's own check that the shards of ``sharded_state_dict`` cover
    every tensor exactly once (what its save runs under ``validate_access_integrity``), on a
    state it may rearrange (pass a copy), and that every rank's common state is rank 0's after
    ``preprocess_common`` (:func:`common_check_kwargs`). False where this megatron-core has no
    such step (found by its parameters); raises what megatron-core raises."""
    utils = _import(f"{MCORE_DC}.state_dict_utils")
    preprocess = getattr(utils, "save_preprocess", None)
    if preprocess is None or not _takes(preprocess, "validate_access_integrity"):
        return False
    preprocess(sharded_state_dict, validate_access_integrity=True,
               **common_check_kwargs(preprocess, preprocess_common))
    return True


_COMMON_CHECK = "preprocess_common_before_consistancy_check"  # (megatron-core's spelling)


def common_check_kwargs(fn: Any, preprocess_common: Any) -> dict[str, Any]:
    """The keyword by which ``fn`` (megatron-core's ``save`` or ``save_preprocess``) takes the
    caller's preprocessing of the common state before its ranks are compared (Megatron-LM's
    drops ``args.rank`` and ``args.local_rank``, which differ by rank): ``{}`` when there is
    none or ``fn`` has no such parameter."""
    if preprocess_common is None or not _takes(fn, _COMMON_CHECK):
        return {}
    return {_COMMON_CHECK: preprocess_common}


def map_sharded_tensors(sharded_state_dict: Any, fn: Callable[[Any], Any]) -> None:
    """Replace every ShardedTensor ``t`` in nested dicts/lists with ``fn(t)``, in place."""
    cls = sharded_tensor_cls()
    _map_in_place(sharded_state_dict, cls, fn)


class _DropOverwriteWarning(logging.Filter):
    TEXT = "Overwriting old incomplete / corrupted checkpoint"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.TEXT not in record.getMessage()


@contextlib.contextmanager
def into_fresh_directory() -> Iterator[None]:
    """While megatron-core's ``save()`` plans into a directory rank 0 has just created empty:
    its "Overwriting old incomplete / corrupted checkpoint..." warning only means another rank's
    writer of this same save got there first (planning is not a collective under a cached
    structure), so it is dropped; nothing else of that logger is touched."""
    log = logging.getLogger(f"{MCORE_DC}.serialization")
    drop = _DropOverwriteWarning()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


@contextlib.contextmanager
def version_checks_cached() -> Iterator[None]:
    """While megatron-core plans a save: its ``utils.is_torch_min_version`` answers from a
    cache. Its torch strategy calls it once per tensor in every save's planning, each call
    parsing two version strings; the answer depends only on the arguments and the installed
    torch. The module's own function is back when the block ends; absent, nothing changes."""
    utils = sys.modules.get("megatron.core.utils")
    original = getattr(utils, "is_torch_min_version", None)
    if original is None or getattr(original, "_mcx_cached", False):
        yield
        return
    cache = functools.lru_cache(maxsize=64)(original)

    @functools.wraps(original)
    def cached(version: Any, check_equality: bool = True) -> Any:
        return cache(version, check_equality)

    cached._mcx_cached = True  # type: ignore[attr-defined]
    utils.is_torch_min_version = cached
    try:
        yield
    finally:
        if utils.is_torch_min_version is cached:
            utils.is_torch_min_version = original


def load_with_tensors_from(sharded_state_dict: Any, checkpoint_dir: str, strategy: Any,
                          fill: Callable[[Any], Any], *, validate: bool = True) -> dict:
    """megatron-core's load of everything in ``sharded_state_dict`` but its ShardedTensors (the
    common state, ShardedObjects, factories), then each ShardedTensor's value from ``fill``,
    merged into the result as megatron-core merges what it loads (lists compacted alike).
    ``validate`` False: without megatron-core's sharding validation, where its load takes
    ``validate_access_integrity``."""
    dict_utils = _import(f"{MCORE_DC}.dict_utils")
    cls = sharded_tensor_cls()
    tensors, rest = dict_utils.extract_matching_values(sharded_state_dict,
                                                       lambda v: isinstance(v, cls))
    load = dist_checkpointing().load
    kwargs = ({} if validate or not _takes(load, "validate_access_integrity")
              else {"validate_access_integrity": False})
    state = load(rest, checkpoint_dir, strategy, **kwargs)
    dict_utils.dict_list_map_inplace(lambda v: fill(v) if isinstance(v, cls) else v, tensors)
    dict_utils.merge(state, tensors)
    return state


def plain_tensors(sharded_state_dict: Any) -> list[tuple[str, Any]]:
    """``(dotted key, tensor)`` for every torch tensor of ``sharded_state_dict`` that is not
    inside a megatron-core sharded item (ShardedTensor, ShardedObject, factory) nor a
    LocalNonpersistentObject. megatron-core saves such tensors as common state, from rank 0
    alone: another rank's values are dropped."""
    import torch

    mapping = _import(f"{MCORE_DC}.mapping")
    skip = (mapping.ShardedBase, mapping.LocalNonpersistentObject)
    found: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, skip):
            return
        if isinstance(node, torch.Tensor):
            found.append((path, node))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(sharded_state_dict, "")
    return found


def common_state_present(checkpoint_dir: str | Path, *, keep: dict | None = None) -> bool | None:
    """Whether a megatron-core checkpoint holds its common (rank 0, non-sharded) state: the
    ``common.pt`` of megatron-core <= 0.16, or the ``common_state`` object that 0.19 keeps inside
    the torch_dist files (named in their ``.metadata``). Without it megatron-core's load fails
    with an AttributeError that names neither. None when the ``.metadata`` cannot be read
    (missing, or damaged: unpickling damaged bytes raises anything), which the load's
    verification then names. ``keep``: where the ``.metadata`` was unpickled here, it is kept
    there under ``str(checkpoint_dir)``, for the load to use instead of reading it again."""
    path = Path(checkpoint_dir)
    if (path / "common.pt").exists():
        return True
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        keys = metadata.state_dict_metadata
    except FileNotFoundError:
        return False
    except Exception:  # noqa: BLE001 - damaged bytes: the integrity check says which file
        return None
    if keep is not None:
        keep[str(checkpoint_dir)] = metadata
    return any(str(k).split("/", 1)[0] == "common_state" for k in keys)


def _map_in_place(node: Any, cls: type, fn: Callable[[Any], Any]) -> None:
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return
    for key, value in items:
        if isinstance(value, cls):
            node[key] = fn(value)
        else:
            _map_in_place(value, cls, fn)


def _forking_multiproc_writer(async_fn: Any) -> type | None:
    """The writer class when ``async_fn`` is a megatron-core 0.16-style
    ``partial(FileSystemWriterAsync.write_preloaded_data_multiproc, transform_list, use_msc)``,
    which forks one writer process per bucket even at ``thread_count=1``; else None.

    Newer writers (megatron-core >= 0.17 / nvrx >= 0.5) take an ``open_file`` argument and write
    the last bucket inline themselves: they are left alone.
    """
    func = getattr(async_fn, "func", None)
    if getattr(func, "__name__", "") != "write_preloaded_data_multiproc":
        return None
    owner: Any = sys.modules.get(getattr(func, "__module__", ""))
    for part in func.__qualname__.split(".")[:-1]:
        owner = getattr(owner, part, None)
    writer = getattr(owner, "write_preloaded_data", None)
    if owner is None or writer is None or len(getattr(async_fn, "args", ())) != 2:
        return None
    params = list(_parameters(writer))
    if params[:6] != ["transform_list", "local_proc_idx", "write_bucket", "results_queue",
                      "count_queue", "use_fsync"]:
        return None
    return owner


def sequential_writer(async_fn: Any) -> tuple[type, tuple] | None:
    """(writer class, partial args) when the request's writer would fork per bucket, so the
    caller can run the buckets inline instead (Megatron-LM PR #3424); None when the installed
    writer already writes inline or is of an unknown shape (then it is used as it is)."""
    owner = _forking_multiproc_writer(async_fn)
    return None if owner is None else (owner, tuple(async_fn.args))


def shutdown_write_results_queues() -> None:
    """Drop the backends' global write-results queues: a Manager server a backend started
    itself is stopped (so ``close()`` leaves no child behind), a
    :class:`~megatron_ckpt_ext.spool.SpoolQueue`'s directory removed, so no stale result is read
    by a later save. The next save (or :func:`prime_write_results_queue`) puts new ones in place."""
    from ..spool import SpoolQueue

    for name in (f"{NVRX_ASYNC}.filesystem_async", f"{MCORE_STRATEGIES}.filesystem_async"):
        module = sys.modules.get(name)
        queue = getattr(module, "_results_queue", None) if module is not None else None
        if isinstance(queue, SpoolQueue):
            queue.close()  # its directory, with any stale result still in it
        manager = getattr(queue, "_manager", None)
        if manager is not None:
            try:
                manager.shutdown()
            except Exception as e:  # noqa: BLE001 - best effort at teardown
                logger.debug("write-results queue manager shutdown: %s", e)
        if queue is not None:
            module._results_queue = None


def prime_write_results_queue() -> bool:
    """Put the backends' global write-results queues in place now (start-up), not inside the
    first save.

    Left to the writer, each queue is a multiprocessing Manager server started in the first save
    with ``spawn``, whose child re-imports the training script's ``__main__``. We set every writer
    module's global queue (megatron-core's ``filesystem_async`` and, where installed, nvrx's) to
    a :class:`~megatron_ckpt_ext.spool.SpoolQueue`: no server process, so none holding the
    trainer's pages copy-on-write (docs/notes/benchmarks.md, "How we got here"). Returns whether
    megatron-core's queue is in place; False (left lazy) on an unknown shape."""
    from ..spool import SpoolQueue

    primed = {}
    for name in (f"{MCORE_STRATEGIES}.filesystem_async", f"{NVRX_ASYNC}.filesystem_async"):
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - optional speed-up; the save path reports errors
            logger.debug("write-results queue of %s not primed: %s", name, e)
            primed[name] = False
            continue
        primed[name] = _prime_module_queue(module, SpoolQueue)
    return primed[f"{MCORE_STRATEGIES}.filesystem_async"]


def _prime_module_queue(module: Any, new_queue: Callable[[], Any]) -> bool:
    """Set ``module``'s global results queue to ``new_queue()`` where its lazy getter would
    create one, when the module keeps it in ``_results_queue``; else call a getter that takes
    ``mp_mode`` with ``"fork"``."""
    getter = getattr(module, "get_write_results_queue", None)
    takes_mode = getter is not None and _takes(getter, "mp_mode")
    if hasattr(module, "_results_queue") and (takes_mode
                                              or hasattr(module, "_get_write_results_queue")):
        if module._results_queue is None:
            module._results_queue = new_queue()
        return True
    if takes_mode:
        getter(mp_mode="fork")
        return True
    return False


def checkpoint_failure_text(e: BaseException) -> str:
    """One line for a failed write: torch's CheckpointException names each failing rank's own
    exception (``failures``), which its ``str`` leaves out."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        # torch wraps each as (exception, traceback frames) (WRAPPED_EXCEPTION)
        failures = {rank: exc[0] if isinstance(exc, tuple) and exc and
                    isinstance(exc[0], BaseException) else exc for rank, exc in failures.items()}
        parts = [f"rank {rank}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
                 if str(exc).strip() else f"rank {rank}: {type(exc).__name__}"
                 for rank, exc in sorted(failures.items())]
        return f"{type(e).__name__} ({'; '.join(parts)})"
    return f"{type(e).__name__}: {str(e).strip()[:500]}"
