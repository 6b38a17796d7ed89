"""megatron-core save/load strategies from options, and the write-path adjustments we make.

* :func:`save_strategy`: torch_dist ``TorchDistSaveShardedStrategy`` with
  ``thread_count = dist_ckpt_workers`` and ``cached_metadata = ckpt_assume_constant_structure``
  (each only where the installed megatron-core accepts it), wrapped in the fully-parallel save
  wrapper when ``ckpt_fully_parallel_save`` and the data-parallel group has more than one rank.
  With one rank there is nothing to spread, and megatron-core 0.16-0.19 then never caches the
  wrapper's (empty) distribution, so it re-validates the sharding with collectives at every
  save: on one H100 that all_gather_object queued behind our staging copies and cost the
  copy's full 0.155 s of 8.5 GB again in every save's planning (``benchmarks/profile_save.py
  --cprofile-save``).
* :func:`load_strategy`: the fully-parallel load wrapper when ``ckpt_fully_parallel_load`` (and
  CUDA is there: its shard exchange runs on CUDA), else megatron-core's default.
* :func:`sequential_request`: with ``--dist-ckpt-workers 1`` the write of every bucket runs in the
  process that owns the save (the trainer for sync saves, the one async worker otherwise): no
  forked writer processes (Megatron-LM PR #3424). Where the installed writer already does this it
  is left alone; where it forks per bucket (megatron-core 0.16) the request's write function is
  swapped for :func:`write_buckets_inline`, which calls the same per-bucket writer in-process.
* :func:`crc_free_request`: the request's write runs with torch.save's per-record CRC-32 off.
  The torch_dist format stores every tensor as a ``torch.save`` zip record, and torch computes a
  CRC-32 of each record's bytes on the writer's thread: measured on CPU (torch 2.13, 256 MiB
  fp32 into the page cache) 2.47 GB/s with it, 5.36 GB/s without, against 5.57 GB/s for a raw
  write. No reader of these files checks it (``torch.load`` loads a record whose bytes were
  changed after its CRC was written, silently: ``tests/unit/test_strategy.py``), so it costs
  write bandwidth and protects nothing; stock megatron-core and plain DCP load the files the
  same (CRC fields are zero). ``MCX_KEEP_CRC32=1`` keeps it; torch without
  ``torch.serialization.get/set_crc32_options`` (< 2.6) is left alone.
* :func:`page_cache_free_request`: once the write (which fsyncs every bucket file) is done, the
  files' pages are dropped from the page cache (``POSIX_FADV_DONTNEED``), so a checkpoint does
  not evict the trainer's cache and the next save reuses the freed pages. ``MCX_KEEP_PAGE_CACHE=1``
  keeps them.
* :func:`cpu_request`: on CPU-only torch, wraps the request's functions so that the CPU device
  shim (``_cpu_shim.py``) is active in whichever process runs them.
"""

from __future__ import annotations

import os
import queue
from functools import partial
from typing import Any, Callable

from . import backend
from ._cpu_shim import call_with_cpu_shim
from .debug import env_switch
from .options import CkptOptions

__all__ = ["call_without_crc32", "cpu_request", "crc_free_request", "load_strategy",
           "save_strategy", "sequential_request", "write_buckets_inline"]

_BACKEND = "torch_dist"
_VERSION = 1


def save_strategy(options: CkptOptions, *, dp_group: Any = None) -> Any:
    """The megatron-core save strategy the options ask for."""
    strategy = backend.call_with_supported(
        backend.torch_dist_save_strategy_cls(), _BACKEND, _VERSION,
        thread_count=options.dist_ckpt_workers,
        cached_metadata=options.ckpt_assume_constant_structure,
    )
    if options.ckpt_fully_parallel_save and _group_size(dp_group) > 1:
        strategy = backend.call_with_supported(
            backend.fully_parallel_save_wrapper_cls(), strategy, dp_group,
            do_cache_distribution=options.ckpt_assume_constant_structure,
        )
    return strategy


