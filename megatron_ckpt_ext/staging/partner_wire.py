"""The wire of partner copies (:mod:`.partner`): length-prefixed JSON headers, a snapshot's
buffers sent from their segments (``socket.sendfile``) and received into new segments, summed
as they arrive."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import threading
from typing import Callable

from .._crc import crc32 as _crc32
from .retained import SealEntry

__all__ = ["PartnerError", "advertised_host", "background_priority", "receive_file", "recv_json",
           "send_entries", "send_json"]

_PIECE = 16 << 20  # bytes sent between two checks for a cancel
_LENGTH = struct.Struct("!Q")
_MAX_HEADER = 256 << 20


class PartnerError(RuntimeError):
    """A copy or fetch that did not complete (said why); nothing was sealed."""


def background_priority() -> None:
    """The calling thread at the lowest CPU priority (nice 19; Linux sets it per thread): the
    copies after a save yield the cores to training."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


def advertised_host() -> str:
    """The address other nodes reach this one at: the interface towards MASTER_ADDR."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def send_json(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_json(sock: socket.socket) -> dict:
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if n > _MAX_HEADER:
        raise PartnerError(f"a header of {n} bytes")
    return json.loads(_recv_exact(sock, n))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PartnerError(f"the peer closed the connection ({got} of {n} bytes)")
        got += k
    return bytes(buf)


def send_entries(sock: socket.socket, entries: list[SealEntry],
                  cancel: Callable[[], bool]) -> None:
    for e in entries:
        if e.path is None or e.nbytes == 0:
            continue
        with open(e.path, "rb") as fh:
            sent = 0
            while sent < e.nbytes:
                if cancel():
                    raise PartnerError("its buffers are being staged into again, or the "
                                       "checkpointer closed")
                n = sock.sendfile(fh, sent, min(_PIECE, e.nbytes - sent))
                if n == 0:
                    raise PartnerError(f"{e.path} ends before its {e.nbytes} bytes")
                sent += n


def receive_file(sock: socket.socket, path: str, nbytes: int) -> int:
    """``nbytes`` from ``sock`` into a new segment at ``path``; their CRC-32. The bytes land in
    a buffer of :data:`_RECEIVE_PIECE` (reused, so it stays in the cache), are summed there and
    written to the segment: no page faults of a fresh mapping (docs/notes/memory.md)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while written (the sweep leaves it alone)
        if nbytes == 0:
            return 0
        os.posix_fallocate(fd, 0, nbytes)  # no room in the node's shared memory: fails now
        buffer = _receive_buffer()
        got, crc = 0, 0
        while got < nbytes:
            want = min(len(buffer), nbytes - got)
            have = 0
            while have < want:
                k = sock.recv_into(buffer[have:want])
                if k == 0:
                    raise PartnerError(f"the peer closed the connection ({got + have} of "
                                       f"{nbytes} bytes)")
                have += k
            crc = _crc32(buffer[:want], crc)
            written = 0
            while written < want:
                written += os.pwrite(fd, buffer[written:want], got + written)
            got += want
        return crc
    except OSError as e:
        raise PartnerError(f"{path}: {e}") from e
    finally:
        os.close(fd)


_RECEIVE_PIECE = 4 << 20
_local = threading.local()


def _receive_buffer() -> memoryview:
    buffer = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = _local.buffer = memoryview(bytearray(_RECEIVE_PIECE))
    return buffer
