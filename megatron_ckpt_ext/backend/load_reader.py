"""Parallel reads for megatron-core's torch_dist load: the reader megatron-core builds (by its
module-level ``_get_filesystem_reader``) reads its items on a pool of threads instead of one after
another, each item in its own file stream. File reads and the copy into the target tensor release
the GIL, so reads, unpickling and host-to-device copies of different items overlap. The items,
the planner and the checks are torch DCP's own; only the loop is parallel. The CRC-32 sums taken
on the way are :mod:`.load_sums`'s."""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Iterator, Mapping

from .._threads import thread_counts
from . import direct_read, layouts_ahead
from .read_copies import (copies_landed, host_chunks, in_flight, release_when_copied,
                          thread_stream)
from .direct_read import Files as _Files, chunk_spans as _chunks, stripes as _stripes
from ._imports import MCORE_DC, MCORE_STRATEGIES
from .load_metadata import (MetadataMemo, factory_wrapped, planned_on_each_rank,
                            memo_read_metadata, share)
from .load_sums import _gaps, _Sums  # noqa: F401  (_gaps: tests reach it here)

__all__ = ["ReadResult", "ReadSettings", "parallel_reads", "pin_chunks_ahead",
           "release_read_chunks"]

logger = logging.getLogger("megatron_ckpt_ext.backend")

_NEEDED = ("storage_data", "fs", "path", "_slice_file")


@dataclass(frozen=True)
class ReadSettings:
    """How a load reads: ``threads`` reading threads, ``chunk`` bytes at a time (None:
    ``direct_read.DEFAULT_CHUNK`` as the load starts); with ``checksums`` the files this rank
    reads whole are summed as the bytes pass, on ``checksum_threads`` (None: as many as reading
    ones, at most this rank's share of the cores), and ``on_planned`` is told those files' names
    as soon as the reads are planned (before the bytes are read); with ``device_checksums`` the
    bytes copied to a device whose CRC kernel is ready (:mod:`.._crc_device`) are summed there
    instead, off the host's cores. ``metadata``: {checkpoint
    directory: its DCP ``Metadata``} that the caller has unpickled already (the load's readers
    then do not read that ``.metadata`` again). ``agreed_failures``: the caller makes a failure
    on one rank every rank's (load/loader.py), so torch DCP may plan on each rank alone at any
    world size (``load_metadata.planned_on_each_rank``); without it, only at one rank."""

    threads: int
    chunk: int | None = None
    checksums: bool = False
    checksum_threads: int | None = None
    on_planned: Callable[[set[str]], None] | None = None
    metadata: Mapping[str, Any] | None = None
    device_checksums: bool = False
    agreed_failures: bool = False


@dataclass
class ReadResult:
    """What a load's parallel reads did. ``why_not``: None when they applied, else why not (the
    load then ran as megatron-core's own, and the rest stays empty). Seconds of the metadata step
    (where each item's bytes are) and of the read step, split into file reads and host-to-device
    copies; how many items (and bytes) were read directly, how many the stock way (``why_stock``:
    the first reason); ``file_crcs`` {file: (bytes, crc32)} of the ``planned_files`` summed as
    read, ``device_summed_bytes`` of them on the device; ``sums_wait_s``: the part of the read
    step after the last read, waiting for the sums; ``sum_device_busy_s``: the device-sum
    thread's own seconds (its launches), beside the reads."""

    why_not: str | None = None
    metadata_s: float = 0.0
    read_s: float = 0.0
    h2d_s: float = 0.0
    sums_wait_s: float = 0.0  # of read_s: after the last read, until every sum was in
    sum_device_busy_s: float = 0.0  # the device-sum thread's seconds at work (beside the reads)
    direct_items: int = 0
    stock_items: int = 0
    direct_bytes: int = 0
    why_stock: str = ""
    file_crcs: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    planned_files: set[str] = field(default_factory=set)
    device_summed_bytes: int = 0


@contextlib.contextmanager
def parallel_reads(settings: ReadSettings) -> Iterator[ReadResult]:
    """While inside, megatron-core's torch_dist loads read as ``settings`` say; the result
    yielded fills in as they do (:class:`ReadResult`, its ``why_not`` set at once when they
    cannot apply). Every reader megatron-core builds meanwhile unpickles ``.metadata`` at most
    once between them (none where ``settings.metadata`` has it), parallel or not."""
    result, memo = ReadResult(), MetadataMemo(settings.metadata)
    settings = replace(settings, chunk=settings.chunk or direct_read.DEFAULT_CHUNK,
                       checksum_threads=thread_counts(load_read=settings.threads,
                                                      checksum=settings.checksum_threads).checksum)

    def built(reader: Any) -> Any:
        if result.why_not is None:
            return _make_parallel(reader, settings, result, memo)
        return share(reader, memo)

    # megatron-core 0.19's common-state load builds its reader by its own name for the factory
    with factory_wrapped(f"{MCORE_DC}.serialization", partial(share, memo=memo)), \
            factory_wrapped(f"{MCORE_STRATEGIES}.torch", built) as why_not, \
            planned_on_each_rank(every_size=settings.agreed_failures):
        result.why_not = why_not or (None if settings.threads > 1 else "one read thread asked for")
        yield result


