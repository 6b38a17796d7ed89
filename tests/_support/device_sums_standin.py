"""A CUDA device stood in for by the CPU for a restore from memory that sums on the device
(``MCX_RESTORE_SUMS=device``, staging/restore_sums.py), shared by the unit tests and the 2-rank
workers: pinning always succeeds, the device CRC is "ready", direct copies are host copies,
the device CRC's torch operations sum the targets on the CPU."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["install"]


class _Cudart:
    def cudaHostUnregister(self, ptr: int) -> int:
        return 0


def install(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Put the stand-ins in place with ``setattr_`` (pytest's ``monkeypatch.setattr``, or
    :func:`setattr` in a rank process that ends after the test)."""
    from megatron_ckpt_ext import _crc_device
    from megatron_ckpt_ext.staging import restore_copy, sealing

    setattr_(sealing, "_register", lambda t, n: True)
    setattr_(torch.cuda, "cudart", lambda: _Cudart())
    setattr_(_crc_device, "warm_up", lambda device: False)
    setattr_(restore_copy, "cuda_device", lambda: 0)
    setattr_(restore_copy, "use_device", lambda device: None)
    setattr_(restore_copy, "_direct_ok", lambda src, dst: bool(src.numel()))
    setattr_(restore_copy, "usable", lambda device: True)
    setattr_(restore_copy, "_issue_direct",
             lambda jobs: [dst.copy_(src) for src, _, dst in jobs])
