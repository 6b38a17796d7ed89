"""A one-rank save that waits for its node's seal (the memory tier), shared by the unit tests of
sealing and of what a restart warms ahead; a byte of a sealed buffer (or any file) flipped."""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron_ckpt_ext import backend
from megatron_ckpt_ext.staging.retained import read_seal, seal_path

__all__ = ["flip_byte", "save_and_wait_for_the_seal"]


def save_and_wait_for_the_seal(ck: Any, root: Any, iteration: int = 1) -> str:
    """Save one tensor as ``iteration`` (one rank), finalize, and wait until the node's seal
    names it; the seal's path."""
    st = backend.sharded_tensor_cls()
    ck.save({"w": st.from_rank_offsets("w", torch.arange(4096.0), replica_id=0)}, root,
            iteration=iteration)
    ck.maybe_finalize(blocking=True)
    path = seal_path("/dev/shm", root, 0)
    deadline = time.monotonic() + 60
    while getattr(read_seal(path), "iteration", None) != iteration:  # sealed after the commit
        assert time.monotonic() < deadline, "no seal after the commit"
        time.sleep(0.02)
    return path


def flip_byte(path: str, at: int, mask: int = 0xFF) -> None:
    """XOR the byte at offset ``at`` of the file at ``path`` with ``mask`` (a damaged buffer)."""
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ mask]))
