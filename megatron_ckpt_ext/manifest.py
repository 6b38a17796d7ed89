"""The integrity manifest: a CRC-32 of every file of a checkpoint, committed with it.

Writers record each data file's checksum while its bytes pass through them (no second read) as
one small record under ``<dir>/.mcx_sums/``; at the commit rank 0 folds them, plus the checksums
of the small files megatron-core's finalize wrote, into ``<dir>/mcx_manifest.json`` before the
directory is renamed, so the manifest is committed atomically with the checkpoint. Stock
megatron-core and torch DCP ignore the extra file; a checkpoint without it loads unverified.
Standard library only: a writer process imports it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ._crc import crc32
from .errors import CheckpointIntegrityError

__all__ = ["ALGORITHM", "MANIFEST", "MARKER", "SUMS_DIR", "ManifestError", "Problem",
           "crc32_combine", "file_crc32", "read_manifest", "record_sum", "tiled_crc32",
           "verify_files", "write_manifest", "write_marker"]

MANIFEST = "mcx_manifest.json"
MARKER = ".mcx_checkpoint"  # written at the commit: this directory is ours, manifest or not
SUMS_DIR = ".mcx_sums"
ALGORITHM = "crc32"
FORMAT = "megatron-ckpt-ext/manifest/2"  # /2: the manifest carries its own CRC-32
_FORMATS = ("megatron-ckpt-ext/manifest/1", FORMAT)
_SELF = "manifest_crc32"
_UNSET = "00000000"
_CHUNK = 16 << 20  # bytes read per call when verifying (the CRC releases the GIL on large buffers)
_SMALL = 256 << 20  # files no writer summed are summed at the commit only up to this size


def record_sum(path: str, nbytes: int, crc: int) -> None:
    """In a writer: the checksum of the data file ``path`` it has just written and closed."""
    folder = Path(path).parent / SUMS_DIR
    folder.mkdir(exist_ok=True)
    record = folder / f"{Path(path).name}.json"
    tmp = record.with_name(f".{record.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"file": Path(path).name, "bytes": nbytes, "crc32": crc}))
    os.replace(tmp, record)


def write_marker(workdir: Path, iteration: int) -> None:
    """Rank 0, at the commit, before the manifest (which then lists it): the mark that the
    plugin wrote ``workdir``, so a checkpoint whose manifest was deleted is told apart from a
    stock one (which loads unverified). Same bytes for the same iteration in every run."""
    (workdir / MARKER).write_text(json.dumps({"written_by": "megatron-ckpt-ext",
                                              "iteration": iteration}) + "\n")


def write_manifest(workdir: Path, iteration: int) -> dict:
    """Rank 0, at the commit: fold the writers' records and the checksums of the small files
    nobody summed into ``workdir/mcx_manifest.json``; the records' folder goes. Files larger
    than 256 MiB that no writer summed are listed under ``unverified``."""
    summed = {}
    sums = workdir / SUMS_DIR
    for record in sorted(sums.glob("*.json")) if sums.is_dir() else []:
        entry = json.loads(record.read_text())
        summed[entry["file"]] = {"bytes": entry["bytes"], "crc32": entry["crc32"]}
    files, unverified = {}, []
    for path in sorted(p for p in workdir.iterdir() if p.is_file() and p.name != MANIFEST):
        if path.name in summed:
            files[path.name] = summed[path.name]
        elif path.stat().st_size <= _SMALL:
            files[path.name] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
        else:
            unverified.append(path.name)
    data = {"format": FORMAT, "iteration": iteration, "algorithm": ALGORITHM, "files": files,
            "unverified": unverified}
    tmp = workdir / f".{MANIFEST}.tmp"
    tmp.write_text(_sealed(data))
    os.replace(tmp, workdir / MANIFEST)
    shutil.rmtree(sums, ignore_errors=True)
    return data


class ManifestError(CheckpointIntegrityError):
    """The manifest itself is damaged (unreadable, or its bytes do not match its own CRC-32): a
    checkpoint that cannot be verified (a ValueError too, through its base)."""


def _sealed(data: dict) -> str:
    """``data`` as JSON with ``manifest_crc32``: the CRC-32 of that very text with the field's
    value written as eight zeros, so a change of any byte of the file is detected."""
    text = json.dumps({**data, _SELF: _UNSET}, indent=1, sort_keys=True)
    field = f'"{_SELF}": "{_UNSET}"'
    return text.replace(field, f'"{_SELF}": "{crc32(text.encode()):08x}"', 1)


def read_manifest(checkpoint: Path) -> dict | None:
    """The manifest of a committed checkpoint directory, or None (a stock checkpoint). Raises
    ManifestError when the manifest is damaged."""
    try:
        raw = (Path(checkpoint) / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ManifestError(f"{MANIFEST} is not readable JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") not in _FORMATS:
        raise ManifestError(f"{MANIFEST} has no known format")
    stored = data.get(_SELF)
    if stored is None and data["format"] != _FORMATS[0]:
        raise ManifestError(f"{MANIFEST} has lost its own checksum ({_SELF})")
    if stored is not None:
        unset = text.replace(f'"{_SELF}": "{stored}"', f'"{_SELF}": "{_UNSET}"', 1)
        if f"{crc32(unset.encode()):08x}" != stored:
            raise ManifestError(f"{MANIFEST} does not match its own CRC-32 ({_SELF})")
    files = data.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int)
            and isinstance(v.get("crc32"), int) for v in files.values()):
        raise ManifestError(f"{MANIFEST} lists its files in an unknown shape")
    return data


def file_crc32(path: Path, progress: Callable[[int], None] | None = None) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as fh:
        while True:
            chunk = fh.read(_CHUNK)
            if not chunk:
                return crc
            crc = crc32(chunk, crc)
            if progress is not None:
                progress(len(chunk))


_LOADED = (".distcp", ".metadata", "common.pt", "metadata.json")  # what megatron-core reads


def unlisted(checkpoint: Path, manifest: dict) -> list[Problem]:
    """Files megatron-core would read from ``checkpoint`` that its manifest does not list
    (added after the commit: a stray ``common.pt`` changes what a load returns)."""
    listed = set(manifest["files"]) | set(manifest.get("unverified", []))
    return [Problem(p.name, "not in the manifest (added after the commit?)")
            for p in sorted(Path(checkpoint).iterdir())
            if p.is_file() and p.name.endswith(_LOADED) and p.name not in listed]


# -- CRC-32 of a file from the CRC-32s of its pieces (a loader that read every byte sums them as
# they pass, on several threads, then folds the pieces in file order) -----------------------------
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order, as zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.lru_cache(maxsize=None)
def _x2n(k: int) -> int:
    """x^(2^k) modulo the polynomial."""
    return 1 << 30 if k == 0 else _multmodp(_x2n(k - 1), _x2n(k - 1))


@functools.lru_cache(maxsize=4096)
def _shift_op(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what moves a CRC past ``nbytes`` zero bytes."""
    p, n, k = 1 << 31, nbytes, 3
    while n:
        if n & 1:
            p = _multmodp(_x2n(k % 32), p)
        n >>= 1
        k += 1
    return p


