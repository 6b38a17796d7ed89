"""What the installed megatron-core / nvidia-resiliency-ext can do: :func:`detect` returns a
frozen :class:`Capabilities`, probed from the real callables (versions are for messages only),
computed once and cached; it never raises."""

from __future__ import annotations

import dataclasses
import logging
import platform
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType

from ._imports import (MCORE_019_NVRX_MIN, MCORE_DC, MCORE_DIST, MCORE_STRATEGIES, NVRX,
                       NVRX_ASYNC, NVRX_DIST, _attr, _installed_version, _module_present,
                       _try_import, _version_tuple)
from .introspect import _names_param, _source_has, _takes
from .megatron_fsdp import fsdp_symm_mem_support

logger = logging.getLogger("megatron_ckpt_ext.backend")


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
    # The provider's warmup_persistent_caller takes otel_bootstrap (worker-side telemetry).
    warmup_otel_bootstrap: bool
    strategy_thread_count: bool
    strategy_cached_metadata: bool
    strategy_cpu_shm_mode: bool
    # Load side of megatron-core, by signature: the load strategy dequantizes quantized (FP8)
    # targets per tensor inside its planner (stream_ckpt_dequant) ...
    load_strategy_stream_dequant: bool
    # ... or its planner keeps at most one stand-in between resolve_tensor and commit_tensor
    # (_intermediate_read_item_and_target), so only that item may be in flight at a time.
    load_planner_single_stash: bool
    # FullyParallelLoadStrategyWrapper(per_rank_object_load=): each rank reads its own objects.
    load_wrapper_per_rank_objects: bool
    # Both fully-parallel wrappers take pg_cache_path/pg_cache_create (the distribution on disk).
    fully_parallel_pg_cache: bool
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
    mcore_fully_parallel: ModuleType | None


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
    fully_parallel = _try_import(f"{MCORE_STRATEGIES}.fully_parallel")[0] if mcore_dc else None
    return _Modules(nvrx_core if not nvrx_error else None, nvrx_fs if not nvrx_error else None,
                    nvrx_error, mcore_dc, mcore_error, mcore_async, mcore_fs, mcore_torch,
                    fully_parallel)


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
        "warmup_otel_bootstrap": _names_param(warmup, "otel_bootstrap"),
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


def _load_probes(torch_strategies: ModuleType | None, fully_parallel: ModuleType | None
                 ) -> dict[str, bool]:
    load_wrapper = _attr(fully_parallel, "FullyParallelLoadStrategyWrapper")
    wrappers = (_attr(fully_parallel, "FullyParallelSaveStrategyWrapper"), load_wrapper)
    return {
        "load_strategy_stream_dequant": _names_param(
            _attr(torch_strategies, "TorchDistLoadShardedStrategy"), "stream_ckpt_dequant"),
        "load_planner_single_stash": _source_has(_attr(torch_strategies, "MCoreLoadPlanner"),
                                                 "_intermediate_read_item_and_target",
                                                 default=False),
        "load_wrapper_per_rank_objects": _names_param(load_wrapper, "per_rank_object_load"),
        "fully_parallel_pg_cache": all(_names_param(w, "pg_cache_path")
                                       and _names_param(w, "pg_cache_create") for w in wrappers),
    }


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
        **_load_probes(modules.mcore_torch, modules.mcore_fully_parallel),
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
