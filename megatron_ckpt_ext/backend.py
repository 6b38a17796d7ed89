"""The compatibility layer: what the installed megatron-core / nvidia-resiliency-ext can do.

This is the only module of the package that imports nvidia-resiliency-ext (nvrx) or megatron-core
(mcore) internals, and the only one that calls ``inspect.signature``. Everything else asks it:

* :func:`detect` returns a frozen :class:`Capabilities`, computed once, lazily, cached; it never
  raises. Answers come from the signatures of the real callables, not from version strings
  (versions are recorded for messages only).
* :func:`accepted_kwargs` / :func:`call_with_supported` call a backend callable with only the
  keyword arguments it accepts. Callers pass every value that matters explicitly: nvrx flipped the
  defaults of ``persistent``, ``is_daemon`` and ``is_multiproc_io`` between releases.
* Accessors (:func:`async_calls_queue_cls`, ...) return the backend classes, or raise
  :class:`BackendUnavailable` saying how to fix the environment.

Fallback policy, one line per feature (a warning only where the user asked for the feature):

* async save (``--async-save``): nvrx queue; nvrx unusable -> mcore's built-in async path
  (warning); neither -> synchronous save (warning).
* persistent worker (``--use-persistent-ckpt-worker``): absent -> fresh worker per save (warning);
  never started where it would die at start-up (see :func:`persistent_worker_runs_here`).
* CPU shared-memory staging (``--async-ckpt-use-cpu-shm``): always ours (staging.py); nvrx
  ``cpu_shm_mode`` absent -> the worker still initialises CUDA (warning on CUDA hosts).
* worker priorities (``--async-ckpt-cpu-priority/--async-ckpt-io-priority``): absent -> ignored
  (warning).
* cached metadata (``--ckpt-assume-constant-structure``): absent in the strategy -> plan and
  metadata re-computed every save, staging buffers still reused (warning).
* strategy ``thread_count`` / writer ``is_multiproc_io`` / ``use_msc`` / ``mp_mode``: absent ->
  the backend's fixed behaviour (no warning: not user flags).
* Megatron-FSDP symmetric memory (``--fsdp-use-symm-mem``): absent -> plain buffers (warning).
* megatron-core 0.19 with nvrx < 0.6: ``megatron.core.dist_checkpointing`` cannot be imported at
  all; detection records why and names the two fixes, checkpointing fails at start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import platform
import queue as queue_mod
import re
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

from .debug import env_switch
from .errors import BackendMismatch, BackendUnavailable

__all__ = [
    "Capabilities",
    "MegatronSeams",
    "accepted_kwargs",
    "adapt_async_request",
    "async_calls_queue_cls",
    "async_request_cls",
    "call_with_supported",
    "detect",
    "dist_checkpointing",
    "dist_sync_runs_here",
    "filesystem_writer_async_cls",
    "fully_parallel_load_wrapper_cls",
    "fully_parallel_save_wrapper_cls",
    "get_write_results_queue",
    "map_sharded_tensors",
    "mcore_content_metadata_key",
    "megatron_training_module",
    "megatron_training_seams",
    "new_async_calls_queue",
    "persistent_worker_forks",
    "writer_clones_cpu_tensors",
    "writer_keeps_snapshots",
    "without_host_preload",
    "persistent_worker_runs_here",
    "sharded_tensor_cls",
    "torch_dist_load_strategy_cls",
    "torch_dist_save_strategy_cls",
]

logger = logging.getLogger(__name__)

NVRX = "nvidia_resiliency_ext"
NVRX_DIST = "nvidia-resiliency-ext"
MCORE_DIST = "megatron-core"
NVRX_ASYNC = f"{NVRX}.checkpointing.async_ckpt"
MCORE_DC = "megatron.core.dist_checkpointing"
MCORE_STRATEGIES = f"{MCORE_DC}.strategies"
# The nvrx release from which megatron-core 0.19 accepts nvrx at import time.
MCORE_019_NVRX_MIN = "0.6.0"


@dataclass(frozen=True)
class Capabilities:
    python_version: str
    torch_version: str
    cuda_available: bool
    mcore_version: str | None
    nvrx_version: str | None
    nvrx_importable: bool
    nvrx_error: str | None
    mcore_dist_ckpt_importable: bool
    mcore_error: str | None
    queue_persistent: bool
    queue_cpu_shm_mode: bool
    queue_priorities: bool
    warmup_persistent_caller: bool
    warmup_cpu_shm_mode: bool
    writer_use_cpu_shm: bool
    writer_cached_structure: bool
    writer_multiproc_io: bool
    writer_use_msc: bool
    write_results_queue_mp_mode: bool
    strategy_thread_count: bool
    strategy_cached_metadata: bool
    strategy_cpu_shm_mode: bool
    mcore_async_utils: bool
    megatron_training: bool
    fsdp_symm_mem: bool
    async_provider: str  # "nvrx" | "mcore" | "sync"
    # Who defines the AsyncRequest that mcore's save strategy returns ("nvrx" | "mcore" | None);
    # when it differs from async_provider, adapt_async_request converts it.
    strategy_request_provider: str | None = None
    # The provider's persistent worker calls torch.cuda.set_device at start (dies without CUDA) ...
    worker_needs_cuda: bool = True
    # ... unless started with cpu_shm_mode=True (nvrx >= 0.7).
    worker_cpu_shm_skips_cuda: bool = False
    # The queue's cross-rank agreement (no_dist=False) allocates on torch.cuda.current_device().
    queue_sync_needs_cuda: bool = True


# -- keyword filtering ---------------------------------------------------------------------------
_POPPED_KWARG = re.compile(r"kwargs\s*\.\s*(?:pop|get)\(\s*['\"](\w+)['\"]")
_FORWARDS_TO_SUPER = re.compile(r"super\(\s*(?:\w+\s*,\s*\w+)?\s*\)\s*\.__init__\([^)]*\*\*kwargs", re.S)


def _owner_and_init(fn: Callable[..., Any]) -> tuple[type | None, Callable[..., Any]]:
    """(class, its __init__) for a class or a class's ``__init__``; (None, fn) otherwise.

    A class is probed through ``__init__``: ``inspect.signature`` of a class whose metaclass
    defines ``__call__(cls, *args, **kwargs)`` (nvrx 0.7 AsyncCallsQueue) shows only that.
    """
    if isinstance(fn, type):
        for klass in fn.__mro__:
            if "__init__" in vars(klass):
                return klass, vars(klass)["__init__"]
        return None, fn
    parts = getattr(fn, "__qualname__", "").split(".")
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if len(parts) >= 2 and parts[-1] == "__init__" and module is not None:
        owner: Any = module
        for part in parts[:-1]:
            owner = getattr(owner, part, None)
        if isinstance(owner, type) and vars(owner).get("__init__") is fn:
            return owner, fn
    return None, fn


def _parent_init_owner(owner: type) -> type | None:
    for klass in owner.__mro__[1:]:
        if "__init__" in vars(klass) and klass is not object:
            return klass
    return None


@functools.lru_cache(maxsize=256)
def _accepted_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    """Keyword names ``fn`` accepts; None when it truly accepts any keyword.

    A ``**kwargs`` callee accepts anything only when it does not forward them: an ``__init__``
    that passes ``**kwargs`` to ``super().__init__`` accepts its own names, the names it pops from
    ``kwargs``, and what the parent's ``__init__`` accepts (nvrx 0.4 FileSystemWriterAsync).
    """
    owner, target = _owner_and_init(fn)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return named - {"self"}
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        return None
    parent = _parent_init_owner(owner) if owner is not None else None
    if parent is None or not _FORWARDS_TO_SUPER.search(source):
        return None
    inherited = _accepted_names(parent)
    if inherited is None:
        return None
    return (named | frozenset(_POPPED_KWARG.findall(source)) | inherited) - {"self"}


def accepted_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[dict, dict]:
    """Split ``kwargs`` into (accepted by ``fn``, dropped)."""
    names = _accepted_names(fn)
    if names is None:
        return dict(kwargs), {}
    accepted = {k: v for k, v in kwargs.items() if k in names}
    dropped = {k: v for k, v in kwargs.items() if k not in names}
    return accepted, dropped


def call_with_supported(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **accepted)``; keywords ``fn`` does not take are dropped (debug log).

    Pass every value that matters explicitly: backend defaults changed between releases.
    """
    accepted, dropped = accepted_kwargs(fn, kwargs)
    if dropped:
        logger.debug("%s does not accept %s; dropped", _name(fn), sorted(dropped))
    return fn(*args, **accepted)