@contextlib.contextmanager
def metadata_read_once(known: Mapping[str, Any] | None = None) -> Iterator[None]:
    """While inside, the readers megatron-core builds for a load (its sharded load's; on 0.19
    its common-state load's too) unpickle ``.metadata`` at most once between them (not at all
    where ``known`` holds it by checkpoint directory: read by the load's locate step), and read
    as megatron-core does otherwise (a restore from memory's load of the non-tensor state)."""
    memo = MetadataMemo(known)
    with factory_wrapped(f"{MCORE_DC}.serialization", partial(share, memo=memo)), \
            factory_wrapped(f"{MCORE_STRATEGIES}.torch", partial(share, memo=memo)), \
            planned_on_each_rank():
        yield


def _make_parallel(reader: Any, settings: ReadSettings, result: ReadResult,
                   memo: MetadataMemo) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if not isinstance(reader, FileSystemReader) or not all(hasattr(reader, a) for a in _NEEDED):
        logger.info("parallel checkpoint reads do not apply to %s: megatron-core's reader is used",
                    type(reader).__name__)
        if settings.on_planned is not None:
            settings.on_planned(set())  # nothing is summed by the reads: the check reads all
        return reader
    reader.__class__ = _parallel_class(type(reader))
    reader._mcx_settings, reader._mcx_result, reader._mcx_memo = settings, result, memo
    return reader


_CLASSES: dict[type, type] = {}


def _parallel_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Parallel{base.__name__}", (base,),
                              {"read_data": _read_data, "read_metadata": memo_read_metadata})
    return _CLASSES[base]


def _read_data(self: Any, plan: Any, planner: Any) -> Any:
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    lock = threading.Lock()
    settings, result, busy = self._mcx_settings, self._mcx_result, _Busy()
    # as many summing threads as reading ones, at most this rank's share of the cores (more did
    # not help on the H100 host: docs/notes/benchmarks.md, the load's summing threads)
    sums = _Sums(settings.checksums, settings.checksum_threads, executor=ThreadPoolExecutor,
                 on_device=settings.device_checksums)
    tensors = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
    t = time.perf_counter()
    _read_byte_items(self, planner, [r for r in plan.items if r.type == LoadItemType.BYTE_IO],
                     sums)
    # in file order: a cold read of the headers then runs along each file
    tensors.sort(key=lambda r: (self.storage_data[r.storage_index].relative_path,
                                self.storage_data[r.storage_index].offset))
    with _Files(self) as files, ThreadPoolExecutor(
            max_workers=settings.threads, thread_name_prefix="mcx-read") as pool:
        # 1. where each item's bytes are, and its target: the kernel is asked for every item's
        # header pages at once (a cold disk reads them in parallel), then they are parsed on
        # this thread (Python-bound: threads would only take turns on the GIL)
        ahead = layouts_ahead.take(self.path)  # parsed while the model was built, if so
        for req in tensors:
            _prefetch_edges(files, self.storage_data[req.storage_index], ahead)
        plans = [_plan_item(self, files, planner, req, lock, ahead) for req in tensors]
        for p in plans:
            sums.direct_item(p, self.storage_data[p.req.storage_index])
        covered = sums.planned(files)
        result.planned_files |= covered
        if settings.on_planned is not None:
            settings.on_planned(covered)
        now = time.perf_counter()
        result.metadata_s += now - t
        t = now
        # 2. the bytes: the direct items' chunks in file order, cut into one contiguous stripe
        # per thread (each thread reads along its stripe: a cold disk streams it); the rest
        # of the items the stock way
        direct = [p for p in plans if p.span is not None]
        chunks = sorted(((p, a, b) for p in direct for a, b in _chunks(p.span[1], settings.chunk)),
                        key=lambda c: (c[0].what, c[0].span[0] + c[1]))
        jobs = [pool.submit(_read_stripe, stripe, settings, busy, sums)
                for stripe in _stripes(chunks, settings.threads)]
        jobs += [pool.submit(_read_tensor, self, planner, p.req, lock)
                 for p in plans if p.span is None]
        failed = []
        for job in jobs:  # every read ends (or fails) before the sums are waited for
            try:
                job.result()
            except BaseException as e:  # noqa: BLE001 - raised below, after the sums
                failed.append(e)
        reads_done = time.perf_counter()
        sums.wait()  # every chunk lent back, every copy done, before anything else
        result.sums_wait_s += time.perf_counter() - reads_done
        result.sum_device_busy_s += sums.device_busy_s
        if failed:
            raise failed[0]
        _split_read(result, busy, time.perf_counter() - t)
        result.file_crcs.update(sums.file_crcs(files, covered))
        result.device_summed_bytes += sums.device_bytes
    _commit_direct(planner, plans, direct, result)
    fut: Future = Future()
    fut.set_result(None)
    return fut


