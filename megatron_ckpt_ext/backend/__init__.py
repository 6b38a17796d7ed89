"""The compatibility layer: what the installed megatron-core / nvidia-resiliency-ext / Megatron-LM
/ Megatron-FSDP can do.

This package is the only code that imports nvidia-resiliency-ext (nvrx), megatron-core (mcore),
``megatron.training`` or Megatron-FSDP, or reads their internals, and the only user of
``inspect`` (tests/unit/test_layering.py holds that). Its rooms: ``detection`` (Capabilities,
probes), ``introspect`` (accepted keywords), ``mcore`` (accessors, request shapes),
``async_queue`` (build, inspect, stop), ``megatron_training`` (seams), ``megatron_fsdp`` (API and
buffer reads). Everything else asks it, through the names re-exported here:

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
* CPU shared-memory staging (``--async-ckpt-use-cpu-shm``): always ours (staging/); nvrx
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

from ._imports import MCORE_STRATEGIES, NVRX_ASYNC
from .async_queue import (async_writer_state, forked_writer, lone_writes_deferred,
                          new_async_calls_queue,
                          newest_writer_pid, persistent_caller, persistent_worker_forks,
                          refork_temporal_writer, remember_process_calls,
                          spawn_skips_main, stop_async_writers,
                          unblock_hand_over_if_worker_dies, warm_up_writer_imports,
                          writer_clones_cpu_tensors, writer_keeps_snapshots)
from .conversions import ConversionCache, conversions_cached, convert_ahead
from .detection import Capabilities, detect, dist_sync_runs_here, persistent_worker_runs_here
from .introspect import accepted_kwargs, call_arguments, call_with_supported
from .mcore import (adapt_async_request, async_calls_queue_cls, async_request_cls,
                    checkpoint_failure_text, common_check_kwargs, common_state_present,
                    dist_checkpointing,
                    filesystem_writer_async_cls, fully_parallel_load_wrapper_cls,
                    into_fresh_directory, version_checks_cached,
                    fully_parallel_save_wrapper_cls, get_write_results_queue,
                    load_with_tensors_from, map_sharded_tensors, mcore_content_metadata_key,
                    plain_tensors,
                    prime_write_results_queue, sequential_writer, sharded_tensor_cls,
                    shutdown_write_results_queues, torch_dist_load_strategy_cls,
                    torch_dist_save_strategy_cls, validate_sharding, with_data,
                    without_host_preload)
from .planning import object_collectives_on
from .replay import SaveReplay, plan_replayed
from .megatron_fsdp import (FsdpApi, dbuffer_flat_axes, dbuffer_replicated_coordinates,
                            dbuffer_slice, fsdp_group_symm_pool, fsdp_parameter_groups,
                            fsdp_symm_mem_support, megatron_fsdp_api)
from .load_reader import (ReadResult, ReadSettings, metadata_read_once, parallel_reads,
                          pin_chunks_ahead, release_read_chunks)
from .writer_files import checksummed_writes
from .layouts_ahead import discard as discard_layouts, start as parse_layouts_ahead
from .megatron_training import (MLM_MODULES, MegatronSeams, builds_sharded_state,
                                import_first_save_modules, megatron_sharded_state,
                                megatron_training_module, megatron_training_seams)

__all__ = [
    "Capabilities",
    "ConversionCache",
    "ReadResult",
    "ReadSettings",
    "pin_chunks_ahead",
    "parse_layouts_ahead",
    "discard_layouts",
    "release_read_chunks",
    "SaveReplay",
    "conversions_cached",
    "convert_ahead",
    "with_data",
    "validate_sharding",
    "common_check_kwargs",
    "FsdpApi",
    "MCORE_STRATEGIES",
    "MLM_MODULES",
    "MegatronSeams",
    "NVRX_ASYNC",
    "accepted_kwargs",
    "builds_sharded_state",
    "call_arguments",
    "adapt_async_request",
    "async_calls_queue_cls",
    "async_request_cls",
    "async_writer_state",
    "call_with_supported",
    "checkpoint_failure_text",
    "checksummed_writes",
    "common_state_present",
    "dbuffer_flat_axes",
    "dbuffer_replicated_coordinates",
    "dbuffer_slice",
    "detect",
    "dist_checkpointing",
    "dist_sync_runs_here",
    "filesystem_writer_async_cls",
    "fsdp_group_symm_pool",
    "fsdp_parameter_groups",
    "fsdp_symm_mem_support",
    "forked_writer",
    "fully_parallel_load_wrapper_cls",
    "fully_parallel_save_wrapper_cls",
    "get_write_results_queue",
    "into_fresh_directory",
    "object_collectives_on",
    "plan_replayed",
    "version_checks_cached",
    "load_with_tensors_from",
    "lone_writes_deferred",
    "map_sharded_tensors",
    "mcore_content_metadata_key",
    "megatron_fsdp_api",
    "import_first_save_modules",
    "megatron_sharded_state",
    "megatron_training_module",
    "megatron_training_seams",
    "metadata_read_once",
    "parallel_reads",
    "new_async_calls_queue",
    "newest_writer_pid",
    "persistent_caller",
    "persistent_worker_forks",
    "persistent_worker_runs_here",
    "plain_tensors",
    "prime_write_results_queue",
    "refork_temporal_writer",
    "remember_process_calls",
    "sequential_writer",
    "sharded_tensor_cls",
    "shutdown_write_results_queues",
    "spawn_skips_main",
    "stop_async_writers",
    "torch_dist_load_strategy_cls",
    "torch_dist_save_strategy_cls",
    "unblock_hand_over_if_worker_dies",
    "warm_up_writer_imports",
    "without_host_preload",
    "writer_clones_cpu_tensors",
    "writer_keeps_snapshots",
]