def _takes(fn: Any, name: str) -> bool:
    if fn is None:
        return False
    names = _accepted_names(fn)
    return names is None or name in names


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# -- versions (for messages only) ----------------------------------------------------------------
def _dist_version_near(module_dir: Path, dist: str) -> str | None:
    """The version of ``dist`` installed next to ``module_dir`` (the copy actually imported)."""
    prefix = dist.replace("-", "_").lower() + "-"
    for info in sorted(module_dir.parent.glob("*.dist-info")):
        if info.name.lower().startswith(prefix):
            return info.name[len(prefix):-len(".dist-info")]
    return None


def _installed_version(top: str, dist: str) -> str | None:
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or []:
        version = _dist_version_near(Path(location), dist)
        if version:
            return version
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _version_tuple(version: str | None) -> tuple[int, ...]:
    parts = re.findall(r"\d+", version or "")[:3]
    return tuple(int(p) for p in parts)


# -- imports that never raise --------------------------------------------------------------------
def _try_import(name: str) -> tuple[ModuleType | None, str | None]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name), None
    except BaseException as e:  # noqa: BLE001 - an old backend may raise anything at import
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return None, f"{type(e).__name__}: {e}".strip()


def _attr(module: ModuleType | None, *names: str) -> Any:
    for name in names:
        value = getattr(module, name, None) if module is not None else None
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class _Modules:
    nvrx_core: ModuleType | None
    nvrx_fs: ModuleType | None
    nvrx_error: str | None
    mcore_dc: ModuleType | None
    mcore_error: str | None
    mcore_async: ModuleType | None
    mcore_fs: ModuleType | None
    mcore_torch: ModuleType | None


