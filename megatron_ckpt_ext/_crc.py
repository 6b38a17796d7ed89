"""The CRC-32 every checksum of the package uses: zlib's polynomial and values (manifests written
with either verify with either), computed by ISA-L (``isal``) where it is installed, several
times faster per core than zlib's and, like zlib's, without holding the GIL on large buffers."""

from __future__ import annotations

import zlib

__all__ = ["IMPLEMENTATION", "crc32"]

try:
    from isal.isal_zlib import crc32 as _fast
except ImportError:  # the package works without it, at zlib's rate
    _fast = None

crc32 = _fast if _fast is not None else zlib.crc32
IMPLEMENTATION = "isal" if _fast is not None else "zlib"
