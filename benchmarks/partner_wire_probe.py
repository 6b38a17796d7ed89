"""Probe: how fast a partner copy's bytes cross loopback TCP into a new shared-memory segment,
by receive path, on this host. A forked sender streams a ``--gib`` segment with
``socket.sendfile`` (as staging/partner_wire.py does) once per receive, and the receiver takes it:

- ``floor``: into one reused buffer, nothing else (what the transport gives);
- ``sum``: the same, each piece summed (CRC-32);
- ``pwrite``: the product's path (``partner_wire.receive_file``): reused buffer, summed, written
  into a new segment file;
- ``mmap``: the first version: received straight into a mapping of a new segment, summed there.

    python benchmarks/partner_wire_probe.py --gib 2 --repeats 3 --json $OUT/wire.json
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ckpt_ext._crc import crc32  # noqa: E402
from megatron_ckpt_ext.staging.partner_wire import receive_file  # noqa: E402

PIECE = 16 << 20


def sender(port: int, path: str, nbytes: int, times: int) -> None:
    for _ in range(times):
        with socket.create_connection(("127.0.0.1", port)) as sock, open(path, "rb") as fh:
            sent = 0
            while sent < nbytes:
                sent += sock.sendfile(fh, sent, min(PIECE, nbytes - sent))
            sock.recv(1)  # the receiver is done


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k


def take(variant: str, sock: socket.socket, nbytes: int, out: str) -> None:
    if variant == "pwrite":
        receive_file(sock, out, nbytes)
        return
    if variant == "mmap":
        fd = os.open(out, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.posix_fallocate(fd, 0, nbytes)
            with mmap.mmap(fd, nbytes) as mapped:
                view, crc = memoryview(mapped), 0
                for start in range(0, nbytes, PIECE):
                    part = view[start:min(start + PIECE, nbytes)]
                    recv_exact_into(sock, part)
                    crc = crc32(part, crc)
                    part.release()
                view.release()
        finally:
            os.close(fd)
        return
    buf = memoryview(bytearray(4 << 20))
    got, crc = 0, 0
    while got < nbytes:
        want = min(len(buf), nbytes - got)
        recv_exact_into(sock, buf[:want])
        if variant == "sum":
            crc = crc32(buf[:want], crc)
        got += want


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    nbytes = int(args.gib * 2**30)
    src = os.path.join(args.dir, f"mcxprobe_wire_src_{os.getpid()}")
    with open(src, "wb") as fh:
        for _ in range(0, nbytes, PIECE):
            fh.write(os.urandom(min(PIECE, nbytes - fh.tell())))
    variants = ["floor", "sum", "pwrite", "mmap"]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    runs = []
    try:
        order = variants * args.repeats
        pid = os.fork()
        if pid == 0:
            try:
                sender(port, src, nbytes, len(order))
            finally:
                os._exit(0)
        for i, variant in enumerate(order):
            conn, _ = server.accept()
            out = os.path.join(args.dir, f"mcxprobe_wire_dst_{os.getpid()}_{i}")
            t0 = time.perf_counter()
            take(variant, conn, nbytes, out)
            seconds = time.perf_counter() - t0
            conn.sendall(b"k")
            conn.close()
            if os.path.exists(out):
                os.unlink(out)
            runs.append({"variant": variant, "seconds": round(seconds, 4),
                         "gbps": round(nbytes / 1e9 / seconds, 3)})
            print(runs[-1], flush=True)
        os.waitpid(pid, 0)
    finally:
        os.unlink(src)
        server.close()
    summary = {v: statistics.median(r["gbps"] for r in runs if r["variant"] == v)
               for v in variants}
    Path(args.json).write_text(json.dumps({"bytes": nbytes, "cpus": os.cpu_count(),
                                           "command": " ".join(sys.argv), "runs": runs,
                                           "median_gbps": summary}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