def _load_modules(nvrx_version: str | None, mcore_version: str | None) -> _Modules:
    nvrx_core, err_core = _try_import(f"{NVRX_ASYNC}.core")
    nvrx_fs, err_fs = (_try_import(f"{NVRX_ASYNC}.filesystem_async") if nvrx_core else (None, None))
    nvrx_error = err_core or err_fs
    if nvrx_version is None:
        nvrx_error = f"{NVRX_DIST} is not installed"
    mcore_dc, mcore_error = _try_import(MCORE_DC)
    if mcore_error:
        mcore_error = _explain_mcore_error(mcore_error, mcore_version, nvrx_version)
    mcore_async = _try_import(f"{MCORE_STRATEGIES}.async_utils")[0] if mcore_dc else None
    mcore_fs = _try_import(f"{MCORE_STRATEGIES}.filesystem_async")[0] if mcore_dc else None
    mcore_torch = _try_import(f"{MCORE_STRATEGIES}.torch")[0] if mcore_dc else None
    return _Modules(nvrx_core if not nvrx_error else None, nvrx_fs if not nvrx_error else None,
                    nvrx_error, mcore_dc, mcore_error, mcore_async, mcore_fs, mcore_torch)


def _explain_mcore_error(error: str, mcore_version: str | None, nvrx_version: str | None) -> str:
    if mcore_version is None:
        return f"{MCORE_DIST} is not installed ({error}); pip install 'megatron-core>=0.13,<0.20'."
    old_nvrx = nvrx_version is not None and _version_tuple(nvrx_version) < _version_tuple(MCORE_019_NVRX_MIN)
    if old_nvrx and ("__version__" in error or "nvidia-resiliency-ext" in error
                     or error.startswith("AssertionError")):
        return (
            f"megatron-core {mcore_version} with nvidia-resiliency-ext {nvrx_version}: importing "
            f"{MCORE_DC} fails ({error}) because megatron-core checks for nvidia-resiliency-ext >= "
            f"{MCORE_019_NVRX_MIN} at import time. Fix one of two ways: upgrade it "
            f"(pip install 'nvidia-resiliency-ext>={MCORE_019_NVRX_MIN}'), or uninstall it "
            f"(pip uninstall nvidia-resiliency-ext) so megatron-core uses its built-in async path."
        )
    return f"importing {MCORE_DC} from megatron-core {mcore_version} fails: {error}"


# -- probes --------------------------------------------------------------------------------------
def _async_provider(m: _Modules) -> str:
    if m.mcore_dc is None:
        return "sync"  # nothing saves without megatron.core.dist_checkpointing
    nvrx_parts = (_attr(m.nvrx_core, "AsyncCallsQueue"), _attr(m.nvrx_core, "AsyncRequest"),
                  _attr(m.nvrx_fs, "FileSystemWriterAsync"))
    if all(p is not None for p in nvrx_parts):
        return "nvrx"
    if _attr(m.mcore_async, "AsyncCallsQueue") is not None:
        return "mcore"
    return "sync"


def _provider_modules(m: _Modules, provider: str) -> tuple[ModuleType | None, ModuleType | None]:
    if provider == "nvrx":
        return m.nvrx_core, m.nvrx_fs
    if provider == "mcore":
        return m.mcore_async, m.mcore_fs
    return None, None


