"""zlib's CRC-32 of bytes that are in a device's memory, computed there (torch operations only, so
the same code runs, slower, on a CPU tensor: that is how it is tested against zlib).

A load that copies a checkpoint's bytes to the device can check them there instead of summing
them on the host, whose cores are busy reading the page cache: the sums then cost the host
nothing and check the bytes as they landed. Values are zlib's (the manifests' own), so nothing
written so far changes.

How: CRC-32 is affine over GF(2). With ``L`` the linear part (the register started at 0, no final
xor), ``crc32(M) = L(M) ^ crc32(zeros(len(M)))``, and ``L`` of a block is the XOR over its bytes
of a table entry per (position, byte value). Level 0 cuts the bytes into blocks of ``BLOCK``
bytes (the first one padded at its front with zeros, which ``L`` ignores) and reduces each block
to its ``L`` by one gather and a halving XOR; each next level treats ``FAN_IN`` consecutive values
of the level below as ``4 * FAN_IN`` bytes and does the same with tables that move each value
past the blocks after it. A few levels bring any length to one value; the constant for the
length is added on the host (:func:`finish`).

A load sums many chunks. :class:`SlotSums` gives each chunk's aligned middle (:func:`device_span`:
16-byte aligned, a multiple of ``ALIGN`` bytes) one level-0 launch into a row ("slot") of a
block of ``SLOTS`` rows, right-aligned (the zeros before it add nothing), and folds a whole
block's rows at once (two launches): every launch then has one shape, so the kernel compiled
at warm-up serves every chunk, and the thread that launches holds the GIL briefly per chunk.
The few bytes outside the middle are summed on the host."""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import numpy as np

from ._runtime import rank, warn_once

__all__ = ["ALIGN", "BLOCK", "DeviceCrc", "SLOT_BYTES", "SlotSums", "crc32_tensor", "device_span",
           "finish", "ready", "warm_up", "warm_up_current"]

logger = logging.getLogger(__name__)

BLOCK = 1024  # bytes per level-0 block: a 1 MiB table (1024 positions x 256 values x 4 bytes)
FAN_IN = 256  # values combined per row at the levels above (4 x 256 byte positions: 1 MiB)
_PIECE = 8 << 20  # level 0 works this many bytes at a time (its int32 temporaries: 8x that)
_KERNEL_PIECE = 1 << 30  # bytes per kernel launch at level 0 (its offsets are int32)
_POLY = 0xEDB88320
SLOT = FAN_IN * FAN_IN  # level-0 values per slot (two levels fold it to one value)
SLOT_BYTES = SLOT * BLOCK  # 64 MiB: the most one slot sums
ALIGN = 16 * BLOCK  # a slot's bytes are a multiple of this: its value count a multiple of 16
SLOTS = 32  # slots per block (8 MiB of values on the device)


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ _POLY, t >> 1)
    return t


_TABLE = _byte_table()


def _zero_step(c: np.ndarray) -> np.ndarray:
    """The linear register moved past one zero byte."""
    return _TABLE[(c & 0xFF).astype(np.int64)] ^ (c >> 8)