def _read_byte_items(reader: Any, planner: Any, items: list, sums: _Sums) -> None:
    """The non-tensor items (pickled objects), one after another, summed as read."""
    for req in items:
        with _item_stream(reader, req) as data:
            raw = data.read(-1)
            sums.whole_item(reader.storage_data[req.storage_index], raw)
            planner.load_bytes(req, io.BytesIO(raw))


def _commit_direct(planner: Any, plans: list[_ItemPlan], direct: list[_ItemPlan],
                   result: ReadResult) -> None:
    """The items read directly go to the planner; ``result`` counts how the items were read."""
    for p in direct:
        planner.commit_tensor(p.req, p.target)
    result.direct_items += len(direct)
    result.stock_items += len(plans) - len(direct)
    result.direct_bytes += sum(p.span[1] for p in direct)
    why = [p.why for p in plans if p.span is None]
    if why and not result.why_stock:
        result.why_stock = why[0]


class _Busy:
    """The reading threads' seconds in file reads and in host-to-device copies."""

    def __init__(self) -> None:
        self.read = self.h2d = 0.0
        self._lock = threading.Lock()

    def add(self, name: str, since: float) -> float:
        now = time.perf_counter()
        with self._lock:
            setattr(self, name, getattr(self, name) + now - since)
        return now


def _split_read(result: ReadResult, busy: _Busy, wall: float) -> None:
    """The read step's wall time, split into ``read_s`` and ``h2d_s`` in proportion to the time
    the reading threads spent in file reads and in host-to-device copies (they overlap across
    threads: the split says which of the two the step was made of)."""
    h2d = wall * busy.h2d / max(busy.read + busy.h2d, 1e-12)
    result.h2d_s += h2d
    result.read_s += wall - h2d


@dataclass
class _ItemPlan:
    req: Any
    target: Any = None
    span: tuple[int, int] | None = None  # (file offset, bytes) read directly into target
    fd: int = -1
    what: str = ""
    why: str = ""
    layout: Any = None
    summed: bool = False  # its record's chunks are CRC-32 pieces of its file


def _plan_item(reader: Any, files: _Files, planner: Any, req: Any, lock: threading.Lock,
               ahead: layouts_ahead.LayoutsAhead | None = None) -> _ItemPlan:
    import torch

    item_md = reader.storage_data[req.storage_index]
    plan = _ItemPlan(req, what=str(item_md.relative_path))
    if getattr(item_md, "transform_descriptors", None):
        plan.why = "the item is stored through a transform"
        return plan
    plan.fd = files.fd(item_md.relative_path)
    found = ahead and ahead.layout(str(item_md.relative_path), plan.fd, item_md.offset,
                                   item_md.length)
    layout, plan.why = found or direct_read.item_layout(plan.fd, item_md.offset, item_md.length)
    if layout is None:
        return plan
    plan.layout = layout
    with lock:  # the planner's bookkeeping is not ours to make thread-safe
        target = planner.resolve_tensor(req).detach()
        # megatron-core's planner keeps an FP8 stand-in until commit_tensor: such items are
        # read the stock way (resolve, copy, commit in one go)
        intermediate = getattr(planner, "_intermediate_read_item_and_target", None) is not None
        if intermediate:
            planner._intermediate_read_item_and_target = None
    span = layout.span(tuple(req.storage_offsets), tuple(req.lengths))
    if intermediate or type(target) is not torch.Tensor:
        plan.why = f"the target is a {type(target).__name__}"
    elif span is None:
        plan.why = "the read is not one contiguous range of the saved tensor"
    elif target.dtype != layout.dtype or tuple(target.size()) != tuple(req.lengths):
        plan.why = "the target's dtype or size differs from the saved tensor's"
    elif not target.is_contiguous() or target.device.type not in ("cpu", "cuda"):
        plan.why = "the target is not a contiguous CPU or CUDA tensor"
    else:
        plan.target, plan.span = target, span
    return plan


def _prefetch_edges(files: _Files, item_md: Any,
                    ahead: layouts_ahead.LayoutsAhead | None = None) -> None:
    if ahead and ahead.has(str(item_md.relative_path), item_md.offset, item_md.length):
        return  # read and parsed ahead
    direct_read.prefetch_edges(files.fd(item_md.relative_path), item_md.offset, item_md.length)