def _request_provider(m: _Modules) -> str | None:
    request = _attr(m.mcore_torch, "AsyncRequest")
    if request is None:
        return None
    return "nvrx" if request.__module__.startswith(NVRX) else "mcore"


def _source_has(obj: Any, needle: str, *, default: bool) -> bool:
    if obj is None:
        return default
    try:
        return needle in inspect.getsource(obj)
    except (OSError, TypeError):
        return default


def _worker_probes(core: ModuleType | None) -> dict[str, bool]:
    worker = _attr(core, "PersistentAsyncCaller")  # whole class: async_loop may delegate
    sync = _attr(_attr(core, "AsyncCaller"), "sync_all_async_calls")
    return {
        "worker_needs_cuda": _source_has(worker, "set_device", default=True),
        "worker_cpu_shm_skips_cuda": _source_has(worker, "if not cpu_shm_mode", default=False),
        "queue_sync_needs_cuda": _source_has(sync, "cuda", default=True),
    }


def _queue_probes(core: ModuleType | None) -> dict[str, bool]:
    queue = _attr(core, "AsyncCallsQueue")
    warmup = _attr(queue, "warmup_persistent_caller")
    return {
        "queue_persistent": _takes(queue, "persistent"),
        "queue_cpu_shm_mode": _takes(queue, "cpu_shm_mode"),
        "queue_priorities": _takes(queue, "cpu_priority") and _takes(queue, "io_priority"),
        "warmup_persistent_caller": warmup is not None,
        "warmup_cpu_shm_mode": _takes(warmup, "cpu_shm_mode"),
    }


def _writer_probes(fs: ModuleType | None) -> dict[str, bool]:
    writer = _attr(fs, "FileSystemWriterAsync")
    results_queue = _attr(fs, "get_write_results_queue", "_get_write_results_queue")
    return {
        "writer_use_cpu_shm": _takes(writer, "use_cpu_shm_for_gpu_tensors"),
        "writer_cached_structure": _takes(writer, "use_cached_data_structure"),
        "writer_multiproc_io": _takes(writer, "is_multiproc_io"),
        "writer_use_msc": _takes(writer, "use_msc"),
        "write_results_queue_mp_mode": _takes(results_queue, "mp_mode"),
    }


def _strategy_probes(torch_strategies: ModuleType | None) -> dict[str, bool]:
    strategy = _attr(torch_strategies, "TorchDistSaveShardedStrategy")
    return {
        "strategy_thread_count": _takes(strategy, "thread_count"),
        "strategy_cached_metadata": _takes(strategy, "cached_metadata"),
        "strategy_cpu_shm_mode": _takes(strategy, "cpu_shm_mode"),
    }


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    except Exception:  # noqa: BLE001 - a parent package that fails to import
        return False


def _fsdp_symm_mem() -> bool:
    return fsdp_symm_mem_support()[0]  # one probe for Capabilities and wrap_fsdp


def _torch_facts() -> tuple[str, bool]:
    try:
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.__version__, bool(torch.cuda.is_available())
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({type(e).__name__}: {e})", False


def _detect() -> Capabilities:
    torch_version, cuda = _torch_facts()
    nvrx_version = _installed_version(NVRX, NVRX_DIST)
    mcore_version = _installed_version("megatron", MCORE_DIST)
    modules = _load_modules(nvrx_version, mcore_version)
    provider = _async_provider(modules)
    core, fs = _provider_modules(modules, provider)
    return Capabilities(
        python_version=platform.python_version(),
        torch_version=torch_version,
        cuda_available=cuda,
        mcore_version=mcore_version,
        nvrx_version=nvrx_version,
        nvrx_importable=modules.nvrx_core is not None,
        nvrx_error=modules.nvrx_error,
        mcore_dist_ckpt_importable=modules.mcore_dc is not None,
        mcore_error=modules.mcore_error,
        **_queue_probes(core),
        **_writer_probes(fs),
        **_strategy_probes(modules.mcore_torch),
        mcore_async_utils=modules.mcore_async is not None,
        megatron_training=_module_present("megatron.training"),
        fsdp_symm_mem=_fsdp_symm_mem(),
        async_provider=provider,
        strategy_request_provider=_request_provider(modules),
        **_worker_probes(core),
    )


_cache: list[Capabilities] = []
_cache_lock = threading.Lock()


def detect(*, refresh: bool = False) -> Capabilities:
    """The installed backends' capabilities: computed on first call, then cached. Never raises."""
    with _cache_lock:
        if refresh or not _cache:
            _cache[:] = [_detect_safely()]
        return _cache[0]


