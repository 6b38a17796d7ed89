"""The write path: one ordered list of changes made to megatron-core's save request before a
writer runs it (:data:`TRANSFORMS`, applied by :func:`build`). Each step takes the request and
the save's :class:`WriteContext` and returns the request, changed or not; the order is the order
of wrapping, so a later step's wrapper runs first in the writer.

1. :func:`idle_worker_noop`: a persistent worker only reports requests it runs, so a rank with
   nothing to write gets a write that does nothing.
2. :func:`host_preload_dropped`: no host "preload" when every tensor is already staged on the host.
3. :func:`~megatron_ckpt_ext.save.handover.kept_in_writer`: under a constant structure a
   persistent writer keeps the request's write items and staged tensors between saves; each
   save pickles them once per structure (:mod:`.handover`). ``MCX_RESEND_EACH_SAVE=1`` resends.
4. :func:`sequential`: with ``--dist-ckpt-workers 1`` every bucket is written in the process that
   owns the save, where the installed writer would fork one process per bucket.
5. :func:`checksummed`: every data file's CRC-32 is recorded as its bytes are written, for
   the checkpoint's integrity manifest (:mod:`megatron_ckpt_ext.manifest`).
   ``MCX_WRITE_CHECKSUMS=0`` skips it.
6. :func:`crc_free`: torch.save's per-record CRC-32 off while writing (no reader checks it; its
   cost to the write: docs/notes/save_path.md). ``MCX_KEEP_CRC32=1`` keeps it.
7. :func:`page_cache_free`: once fsync'd, the written files' pages leave the page cache, so a
   checkpoint does not evict the trainer's cache. ``MCX_KEEP_PAGE_CACHE=1`` keeps them.
8. :func:`cpu_shimmed`: on CPU-only torch, the CPU device shim is active in the writer.
9. :func:`hooked`: the Checkpointer's :class:`~megatron_ckpt_ext.hooks.SaveHooks` (fault
   injection, and the writer trace of ``MCX_WRITER_TRACE``: docs/DEBUGGING.md).
10. :func:`preload_in_writer`: the provider's "preload" (nvrx builds the write buckets there) runs
   at the start of the write, in the writer, instead of before it while the trainer waits for it:
   the copies it reads are this save's own, complete once the gate opens.
   ``MCX_KEEP_PRELOAD=1`` keeps it where the provider runs it.
11. :func:`gated`: the stager's gate: the write waits until the staged copies landed.
12. :func:`collected_in_worker`: outermost, in a persistent writer: once the write returned, its
   cyclic garbage is collected. The worker loop runs with the collector off for its whole life
   (nvrx, megatron-core), and nvrx 0.4 never collects: each save left ~5.6 KB per tensor
   (torch.save's per-call classes and their cycles), growing the writer by 2.2 MB a save at 400
   tensors (docs/notes/save_path.md). Where the loop collects itself (nvrx 0.7) it finds little.
13. :func:`provider_shaped`: the request as the async queue's provider expects it.
"""

from __future__ import annotations

import os
import queue
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from .. import backend
from .._cpu_shim import call_with_cpu_shim
from ..debug import env_switch
from ..hooks import SaveHooks
from ..manifest import record_sum
from ..options import CkptOptions
from ..staging.base import Stager
from .handover import kept_in_writer

__all__ = ["TRANSFORMS", "WriteContext", "build", "bucket_files", "call_then_collect",
           "call_then_drop_written_pages",
           "call_with_checksums", "preload_then_write",
           "call_without_crc32", "drop_page_cache", "under_cpu_shim", "write_buckets_inline"]


@dataclass
class WriteContext:
    """What the steps of :data:`TRANSFORMS` may read about the save."""

    options: CkptOptions
    is_async: bool
    persistent: bool
    cpu_shim: bool
    stager: Stager
    hooks: SaveHooks
    record: Any  # the save's SaveRecord (the gate sets its ``seq``)
    rank: int


def build(request: Any, ctx: WriteContext, *, through: Callable | None = None) -> Any:
    """``request`` with every step of :data:`TRANSFORMS` applied, in order (``through``: up to
    and including that step only)."""
    for step in TRANSFORMS:
        request = step(request, ctx)
        if step is through:
            break
    return request


def idle_worker_noop(request: Any, ctx: WriteContext) -> Any:
    if ctx.is_async and ctx.persistent and request.async_fn is None:
        return request._replace(async_fn=_nothing_to_write, async_fn_args=(), async_fn_kwargs={})
    return request


def host_preload_dropped(request: Any, ctx: WriteContext) -> Any:
    return backend.without_host_preload(request)