def _mult(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * b modulo the polynomial (reflected, as zlib's multmodp), element-wise (broadcast)."""
    a, b = np.broadcast_arrays(a.astype(np.uint64), b.astype(np.uint64))
    p = np.zeros_like(b)
    for k in range(32):
        p ^= np.where((a >> np.uint64(31 - k)) & np.uint64(1), b, np.uint64(0))
        b = np.where(b & np.uint64(1), (b >> np.uint64(1)) ^ np.uint64(_POLY), b >> np.uint64(1))
    return p


def _shift_op(nbytes: int) -> int:
    from .manifest import _shift_op as op

    return op(nbytes)


def _spread(cols: np.ndarray) -> np.ndarray:
    """(..., 8) images of a byte's 8 bits -> (..., 256) images of every byte value (linearity)."""
    v = np.arange(256)
    out = np.zeros(cols.shape[:-1] + (256,), dtype=np.uint64)
    for bit in range(8):
        out ^= np.where((v >> bit) & 1, cols[..., bit:bit + 1], np.uint64(0))
    return out


def level0_table() -> np.ndarray:
    """(BLOCK, 256): the linear CRC of a BLOCK-byte block holding value v at position j only."""
    out = np.empty((BLOCK, 256), dtype=np.uint64)
    row = _TABLE.copy()
    for j in range(BLOCK - 1, -1, -1):
        out[j] = row
        row = _zero_step(row)
    return out


def level_table(sub: int) -> np.ndarray:
    """(4 * FAN_IN, 256) for a row of FAN_IN values, each the linear CRC of ``sub`` bytes:
    entry [4 i + b][v] moves byte b (little-endian) of value i, equal to v, past the
    (FAN_IN - 1 - i) * sub bytes after it."""
    bits = np.uint64(1) << np.arange(32, dtype=np.uint64)
    ops = np.array([_shift_op((FAN_IN - 1 - i) * sub) for i in range(FAN_IN)], dtype=np.uint64)
    cols = _mult(ops[:, None], bits[None, :])
    return _spread(cols.reshape(FAN_IN * 4, 8))


def finish(raw: int, nbytes: int) -> int:
    """zlib's CRC-32 of ``nbytes`` bytes whose linear CRC is ``raw``."""
    from .manifest import _multmodp

    zeros = _multmodp(_shift_op(nbytes), 0xFFFFFFFF) ^ 0xFFFFFFFF if nbytes else 0
    return (raw ^ zeros) & 0xFFFFFFFF


class DeviceCrc:
    """The tables on one device; :meth:`linear` enqueues a CRC on the current stream."""

    _cache: dict = {}
    _lock = threading.Lock()

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        self._tables: dict[int, Any] = {}
        self._t0 = self._upload(level0_table())
        self._pos0 = torch.arange(BLOCK, dtype=torch.int32, device=self.device) * 256
        self._posk = torch.arange(4 * FAN_IN, dtype=torch.int32, device=self.device) * 256
        self._tlock = threading.Lock()

    @classmethod
    def on(cls, device: Any) -> "DeviceCrc":
        import torch

        key = str(torch.device(device))
        with cls._lock:
            if key not in cls._cache:
                cls._cache[key] = cls(device)
            return cls._cache[key]

    def _upload(self, table: np.ndarray) -> Any:
        import torch

        flat = table.astype(np.uint32).view(np.int32).reshape(-1)
        return torch.from_numpy(flat.copy()).to(self.device)

    def _table(self, sub: int) -> Any:
        with self._tlock:
            if sub not in self._tables:
                self._tables[sub] = self._upload(level_table(sub))
            return self._tables[sub]

    def _reduce(self, rows: Any, table: Any, pos: Any) -> Any:
        """Per row of uint8 ``rows`` (m, W): the XOR of table[pos + byte] over the row."""
        import torch

        kernel = _kernel() if rows.is_cuda else None
        if kernel is not None and rows.is_contiguous():
            m, w = rows.shape
            out = torch.empty(m, dtype=torch.int32, device=rows.device)
            kernel[(triton_cdiv(m, _ROWS),)](rows, table, out, m, W=w, ROWS=_ROWS)
            return out
        idx = rows.to(torch.int32)
        idx += pos
        g = table[idx]
        w = g.shape[1]
        while w > 1:
            h = w // 2
            g[:, :h] ^= g[:, h:w]
            w = h
        return g[:, 0].contiguous()

    def linear(self, data: Any) -> Any:
        """The linear CRC of the 1-D uint8 tensor ``data`` (on this device), as a one-element int32
        tensor, enqueued on the current stream (nothing waits)."""
        import torch

        n = data.numel()
        head = n % BLOCK
        parts = []
        if head:
            row = torch.zeros(BLOCK, dtype=torch.uint8, device=self.device)
            row[BLOCK - head:] = data[:head]
            parts.append(self._reduce(row.view(1, BLOCK), self._t0, self._pos0))
        # the kernel needs no temporaries: up to 1 GiB at once; torch operations in pieces
        step = _KERNEL_PIECE if data.is_cuda and _kernel() is not None else _PIECE
        for a in range(head, n, max(step, 1)):
            b = min(n, a + step)
            parts.append(self._reduce(data[a:b].view(-1, BLOCK), self._t0, self._pos0))
        if not parts:
            return torch.zeros(1, dtype=torch.int32, device=self.device)
        vals = torch.cat(parts) if len(parts) > 1 else parts[0]
        sub = BLOCK
        while vals.numel() > 1:
            pad = -vals.numel() % FAN_IN
            if pad:
                vals = torch.cat([torch.zeros(pad, dtype=torch.int32, device=self.device), vals])
            rows = vals.view(torch.uint8).view(-1, 4 * FAN_IN)
            vals = self._reduce(rows, self._table(sub), self._posk)
            sub *= FAN_IN
        return vals.reshape(1)

    def level0_into(self, data: Any, out: Any) -> None:
        """Level 0 of the 1-D uint8 ``data`` (a multiple of ``BLOCK`` bytes) written into the
        int32 ``out`` (one value per block), enqueued on the current stream."""
        blocks = data.view(-1, BLOCK)
        if data.is_cuda and _kernel() is not None and out.is_contiguous():
            m = blocks.shape[0]
            if m:
                _kernel()[(triton_cdiv(m, _ROWS),)](blocks, self._t0, out, m, W=BLOCK, ROWS=_ROWS)
            return
        step = _PIECE // BLOCK
        for a in range(0, blocks.shape[0], step):
            out[a:a + step] = self._reduce(blocks[a:a + step], self._t0, self._pos0)

    def fold(self, block: Any) -> Any:
        """(n, SLOT) int32 level-0 values, each row one piece's (right-aligned, zeros before)
        -> (n,) linear CRCs of those pieces, enqueued on the current stream."""
        import torch

        vals, sub = block.reshape(-1), BLOCK
        for _ in range(2):  # SLOT = FAN_IN ** 2 values: two levels
            vals = self._reduce(vals.view(torch.uint8).view(-1, 4 * FAN_IN), self._table(sub),
                                self._posk)
            sub *= FAN_IN
        return vals


def device_span(address: int, nbytes: int) -> tuple[int, int]:
    """(skip, length): the part of ``nbytes`` bytes at ``address`` that :class:`SlotSums` sums,
    from its first 16-byte aligned address, a multiple of ``ALIGN`` bytes long (possibly 0);
    the bytes before and after it are the caller's to sum."""
    skip = min(-address % 16, nbytes)
    return skip, (nbytes - skip) // ALIGN * ALIGN


class SlotSums:
    """Linear CRCs of many device pieces, one slot each (see the module's text): :meth:`add`
    enqueues a piece's level 0 on the current stream and returns its index, :meth:`values`
    returns every piece's raw linear CRC, in index order (one device-to-host transfer)."""

    def __init__(self, crc: DeviceCrc) -> None:
        self.crc = crc
        self._block: Any = None
        self._used = 0
        self._folded: list = []  # (SLOTS,) values per block folded so far
        self._count = 0

    def add(self, data: Any) -> int:
        """``data``: 1-D uint8 on the device, ``device_span``'s kind of piece, <= SLOT_BYTES."""
        import torch

        n = data.numel()
        if n % ALIGN or n > SLOT_BYTES or data.data_ptr() % 16:
            raise ValueError(f"SlotSums.add: a piece of {n} bytes at {data.data_ptr():#x}: "
                             f"not a 16-byte aligned multiple of {ALIGN} up to {SLOT_BYTES}")
        if self._block is None:
            self._block = torch.zeros(SLOTS, SLOT, dtype=torch.int32, device=self.crc.device)
            self._used = 0
        m = n // BLOCK
        self.crc.level0_into(data, self._block[self._used, SLOT - m:])
        self._used += 1
        self._count += 1
        if self._used == SLOTS:
            self._flush()
        return self._count - 1

    def _flush(self) -> None:
        if self._block is not None:
            self._folded.append(self.crc.fold(self._block))
            self._block = None  # freed in stream order: this stream's next use comes after

    def values(self) -> list[int]:
        import torch

        self._flush()
        if not self._folded:
            return []
        got = torch.cat(self._folded).cpu().tolist()
        return [v & 0xFFFFFFFF for v in got[:self._count]]


_ROWS = 4  # rows per Triton program
_KERNEL: list = []


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel() -> Any:
    """The Triton kernel for a level (one program per ``_ROWS`` rows: the bytes loaded once,
    the table gathered from the device's cache, XOR-reduced), or None without Triton (then torch
    operations do the same, with more memory traffic)."""
    if not _KERNEL:
        with _READY_LOCK:
            if not _KERNEL:
                _KERNEL.append(_build_kernel())
    return _KERNEL[0]


def _build_kernel() -> Any:
    from .debug import env_switch

    if env_switch("MCX_DEVICE_CRC_TRITON") != "1":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rows_xor(data, table, out, m, W: tl.constexpr, ROWS: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, W)
        ok = row < m
        b = tl.load(data + row[:, None] * W + col[None, :], mask=ok[:, None], other=0)
        v = tl.load(table + col[None, :] * 256 + b.to(tl.int32))
        tl.store(out + row, tl.xor_sum(v, axis=1), mask=ok)

    return rows_xor


_READY: dict[str, threading.Event] = {}
_READY_LOCK = threading.Lock()


def warm_up(device: Any) -> bool:
    """Start building this device's tables and compiling the kernel (a first compile takes
    seconds; Triton's cache makes later processes' fast) on a thread of their own, once per
    device; True once they are ready (:func:`ready`). Without the kernel: never ready."""
    import torch

    key = str(torch.device(device))
    with _READY_LOCK:
        if key not in _READY:
            _READY[key] = threading.Event()
            threading.Thread(target=_warm, args=(device, _READY[key]), daemon=True,
                             name="mcx-crc-warm-up").start()
    return _READY[key].is_set()


def warm_up_current(options: Any) -> None:
    """:func:`warm_up` for the current CUDA device where loads verify (``ckpt_verify_load``)
    and this process has initialised CUDA already (a CPU job, or one that has not touched CUDA
    yet, is left alone)."""
    import torch

    if options.ckpt_verify_load and torch.cuda.is_available() and torch.cuda.is_initialized():
        warm_up(torch.cuda.current_device())


def ready(device: Any) -> bool:
    """Whether the kernel and tables for ``device`` are ready (warmed up, and Triton present)."""
    import torch

    event = _READY.get(str(torch.device(device)))
    return event is not None and event.is_set()


def _warm(device: Any, done: threading.Event) -> None:
    import torch

    try:
        if _kernel() is None:
            return
        crc = DeviceCrc.on(device)
        with torch.cuda.device(crc.device), torch.cuda.stream(torch.cuda.Stream(crc.device)):
            probe = torch.arange(3 * BLOCK * FAN_IN + 5, device=crc.device).to(torch.uint8)
            crc._table(BLOCK * FAN_IN)  # pieces up to 16 GiB need no more levels
            got = finish(int(crc.linear(probe).item()), probe.numel())
            # the slots' shapes, as a load's chunks give them (compiled here, not in a load)
            slots, cuts = SlotSums(crc), (0, ALIGN, 4 * ALIGN)
            index = [slots.add(probe[a:b]) for a, b in zip(cuts, cuts[1:])]
            values = slots.values()
        pieces_ok = all(finish(values[i], b - a) == _host_crc(probe[a:b].cpu())
                        for i, a, b in zip(index, cuts, cuts[1:]))
        if got != _host_crc(probe.cpu()) or not pieces_ok:
            warn_once(f"device-crc:{device}", f"the device CRC-32 disagrees with zlib's on "
                      f"{device}: verifying loads sum on the host")
            return
        _trim_heap()  # what the compiler freed goes back to the system
        done.set()
    except Exception as e:  # noqa: BLE001 - the host sums stay
        if rank() == 0:
            logger.info("device CRC-32 not available on %s (%s): loads sum on the host",
                        device, e)


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _host_crc(data: Any) -> int:
    import zlib

    return zlib.crc32(data.numpy().tobytes())


def crc32_tensor(data: Any) -> int:
    """zlib's CRC-32 of a 1-D uint8 tensor (waits for the device)."""
    raw = DeviceCrc.on(data.device).linear(data.reshape(-1))
    return finish(int(raw.item()), data.numel())