def _detect_safely() -> Capabilities:
    try:
        return _detect()
    except Exception as e:  # noqa: BLE001 - detection must never take the run down
        logger.debug("backend detection failed", exc_info=True)
        return _nothing_detected(f"backend detection failed: {type(e).__name__}: {e}")


def _nothing_detected(reason: str) -> Capabilities:
    flags = {f.name: False for f in dataclasses.fields(Capabilities) if f.type in ("bool", bool)}
    return Capabilities(**{**flags, "python_version": platform.python_version(),
                           "torch_version": _torch_facts()[0], "mcore_version": None,
                           "nvrx_version": None, "nvrx_error": reason, "mcore_error": reason,
                           "async_provider": "sync", "worker_needs_cuda": True,
                           "queue_sync_needs_cuda": True})


# -- where the worker modes can run --------------------------------------------------------------
def persistent_worker_runs_here(
    caps: Capabilities | None = None, *, cpu_shm_mode: bool = False
) -> tuple[bool, str]:
    """Can the provider's persistent worker start in this environment? (answer, reason)

    The worker of mcore and of nvrx < 0.7 calls ``torch.cuda.set_device`` when it starts; nvrx
    0.7 skips that under ``cpu_shm_mode=True``. Without CUDA the worker dies and a trainer waiting
    on it would hang, so callers must not start it when this says no.
    """
    caps = caps or detect()
    if caps.async_provider == "sync" or not caps.queue_persistent:
        return False, f"the async backend ({caps.async_provider}) has no persistent worker"
    if caps.cuda_available or not caps.worker_needs_cuda:
        return True, "ok"
    if cpu_shm_mode and caps.queue_cpu_shm_mode and caps.worker_cpu_shm_skips_cuda:
        return True, "ok: cpu_shm_mode keeps CUDA out of the worker"
    hint = ("" if caps.worker_cpu_shm_skips_cuda
            else "; nvidia-resiliency-ext >= 0.7.0 can run it on CPU with cpu_shm_mode")
    return False, (f"the {caps.async_provider} persistent worker calls torch.cuda.set_device at "
                   f"start and CUDA is not available here{hint}")


def dist_sync_runs_here(caps: Capabilities | None = None) -> tuple[bool, str]:
    """Can the queue agree across ranks itself (``no_dist=False``)? (answer, reason)

    Its agreement all-reduces a tensor on ``torch.cuda.current_device()``: without CUDA, call the
    queue with ``no_dist=True`` and agree over the (gloo) process group yourself.
    """
    caps = caps or detect()
    if caps.cuda_available or not caps.queue_sync_needs_cuda:
        return True, "ok"
    return False, (f"the {caps.async_provider} queue all-reduces on torch.cuda.current_device(); "
                   "CUDA is not available here")


# -- accessors -----------------------------------------------------------------------------------
def _require_mcore() -> Capabilities:
    caps = detect()
    if not caps.mcore_dist_ckpt_importable:
        raise BackendUnavailable(
            f"megatron.core.dist_checkpointing is not usable: {caps.mcore_error}"
        )
    return caps


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"cannot import {name}: {type(e).__name__}: {e}") from e


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
    kwargs: dict[str, Any] = {"persistent": persistent, "is_daemon": is_daemon}
    if cpu_shm_mode:
        kwargs["cpu_shm_mode"] = True
    if cpu_priority is not None:
        kwargs["cpu_priority"] = cpu_priority
    if io_priority is not None:
        kwargs["io_priority"] = io_priority
    return call_with_supported(async_calls_queue_cls(), **kwargs)


def map_sharded_tensors(sharded_state_dict: Any, fn: Callable[[Any], Any]) -> None:
    """Replace every ShardedTensor ``t`` in nested dicts/lists with ``fn(t)``, in place."""
    cls = sharded_tensor_cls()
    _map_in_place(sharded_state_dict, cls, fn)


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


def common_state_present(checkpoint_dir: str | Path) -> bool:
    """Whether a megatron-core checkpoint holds its common (rank 0, non-sharded) state: the
    ``common.pt`` of megatron-core <= 0.16, or the ``common_state`` object that 0.19 keeps inside
    the torch_dist files (named in their ``.metadata``). Without it megatron-core's load fails
    with an AttributeError that names neither."""
    path = Path(checkpoint_dir)
    if (path / "common.pt").exists():
        return True
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (OSError, EOFError, RuntimeError, ValueError):
        return False
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


# -- megatron.training seams (the Megatron-LM adapter asks these) --------------------------------
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


