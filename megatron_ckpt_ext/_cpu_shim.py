"""CPU device shim: lets the stock megatron-core / nvrx save paths run on CPU-only torch.

The stock save paths synchronise the CUDA device after their device-to-host preload and build
the cross-rank agreement tensors on ``torch.cuda.current_device()``. On a torch built
without CUDA both raise. The shim is kept as small as that allows (checked against megatron-core
0.16.1 + nvrx 0.4.1/0.7.0, the CPU columns of docs/COMPAT.md): it is installed **only when**
``torch.cuda.is_available()`` is False, and then replaces exactly two functions:

* ``torch.cuda.synchronize`` -> no-op (there is no device work to wait for);
* ``torch.cuda.current_device`` -> ``"cpu"``, so agreement tensors are CPU tensors and the
  all-reduce runs over gloo.

On a CUDA build nothing is changed. Worker processes started with ``spawn`` do not inherit the
patch, so work handed to them is wrapped with :func:`call_with_cpu_shim` (picklable), which
installs the shim in whatever process runs it.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["call_with_cpu_shim", "install", "installed"]

_INSTALLED = False


def install() -> bool:
    """Install the shim if CUDA is unavailable; idempotent. True when it is active."""
    global _INSTALLED
    if _INSTALLED:
        return True
    import torch

    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = _synchronize  # type: ignore[assignment]
    torch.cuda.current_device = _current_device  # type: ignore[assignment]
    _INSTALLED = True
    return True


def installed() -> bool:
    return _INSTALLED


def _synchronize(device: Any = None) -> None:
    return None


def _current_device() -> str:
    return "cpu"


def call_with_cpu_shim(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` with the shim installed in this process (for spawned workers)."""
    install()
    return fn(*args, **kwargs)