def _libz_combine() -> Callable[[int, int, int], int] | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
        fn = lib.crc32_combine64
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64), ctypes.c_ulong
    return lambda a, b, n: int(fn(a, b, n)) & 0xFFFFFFFF


_LIBZ: list = []


def crc32_combine(crc1: int, crc2: int, len2: int, *, pure: bool = False) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's own when it exports it,
    else the same arithmetic in Python)."""
    if not _LIBZ:
        _LIBZ.append(_libz_combine())
    if _LIBZ[0] is not None and not pure:
        return _LIBZ[0](crc1, crc2, len2)
    return _multmodp(_shift_op(len2), crc1) ^ crc2


def tiled_crc32(pieces: Iterable[tuple[int, int, int]], size: int) -> int | None:
    """The CRC-32 of a ``size``-byte file from ``(offset, length, crc32)`` pieces, or None when
    they do not cover it exactly (a gap, an overlap, or a byte past the end)."""
    crc, at = 0, 0
    for offset, length, piece in sorted(pieces):
        if offset != at:
            return None
        crc = crc32_combine(crc, piece, length) if at else piece
        at += length
    return crc if at == size else None


@dataclass(frozen=True)
class Problem:
    """One file of a checkpoint that does not match its manifest."""

    file: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}: {self.why}"


def verify_files(checkpoint: Path, manifest: dict, names: Iterable[str] | None = None, *,
                 workers: int = 8, progress_every_s: float | None = None,
                 log: Callable[[str], None] = print) -> list[Problem]:
    """Check ``names`` (default: every file of ``manifest``) against the manifest, ``workers``
    files at a time; a line of progress every ``progress_every_s`` seconds through ``log``."""
    entries = manifest["files"]
    names = sorted(entries if names is None else names)
    total = sum(entries[n]["bytes"] for n in names)
    done = [0]
    lock = threading.Lock()
    started = last = time.monotonic()

    def advance(n: int) -> None:
        nonlocal last
        with lock:
            done[0] += n
            now = time.monotonic()
            if progress_every_s is not None and now - last >= progress_every_s:
                last = now
                log(f"verified {done[0] / 1e9:.2f} / {total / 1e9:.2f} GB "
                    f"({done[0] / max(now - started, 1e-9) / 1e9:.2f} GB/s)")

    def check(name: str) -> Problem | None:
        path, want = Path(checkpoint) / name, entries[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return Problem(name, "missing")
        if size != want["bytes"]:
            return Problem(name, f"{size} bytes, the manifest says {want['bytes']}")
        got = file_crc32(path, advance)
        if got != want["crc32"]:
            return Problem(name, f"CRC-32 {got:08x}, the manifest says {want['crc32']:08x}")
        return None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        found = list(pool.map(check, names))
    return [p for p in found if p is not None]