def _read_stripe(stripe: list, settings: ReadSettings, busy: _Busy, sums: "_Sums") -> None:
    try:
        for plan, a, b in stripe:
            _read_chunk(plan, a, b, settings, busy, sums)
    finally:  # the stripe's copies have landed and its chunks are back before it ends
        copies_landed(busy, keep=0)


def _read_chunk(plan: _ItemPlan, a: int, b: int, settings: ReadSettings, busy: _Busy,
                sums: "_Sums") -> None:
    """Bytes [a, b) of one direct item: into a CPU target's memory, or through a host chunk into
    a device target (copied on this thread's stream; the chunk goes back once the copy has
    landed, :mod:`.read_copies`, while this thread reads on). A chunk to be summed is summed on
    that device where its CRC is ready (the device-sum thread, after the copy's event), else it
    goes to the summing threads, which lend the host chunk again once both its sum and its copy
    are done."""
    import torch

    target = plan.target
    flat = target.reshape(-1).view(torch.uint8) if target.numel() else target
    offset = plan.span[0] + a
    t = time.perf_counter()
    if target.device.type == "cpu":
        view = direct_read.tensor_bytes(flat[a:b])
        direct_read.pread_into(plan.fd, view, offset, plan.what)
        busy.add("read", t)
        sums.chunk(plan, offset, view)
        return
    chunks = host_chunks(settings.threads, settings.checksum_threads)
    buf = chunks.take()
    handed_over = False
    try:
        n = b - a
        view = direct_read.tensor_bytes(buf[:n])
        direct_read.pread_into(plan.fd, view, offset, plan.what)
        busy.add("read", t)
        stream = thread_stream(target.device)
        with torch.cuda.stream(stream):
            flat[a:b].copy_(buf[:n], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        if plan.summed and not sums.on_device(plan, target.device):
            sums.chunk(plan, offset, view,
                       then=partial(release_when_copied, copied, chunks, buf, busy))
            handed_over = True
        else:
            handed_over = True
            try:  # the host's share of the sum reads the chunk before it can go back
                if plan.summed:
                    sums.device_chunk(plan, offset, flat[a:b], copied, view)
            finally:
                in_flight(copied, chunks, buf, busy)
    finally:
        if not handed_over:
            chunks.give(buf)


RELEASE_PACE_S = 0.005  # between two chunks' frees (direct_read.PinnedChunks.release_shared)


def release_read_chunks() -> threading.Thread | None:
    """The storage read's kept host chunks (pinned: 16 x 64 MiB a rank at one rank a host, 24
    where a load summed on the host) released one at a time on a thread of their own, where a
    load left them; called when a save's copies have landed and at each commit, since a
    training job loads before it saves. None where there were none."""
    if not direct_read.PinnedChunks.kept():
        return None
    thread = threading.Thread(target=direct_read.PinnedChunks.release_shared,
                              args=(RELEASE_PACE_S,), daemon=True,
                              name="mcx-release-read-chunks")
    thread.start()
    return thread


def pin_chunks_ahead(threads: int, checksum_threads: int) -> threading.Thread:
    """Before a load that reads storage with ``threads`` reading and ``checksum_threads``
    summing threads onto a device: the pinned host chunks its reads will copy through are made
    on a thread of their own (``mcx-pin-ahead``), so the load takes them made: the reading
    threads' two each. A summing thread's chunk is needed only where a verifying load sums on
    the host (no device CRC on this device): the load makes those as it asks (8 x 64 MiB a rank
    at one rank a host, pinned and released for nothing in the usual case otherwise)."""
    pool = host_chunks(threads, checksum_threads)
    thread = threading.Thread(target=pool.make_ahead, args=(2 * threads,), daemon=True,
                              name="mcx-pin-ahead")
    thread.start()
    return thread


@contextlib.contextmanager
def _item_stream(reader: Any, req: Any) -> Iterator[Any]:
    item_md = reader.storage_data[req.storage_index]
    path = reader.fs.concat_path(reader.path, item_md.relative_path)
    with reader.fs.create_stream(path, "rb") as stream:
        data = reader._slice_file(stream, item_md)
        transforms = getattr(reader, "transforms", None)
        if transforms is not None:
            data = transforms.transform_load_stream(req, item_md.transform_descriptors or (), data)
        yield data


def _read_tensor(reader: Any, planner: Any, req: Any, lock: threading.Lock) -> None:
    import torch
    from torch.distributed.checkpoint import filesystem

    with _item_stream(reader, req) as data:
        if not data.seekable():
            data = io.BytesIO(data.read(-1))
        tensor = torch.load(data, map_location="cpu", weights_only=True)
    tensor = filesystem.narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    with lock:  # the planner's bookkeeping is not ours to make thread-safe
        target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs "
                             f"{tensor.size()}")
    target.copy_(tensor)
    with lock:
        planner.commit_tensor(req, target)
