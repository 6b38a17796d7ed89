"""Parallel reads for megatron-core's torch_dist load: the reader megatron-core builds (by its
module-level ``_get_filesystem_reader``) reads its items on a pool of threads instead of one after
another, each item in its own file stream. File reads and the copy into the target tensor release
the GIL, so reads, unpickling and host-to-device copies of different items overlap. The items,
the planner and the checks are torch DCP's own; only the loop is parallel."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from ._imports import MCORE_STRATEGIES

__all__ = ["parallel_reads"]

logger = logging.getLogger("megatron_ckpt_ext.backend")

_NEEDED = ("storage_data", "fs", "path", "_slice_file")


@contextlib.contextmanager
def parallel_reads(threads: int) -> Iterator[str | None]:
    """While inside, megatron-core's torch_dist loads read with ``threads`` threads. Yields None
    when applied, else why not (the load then runs as megatron-core's own)."""
    try:
        module = importlib.import_module(f"{MCORE_STRATEGIES}.torch")
    except ImportError as e:
        yield f"megatron-core's torch strategy does not import ({e})"
        return
    original = getattr(module, "_get_filesystem_reader", None)
    if original is None or threads <= 1:
        yield ("this megatron-core builds its reader without _get_filesystem_reader"
               if original is None else "one read thread asked for")
        return

    def parallel_reader(*args: Any, **kwargs: Any) -> Any:
        return _make_parallel(original(*args, **kwargs), threads)

    module._get_filesystem_reader = parallel_reader
    try:
        yield None
    finally:
        module._get_filesystem_reader = original


def _make_parallel(reader: Any, threads: int) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if not isinstance(reader, FileSystemReader) or not all(hasattr(reader, a) for a in _NEEDED):
        logger.info("parallel checkpoint reads do not apply to %s: megatron-core's reader is used",
                    type(reader).__name__)
        return reader
    reader.__class__ = _parallel_class(type(reader))
    reader._mcx_threads = threads
    return reader


_CLASSES: dict[type, type] = {}


def _parallel_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Parallel{base.__name__}", (base,), {"read_data": _read_data})
    return _CLASSES[base]


def _read_data(self: Any, plan: Any, planner: Any) -> Any:
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    lock = threading.Lock()
    tensors = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
    for req in (r for r in plan.items if r.type == LoadItemType.BYTE_IO):
        with _item_stream(self, req) as data:
            planner.load_bytes(req, io.BytesIO(data.read(-1)))
    # largest first, so the pool does not end waiting on one big item
    tensors.sort(key=lambda r: -self.storage_data[r.storage_index].length)
    with ThreadPoolExecutor(max_workers=self._mcx_threads, thread_name_prefix="mcx-read") as pool:
        for done in [pool.submit(_read_tensor, self, planner, req, lock) for req in tensors]:
            done.result()
    fut: Future = Future()
    fut.set_result(None)
    return fut


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
