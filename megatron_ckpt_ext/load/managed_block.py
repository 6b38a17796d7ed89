"""Device memory that gives way: the copy ahead's block (load/device_ahead.py) held in CUDA managed
memory (``cudaMallocManaged``) and prefetched to the device. The block is taken while the
device is still empty, before Megatron builds the model beside it; in managed memory the driver
evicts its pages to host memory when an ordinary allocation (the caching allocator's
``cudaMalloc``) needs the room, so a model that fits the device only without the block still
builds, and the load then copies the evicted part from host memory, more slowly, but the same
bytes. Measured on one H200 (``benchmarks/probe_managed_block.py``, docs/MEMORY.md thirtieth
session): filled at 51 GB/s from pinned memory (an ordinary block: the same), copied out at
1.3-1.7 TB/s while resident, ordinary allocations 1.8 GB beyond what was free beside a 16 GiB
block succeeded and the block's bytes stayed intact, copied out at 9.6 GB/s once evicted.

The runtime is reached through ``ctypes`` (the ``libcudart`` torch loaded), the calls chosen by
what the runtime has: CUDA 13's and 12.2's ``_v2`` take a ``cudaMemLocation``, older ones a
device number. Where any call fails there is no block (the load copies from host memory)."""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import torch

__all__ = ["free_later", "managed_block"]

logger = logging.getLogger(__name__)

_ATTACH_GLOBAL = 1  # cudaMemAttachGlobal
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice


class _Location(ctypes.Structure):  # cudaMemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Allocation:
    """One managed allocation, seen by torch through ``__cuda_array_interface__``; torch's tensor
    holds a reference, and the memory is freed when the last view of it is gone."""

    def __init__(self, rt: ctypes.CDLL, ptr: int, nbytes: int) -> None:
        self._rt, self.ptr = rt, ptr
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}

    def __del__(self) -> None:  # after the load's copies from it were waited for
        if self.ptr:
            self._rt.cudaFree(ctypes.c_void_p(self.ptr))
            self.ptr = 0


def managed_block(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """``nbytes`` of managed memory resident on the CUDA ``device`` (prefetched there), as a
    uint8 tensor; None where the runtime or the driver does not give it (said at debug level)."""
    try:
        rt = _runtime()
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):  # the allocation's device: torch places the tensor there
            ptr = ctypes.c_void_p()
            rc = rt.cudaMallocManaged(ctypes.byref(ptr), ctypes.c_size_t(nbytes), _ATTACH_GLOBAL)
            if rc or not ptr.value:
                raise RuntimeError(f"cudaMallocManaged returned {rc}")
            owner = _Allocation(rt, ptr.value, nbytes)
            stream = torch.cuda.Stream(device=index)
            rc = _prefetch(rt, ptr.value, nbytes, index, stream.cuda_stream)
            if rc:
                raise RuntimeError(f"cudaMemPrefetchAsync returned {rc}")
            stream.synchronize()
            block = torch.as_tensor(owner, device=f"cuda:{index}")
        if block.data_ptr() != ptr.value:  # torch copied it elsewhere: not the managed memory
            raise RuntimeError("torch did not take the managed allocation as it is")
        return block
    except (OSError, AttributeError, RuntimeError, AssertionError) as e:  # (a CPU-only torch)
        logger.debug("no managed device block for the copy ahead: %s", e)
        return None


def free_later(block: torch.Tensor) -> None:
    """Free a block (its copies out landed) on a thread of its own, after the device's queued
    work, so the load does not wait for it. Freeing a device block took ~7 ms per GB of driver
    time on the thirtieth session's H200s (0.8 ms for 1.88 GB on another), and the load's next
    CUDA calls waited for it there all the same (docs/MEMORY.md)."""
    threading.Thread(target=_drop, args=([block],), name="mcx-managed-free",
                     daemon=True).start()


def _drop(holder: list) -> None:
    torch.cuda.synchronize(holder[0].device)  # nothing still reads or writes it
    holder.clear()  # the last view: cudaFree here


def _prefetch(rt: ctypes.CDLL, ptr: int, nbytes: int, index: int, stream: int) -> int:
    version = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(version))
    args: tuple[Any, ...] = (ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes))
    if version.value >= 13000:  # (location, flags, stream)
        fn, args = rt.cudaMemPrefetchAsync, (*args, _Location(_LOCATION_DEVICE, index), 0)
    elif hasattr(rt, "cudaMemPrefetchAsync_v2"):
        fn, args = rt.cudaMemPrefetchAsync_v2, (*args, _Location(_LOCATION_DEVICE, index), 0)
    else:  # (device, stream)
        fn, args = rt.cudaMemPrefetchAsync, (*args, index)
    return int(fn(*args, ctypes.c_void_p(stream)))


_RUNTIME: list[ctypes.CDLL] = []


def _runtime() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (found in this process's mappings), else by its names."""
    if _RUNTIME:
        return _RUNTIME[0]
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    for name in (*paths, "libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            _RUNTIME.append(ctypes.CDLL(name))
            return _RUNTIME[0]
        except OSError:
            continue
    raise OSError("no CUDA runtime library (libcudart) found in this process")