def _group_size(group: Any) -> int:
    """Ranks in ``group`` (None: the world); 1 without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def load_strategy(options: CkptOptions, *, dp_group: Any = None,
                  caps: backend.Capabilities | None = None) -> Any | None:
    """The load strategy, or None for megatron-core's default.

    megatron-core's fully-parallel load exchanges shards on CUDA (it allocates with
    ``device="cuda"``), so on a CPU-only host it falls back to the default load (validation warns).
    """
    caps = caps or backend.detect()
    if not options.ckpt_fully_parallel_load or not caps.cuda_available:
        return None
    base = backend.torch_dist_load_strategy_cls()()
    return backend.call_with_supported(backend.fully_parallel_load_wrapper_cls(), base, dp_group)


def sequential_request(request: Any, options: CkptOptions) -> Any:
    """``request`` with its buckets written inline, when one writer is asked for and the
    installed writer would fork one process per bucket."""
    if options.dist_ckpt_workers != 1 or request.async_fn is None:
        return request
    found = backend.sequential_writer(request.async_fn)
    if found is None:
        return request
    writer_cls, (transform_list, use_msc) = found
    inline = partial(write_buckets_inline, writer_cls, transform_list, use_msc)
    return request._replace(async_fn=inline)


def write_buckets_inline(writer_cls: type, transform_list: Any, use_msc: bool, rank: int,
                         write_buckets: list, global_results_queue: Any) -> None:
    """Write every bucket in this process, in order, and report like the forking writer does:
    ``{bucket index: write results}`` (or the first exception) on ``global_results_queue``."""
    local_results: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    results: dict | Exception = {}
    extra = {"use_msc": use_msc} if use_msc else {}
    for index, bucket in enumerate(write_buckets):
        done.put(index)
        writer_cls.write_preloaded_data(transform_list, index, bucket, local_results, done,
                                        True, **extra)
        got_index, got = local_results.get()
        if isinstance(got, Exception):
            results = got
            break
        results[got_index] = got
    global_results_queue.put(results)


def crc_free_request(request: Any) -> Any:
    """``request`` whose write (sync or in the async writer) skips torch.save's CRC-32."""
    import torch

    if (request.async_fn is None or env_switch("MCX_KEEP_CRC32") == "1"
            or not hasattr(torch.serialization, "get_crc32_options")):
        return request
    return request._replace(async_fn=partial(call_without_crc32, request.async_fn))


def call_without_crc32(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a checkpoint write) with torch.save's CRC-32 off in this process, restored
    after. Module-level so that it pickles for a spawned writer."""
    import torch

    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.serialization.set_crc32_options(before)


def page_cache_free_request(request: Any) -> Any:
    """``request`` whose write, once done, drops the checkpoint files' pages from the page cache.

    The writers fsync every bucket file, so its pages are clean and ``POSIX_FADV_DONTNEED``
    frees them at once: a checkpoint (written once, read back only by a later job) does not
    evict the trainer's own page cache (datasets), and the next save's writes reuse the freed
    pages instead of taking fresh ones. On a VM whose memory is backed on first touch
    (Firecracker) writing into fresh page-cache pages ran 4-6x slower than into reused ones
    (docs/benchmarks, "the write path"). ``MCX_KEEP_PAGE_CACHE=1`` keeps the pages."""
    if (request.async_fn is None or env_switch("MCX_KEEP_PAGE_CACHE") == "1"
            or not hasattr(os, "posix_fadvise")):
        return request
    return request._replace(async_fn=partial(call_then_drop_written_pages, request.async_fn))


def call_then_drop_written_pages(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a checkpoint write taking megatron-core's write buckets, ``[(file, storage
    key, data), ...]``, among its arguments), then drop the pages of the files it wrote.
    Module-level so that it pickles for a spawned writer."""
    result = fn(*args, **kwargs)
    for path in bucket_files(args):
        drop_page_cache(path)
    return result


def bucket_files(args: tuple) -> list[str]:
    """The file of every write bucket in ``args`` (the first list of ``(path, key, data)``)."""
    for arg in args:
        if (isinstance(arg, list) and arg and all(isinstance(b, tuple) and len(b) == 3
                                                  and isinstance(b[0], (str, os.PathLike))
                                                  for b in arg)):
            return [os.fspath(b[0]) for b in arg]
    return []


def drop_page_cache(path: str) -> None:
    """Ask the kernel to drop ``path``'s cached pages (clean ones go at once); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def cpu_request(request: Any) -> Any:
    """``request`` with its write and preload functions run under the CPU device shim."""
    fields: dict[str, Any] = {}
    if request.async_fn is not None:
        fields["async_fn"] = partial(call_with_cpu_shim, request.async_fn)
    if getattr(request, "preload_fn", None) is not None:
        fields["preload_fn"] = partial(call_with_cpu_shim, request.preload_fn)
    return request._replace(**fields)