def _code_names(fn: Any) -> frozenset[str]:
    """Global and attribute names ``fn``'s own code looks up (empty when it has no code)."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    return frozenset(code.co_names) if code is not None else frozenset()


def _names_param(fn: Any, name: str) -> bool:
    """``fn`` declares a parameter ``name`` (a ``**kwargs`` catch-all does not count)."""
    if fn is None:
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def mcore_content_metadata_key() -> str:
    """The common-state key under which ``dist_checkpointing.save`` stores ``content_metadata``."""
    _require_mcore()
    return getattr(_import(f"{MCORE_DC}.serialization"), "_CONTENT_METADATA_KEY", "content_metadata")


# -- sequential (single-process) writes ----------------------------------------------------------
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


def _parameters(fn: Any) -> Mapping[str, Any]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def sequential_writer(async_fn: Any) -> tuple[type, tuple] | None:
    """(writer class, partial args) when the request's writer would fork per bucket, so the
    caller can run the buckets inline instead (Megatron-LM PR #3424); None when the installed
    writer already writes inline or is of an unknown shape (then it is used as it is)."""
    owner = _forking_multiproc_writer(async_fn)
    return None if owner is None else (owner, tuple(async_fn.args))


def shutdown_write_results_queues() -> None:
    """Drop the backends' global write-results queues: a Manager server is stopped (so
    ``close()`` leaves no child behind), a :class:`~megatron_ckpt_ext.spool.SpoolQueue`'s
    directory removed, so no stale result is read by a later save. The next save (or
    :func:`prime_write_results_queue`) puts new ones in place."""
    from .spool import SpoolQueue

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

    Left to the writer, each queue is a multiprocessing Manager server started at the first save
    with the ``spawn`` context, whose child re-imports the training script's ``__main__`` (seconds
    with Megatron-LM's imports, on the first save's critical path). We set every writer module's
    module-global queue (megatron-core's ``filesystem_async`` and, where installed, nvrx's: nvrx
    0.7's writer, used by megatron-core 0.19 with nvrx, has its own) the way its getter would,
    but to a :class:`~megatron_ckpt_ext.spool.SpoolQueue`: no server process at all. A forked
    Manager (what Megatron-LM's own start-up uses, ``mp_mode="fork"``) kept ~190 MB of the
    trainer's pages alive by copy-on-write on the H100 bench (``scripts/profile_save.py
    --mem-breakdown``). ``MCX_RESULTS_QUEUE=manager`` primes one forked Manager for both queues
    instead. Returns whether megatron-core's queue is in place; False (lazy, as before) on an
    unknown shape. ``MCX_PRIME_RESULTS_QUEUE=0`` leaves them lazy."""
    import multiprocessing as mp

    if env_switch("MCX_PRIME_RESULTS_QUEUE") == "0":
        return False
    use_manager = env_switch("MCX_RESULTS_QUEUE") == "manager"
    if use_manager and "fork" not in mp.get_all_start_methods():
        return False
    primed = {}
    shared: list[Any] = []  # the one Manager, started at the first queue that needs it

    def new_queue() -> Any:
        if not use_manager:
            from .spool import SpoolQueue

            return SpoolQueue()
        if not shared:
            shared.append(mp.get_context("fork").Manager())
        return shared[0].Queue()

    for name in (f"{MCORE_STRATEGIES}.filesystem_async", f"{NVRX_ASYNC}.filesystem_async"):
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - optional speed-up; the save path reports errors
            logger.debug("write-results queue of %s not primed: %s", name, e)
            primed[name] = False
            continue
        primed[name] = _prime_module_queue(module, new_queue)
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
    needed``), to snapshot live training tensors. Ours are already snapshots owned by the save
    until its commit, so that clone is a second full copy on the critical path (0.7-0.9 s for
    8.5 GB on the H100), into fresh memory that torch then copies again into a new shared
    segment to pickle it for the persistent worker (3.2-3.9 s). Used only around the request's
    planning, only where :func:`writer_clones_cpu_tensors`; ``MCX_KEEP_WRITER_CLONES=1`` keeps
    the clones."""

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


def without_host_preload(request: Any) -> Any:
    """``request`` without its preload function when that would only move CPU tensors to the
    CPU; the request unchanged otherwise (or where ``MCX_KEEP_PRELOAD=1``).

    megatron-core's own async writer (used with megatron-core 0.16, or 0.19 without nvrx) hands
    the queue ``partial(preload_tensors, write_buckets, True)``: copy each bucket's tensors to
    the host, then a CUDA device synchronize. After our staging every tensor is already in host
    memory, so the preload does nothing useful, but a persistent worker runs it and the trainer
    joins on that hand-over: measured on CPU (megatron-core 0.16.1 writer, nvrx 0.7.0 queue,
    0.1 GB), scheduling took 0.17-0.35 s per save with the preload and under 0.01 s without.
    Without it no synchronize runs in the writer either. nvrx 0.7's own writer (megatron-core
    0.19 with nvrx) builds its buckets in its preload: another shape, left alone. Recognised by
    shape (a ``functools.partial`` of a function named ``preload_tensors`` over a list of write
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


@contextlib.contextmanager
def persistent_worker_forks(queue: Any, *, cpu_shm_mode: bool) -> Any:
    """Within this block, nvrx's persistent writer is started with ``fork`` instead of ``spawn``
    where that is safe: the worker will not use CUDA (nvrx's ``cpu_shm_mode``) or CUDA is not
    initialised in this process. Returns whether it applied (``yield``-ed value).

    A spawned worker starts a fresh interpreter and imports torch, nvrx and megatron-core before
    it takes a request: 18-19 s on the H100 machine, so a trainer that saves early waits for it
    inside its first save. A forked one has them all, in milliseconds. This is the method
    megatron-core's temporal writer and write-results queue already use after CUDA
    initialisation. Cost: the worker shares the trainer's pages copy-on-write (bounded by the
    trainer's host memory at start-up). ``MCX_PERSISTENT_WORKER_START=spawn`` keeps spawn."""

    import torch

    module = sys.modules.get(type(queue).__module__)  # the module whose mp starts the worker
    mp = getattr(module, "mp", None)
    safe = cpu_shm_mode or not (torch.cuda.is_available() and torch.cuda.is_initialized())
    if (env_switch("MCX_PERSISTENT_WORKER_START") == "spawn" or mp is None
            or not hasattr(mp, "get_context") or not safe):
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


def warm_up_writer_imports() -> None:
    """Import, in a writer process, the modules a save request's functions live in (run by the
    persistent worker's warm-up request, so the first save does not wait for these imports)."""
    for name in (f"{MCORE_STRATEGIES}.filesystem_async", f"{MCORE_STRATEGIES}.torch",
                 f"{NVRX_ASYNC}.filesystem_async", "megatron_ckpt_ext.strategy"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a missing optional module is not an error here
            logger.debug("writer warm-up: %s not imported: %s", name, e)


# -- Megatron-FSDP's experimental fully_shard (megatron_ckpt_ext.fsdp asks these) ---------------
# Where the experimental fully_shard lives, in order of preference: megatron-core's own copy (the
# one its models use), then the separate megatron-fsdp package. All classes are taken from the
# package whose fully_shard is used: its isinstance checks reject another copy's Placements.
FSDP_EXPERIMENTAL_MODULES = (
    "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental",
    "megatron_fsdp.experimental",
)
FSDP_SYMM_MEM_RELEASE = "megatron-core 0.19.2"  # a release whose fully_shard takes use_symm_mem


@dataclass(frozen=True)
class FsdpApi:
    """The experimental Megatron-FSDP entry points of one installed package."""

    module: str  # the package they come from
    version: str | None  # of its distribution, for messages
    fully_shard: Callable[..., Any]
    fully_shard_optimizer: Callable[..., Any] | None
    flat: type  # placement: dim-0 sharded
    placements: type  # Placements(dp_axes, parameter, gradient, optimizer)
    mixed_precision_policy: type | None
    fsdp_module: type  # the mixin fully_shard attaches (isinstance marks a wrapped module)
    use_symm_mem: bool  # fully_shard declares a ``use_symm_mem`` parameter


def megatron_fsdp_api() -> FsdpApi:
    """The experimental Megatron-FSDP API; raises BackendUnavailable saying why not and the fix."""
    api, problem = _fsdp_probe()
    if api is None:
        raise BackendUnavailable(
            f"no experimental Megatron-FSDP fully_shard can be imported here ({problem}); "
            f"install {FSDP_SYMM_MEM_RELEASE} or newer (megatron.core.distributed.fsdp.src."
            "megatron_fsdp.experimental)."
        )
    return api


def fsdp_symm_mem_support() -> tuple[bool, str]:
    """Does the installed experimental fully_shard take ``use_symm_mem``? (answer, reason).

    Detected once, lazily, from ``inspect.signature`` of the real callable (a ``**kwargs``
    catch-all does not count); never raises."""
    try:
        api, problem = _fsdp_probe()
    except Exception as e:  # noqa: BLE001 - detection must never take the run down
        return False, f"Megatron-FSDP detection failed: {type(e).__name__}: {e}"
    if api is None:
        return False, (f"no experimental Megatron-FSDP fully_shard is importable ({problem}); "
                       f"{FSDP_SYMM_MEM_RELEASE} has one with use_symm_mem")
    where = f"{api.module}.fully_shard ({_fsdp_dist(api.module)} {api.version or 'unknown'})"
    if not api.use_symm_mem:
        return False, f"{where} has no use_symm_mem parameter; {FSDP_SYMM_MEM_RELEASE} has it"
    return True, f"{where} takes use_symm_mem"


@functools.lru_cache(maxsize=8)
def _fsdp_probe(
    candidates: tuple[str, ...] = FSDP_EXPERIMENTAL_MODULES,
) -> tuple[FsdpApi | None, str]:
    """(the first candidate package's API, "") or (None, why none was usable); cached."""
    problems = []
    for name in candidates:
        api, problem = _fsdp_api_from(name)
        if api is not None:
            return api, ""
        problems.append(f"{name}: {problem}")
    return None, "; ".join(problems)


def _fsdp_api_from(name: str) -> tuple[FsdpApi | None, str]:
    if not _module_present(name.split(".")[0]):
        return None, "not installed"
    module, error = _try_import(name)
    if module is None:
        return None, error or "import failed"
    fully_shard = _attr(module, "fully_shard")
    flat, placements = _attr(module, "Flat"), _attr(module, "Placements")
    fsdp_module = _attr(_try_import(f"{name}.module")[0], "FsdpModule")
    if not callable(fully_shard) or None in (flat, placements, fsdp_module):
        return None, "no fully_shard/Flat/Placements/FsdpModule"
    parent = name.rsplit(".", 1)[0]
    parent_module = _try_import(parent)[0]
    version = _installed_version(parent.split(".")[0], _fsdp_dist(name))
    if version in (None, "unknown"):  # a source checkout: the package's own version string
        version = str(_attr(parent_module, "__version__") or "unknown")
    return FsdpApi(
        module=name,
        version=version,
        fully_shard=fully_shard,
        fully_shard_optimizer=_attr(module, "fully_shard_optimizer"),
        flat=flat,
        placements=placements,
        mixed_precision_policy=_attr(parent_module, "MixedPrecisionPolicy"),
        fsdp_module=fsdp_module,
        use_symm_mem=_names_param(fully_shard, "use_symm_mem"),
    ), ""


def _fsdp_dist(module_name: str) -> str:
    return MCORE_DIST if module_name.startswith("megatron.") else "megatron-fsdp"


def fsdp_group_symm_pool(group: Any) -> Any:
    """The NCCL symmetric-memory pool a Megatron-FSDP parameter group allocates its staging
    buffers from, or None (flag off, or a layout without one). Megatron-FSDP 0.19.2's
    experimental ``ParameterGroup`` keeps it in ``_symm_mem_pool``; read here, not elsewhere,
    so a renamed attribute reads as "no pool" (plain buffers), never as an error."""
    return getattr(group, "_symm_mem_pool", None)


__all__ += ["FsdpApi", "fsdp_group_symm_pool", "fsdp_symm_mem_support", "megatron_fsdp_api"]


# -- the async queue's writers (shapes probed here, used by the checkpointer) -----------------
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
        return ("running", "") if process.is_alive() else ("dead", _writer_exit_text(process))
    if process is None or process.is_alive():
        return ("done", "") if process is None else ("running", "")
    return ("done", "") if process.exitcode == 0 else ("dead", _writer_exit_text(process))


def _writer_died(caller: Any) -> bool:
    process = getattr(caller, "process", None)
    return process is not None and not process.is_alive()


def _writer_exit_text(process: Any) -> str:
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
def unblock_hand_over_if_worker_dies(queue: Any, *, poll_s: float = 0.05) -> Any:
    """While a request is handed to the persistent worker, the trainer joins the worker's
    preload queue; if the worker dies meanwhile, release that join (the next maybe_finalize then
    reports the dead worker on every rank) instead of waiting forever."""
    caller = persistent_caller(queue)
    if caller is None or not hasattr(caller, "preload_q"):
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            if _writer_died(caller):
                with contextlib.suppress(ValueError):  # the worker had already released it
                    caller.preload_q.task_done()
                return

    watcher = threading.Thread(target=watch, name="mcx-preload-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


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


__all__ += ["async_writer_state", "checkpoint_failure_text", "persistent_caller",
            "stop_async_writers", "unblock_hand_over_if_worker_dies"]