def sequential(request: Any, ctx: WriteContext) -> Any:
    """Buckets written inline when one writer is asked for and the installed writer forks."""
    if ctx.options.dist_ckpt_workers != 1 or request.async_fn is None:
        return request
    found = backend.sequential_writer(request.async_fn)
    if found is None:
        return request
    writer_cls, (transform_list, use_msc) = found
    return request._replace(async_fn=partial(write_buckets_inline, writer_cls, transform_list,
                                             use_msc))


def checksummed(request: Any, ctx: WriteContext | None = None) -> Any:
    if request.async_fn is None or env_switch("MCX_WRITE_CHECKSUMS") != "1":
        return request
    return request._replace(async_fn=partial(call_with_checksums, request.async_fn))


def crc_free(request: Any, ctx: WriteContext | None = None) -> Any:
    import torch

    if (request.async_fn is None or env_switch("MCX_KEEP_CRC32") == "1"
            or not hasattr(torch.serialization, "get_crc32_options")):
        return request
    return request._replace(async_fn=partial(call_without_crc32, request.async_fn))


def page_cache_free(request: Any, ctx: WriteContext | None = None) -> Any:
    if (request.async_fn is None or env_switch("MCX_KEEP_PAGE_CACHE") == "1"
            or not hasattr(os, "posix_fadvise")):
        return request
    return request._replace(async_fn=partial(call_then_drop_written_pages, request.async_fn))


def collected_in_worker(request: Any, ctx: WriteContext) -> Any:
    if request.async_fn is None or not (ctx.is_async and ctx.persistent):
        return request
    return request._replace(async_fn=partial(call_then_collect, request.async_fn))


def cpu_shimmed(request: Any, ctx: WriteContext) -> Any:
    return under_cpu_shim(request) if ctx.cpu_shim else request


def under_cpu_shim(request: Any) -> Any:
    """``request`` whose write and preload functions run under the CPU device shim."""
    fields: dict[str, Any] = {}
    if request.async_fn is not None:
        fields["async_fn"] = partial(call_with_cpu_shim, request.async_fn)
    if getattr(request, "preload_fn", None) is not None:
        fields["preload_fn"] = partial(call_with_cpu_shim, request.preload_fn)
    return request._replace(**fields)


def hooked(request: Any, ctx: WriteContext) -> Any:
    return ctx.hooks.wrap_request(request, ctx.record)


def preload_in_writer(request: Any, ctx: WriteContext) -> Any:
    """The provider runs a request's ``preload_fn`` before its write and passes the result as
    the write's second argument; the persistent worker's trainer waits (joins) until the worker
    has run it. With every tensor staged into copies this save owns, nothing needs the trainer
    to wait: the preload runs inside the write, after the gate."""
    preload = getattr(request, "preload_fn", None)
    if (not ctx.is_async or not ctx.stager.owns_copies or preload is None
            or request.async_fn is None or len(request.async_fn_args or ()) < 2
            or env_switch("MCX_KEEP_PRELOAD") == "1"):
        return request
    return request._replace(async_fn=partial(preload_then_write, preload, request.async_fn),
                            preload_fn=None)


def gated(request: Any, ctx: WriteContext) -> Any:
    if not ctx.is_async or request.async_fn is None:
        return request
    write, ctx.record.held.seq = ctx.stager.gate(request.async_fn,
                                                 timeout_s=ctx.options.ckpt_timeout)
    return request._replace(async_fn=write)


def provider_shaped(request: Any, ctx: WriteContext) -> Any:
    return backend.adapt_async_request(request) if ctx.is_async else request


TRANSFORMS: tuple[Callable[[Any, WriteContext], Any], ...] = (
    idle_worker_noop, host_preload_dropped, kept_in_writer, sequential, checksummed, crc_free,
    page_cache_free, cpu_shimmed, hooked, preload_in_writer, gated, collected_in_worker,
    provider_shaped)


# -- what the writer runs (module level: pickled for a spawned writer) ---------------------------
def _nothing_to_write(*args: Any, **kwargs: Any) -> None:
    """The write of a rank that has nothing to write."""


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


def preload_then_write(preload: Callable[[], Any], write: Callable[..., Any], *args: Any,
                       **kwargs: Any) -> Any:
    """In the writer: the provider's preload, its result as the write's second argument (the
    provider's own convention), then the write."""
    args_list = list(args)
    args_list[1] = preload()
    return write(*args_list, **kwargs)


def call_with_checksums(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a checkpoint write) recording each file's CRC-32 as it is written."""
    with backend.checksummed_writes(record_sum) as rebind:
        return rebind(fn)(*args, **kwargs)


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


def call_then_collect(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a checkpoint write), then, where the collector is off (a persistent writer's
    loop turns it off for good), collect the cyclic garbage the write left. Module-level so
    that it pickles for a spawned writer."""
    import gc

    try:
        return fn(*args, **kwargs)
    finally:
        if not gc.isenabled():
            gc.collect()


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
