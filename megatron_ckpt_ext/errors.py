"""The package's exceptions, under one base class.

Catch :class:`CkptError` for anything the plugin raises on purpose. Each error also derives from
the matching builtin (``ValueError`` for a bad option, ``ImportError`` for a missing backend,
...), so ``except ValueError`` and the like catch it too. Every message names the fix.
A leaf: imports nothing from the package, so any module (and a spawned writer) can import it.
"""

from __future__ import annotations

__all__ = [
    "BackendMismatch",
    "BackendUnavailable",
    "CheckpointIntegrityError",
    "CheckpointNotFound",
    "CheckpointWriteError",
    "CkptError",
    "CkptOptionsError",
    "InsufficientHostMemory",
    "InsufficientSharedMemory",
    "MegatronAdapterError",
    "SaveDirectoryInUse",
    "StagingFailed",
]


class CkptError(Exception):
    """Base class of every error megatron-ckpt-ext raises on purpose."""


class CkptOptionsError(CkptError, ValueError):
    """A checkpointing option is invalid; the message names the flag/key and the fix."""


class BackendUnavailable(CkptError, ImportError):
    """A backend piece cannot be used here; the message says how to fix the environment."""


class BackendMismatch(CkptError, RuntimeError):
    """The installed backends import but disagree (e.g. a request field one of them does not
    know); the fix is matching versions, not an installation."""


class InsufficientHostMemory(CkptError, OSError):
    """A node's memory cannot hold what its ranks will stage for a save (the node-wide sum
    against MemAvailable or the container's memory limit): a limit of the machine, not a bad
    option; the message names the node, the bytes needed and available, and the fix."""


class InsufficientSharedMemory(InsufficientHostMemory):
    """Shared memory (/dev/shm) cannot hold the staging buffers: a limit of the machine or
    container, not a bad option; the message names the bytes needed and free, and the fix."""


class CheckpointWriteError(CkptError, RuntimeError):
    """An async save failed on some rank: its writer died, its write raised, or it outlived
    ``--ckpt-timeout``. Raised on every rank; the previous committed checkpoint stays the latest."""


class CheckpointIntegrityError(CkptError, ValueError):
    """A checkpoint's files do not match its integrity manifest (flipped bits, a truncated or
    missing file); the message names each file. The check runs beside the load, so the target
    tensors may already hold the bad values: do not train on them."""


class CheckpointNotFound(CkptError, FileNotFoundError):
    """The checkpoint to load is not there (the tracker names a deleted directory, or one that
    was never committed); the message names it and what can be loaded instead."""


class SaveDirectoryInUse(CkptError, RuntimeError):
    """Another job holds the ``--save`` directory (its lock file names the host, pid and start
    time): two jobs saving into one directory replace each other's checkpoints."""


class StagingFailed(CkptError, RuntimeError):
    """The trainer could not complete a save's staging copies; the writer wrote nothing."""


class MegatronAdapterError(CkptError, RuntimeError):
    """megatron.training cannot be hooked here; the message names the version and the seam."""
