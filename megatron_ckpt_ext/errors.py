"""The package's exceptions, under one base class.

Catch :class:`CkptError` for anything the plugin raises on purpose. Each error also derives from
the matching builtin (``ValueError`` for a bad option, ``ImportError`` for a missing backend,
...), so ``except ValueError`` and the like catch it too. Every message names the fix.
A leaf: imports nothing from the package, so any module (and a spawned writer) can import it.

The rule for every deliberate ``raise`` in the package: a failure of checkpointing (an option, a
backend, a save, a load, the machine's limits) raises one of the classes below. A plain builtin
is the documented contract only where Python's own conventions make it one, and only these:

* ``ValueError`` / ``TypeError`` / ``KeyError``: a bad argument to a public call (a state dict
  holding a plain tensor, a model or optimizer :mod:`megatron_ckpt_ext.fsdp` cannot shard, a loaded
  mapping that lacks an entry, ``extra=`` of :meth:`CkptOptions.from_config`);
* ``RuntimeError``: a call made in a state that does not allow it (a closed Checkpointer or
  stager, ``wrap_fsdp`` without an initialised process group);
* ``OSError``: what the operating system refuses (a file cut short under a read, the open-files
  limit);
* a protocol's own type: ``AttributeError`` from a module ``__getattr__``, argparse's
  ``ArgumentTypeError``, ``queue.Empty``, ``SystemExit`` from a command line;
* the backend's own type where we run a copy of its code path (torch DCP's ``AssertionError`` for
  a read whose size differs from its target), so callers see what the stock path raises;
* internal types caught inside the package before a caller can see them (the direct reader's
  ``UnpicklingError``/``BadZipFile``, which send an item to the stock reader).

``tests/unit/test_errors.py`` lists every builtin raise by module, so adding one is deliberate.
"""

from __future__ import annotations

__all__ = [
    "BackendMismatch",
    "BackendUnavailable",
    "CheckpointIntegrityError",
    "CheckpointLoadError",
    "CheckpointNotFound",
    "CheckpointWriteError",
    "CkptError",
    "CkptOptionsError",
    "InsufficientHostMemory",
    "InsufficientSharedMemory",
    "MegatronAdapterError",
    "SaveDirectoryInUse",
    "SnapshotInUse",
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
    """A save failed on some rank: its writer died, its write or commit raised, it outlived
    ``--ckpt-timeout``, or one of its collectives did not complete within
    ``--distributed-timeout-minutes``. Raised on every rank (a collective's timeout: on each rank
    that waited); the previous committed checkpoint stays the latest."""


class CheckpointIntegrityError(CkptError, ValueError):
    """A checkpoint's files do not match its integrity manifest (flipped bits, a truncated or
    missing file); the message names each file. The check runs beside the load, so the target
    tensors may already hold the bad values: do not train on them."""


class CheckpointLoadError(CkptError, RuntimeError):
    """A load failed on some rank for a reason other than a missing or damaged checkpoint: one
    of its collectives did not complete within ``--distributed-timeout-minutes`` (a rank did not
    reach it), or the checkpoint does not fit the state the job built (a tensor of another
    global shape, or one the checkpoint lacks: another model). The targets may hold part of
    the checkpoint: do not train on them."""


class CheckpointNotFound(CkptError, FileNotFoundError):
    """The checkpoint to load is not there (the tracker names a deleted directory, or one that
    was never committed); the message names it and what can be loaded instead."""


class SaveDirectoryInUse(CkptError, RuntimeError):
    """Another job holds the ``--save`` directory (its lock file names the host, pid and start
    time): two jobs saving into one directory replace each other's checkpoints."""


class SnapshotInUse(CkptError, OSError):
    """A sealed memory snapshot another live process maps (the job that sealed it still runs, or
    its writer): another job never adopts it (its saves would stage into that job's buffers) nor
    frees it; its load reads storage instead (the reason goes into the load's tier line)."""


class StagingFailed(CkptError, RuntimeError):
    """The trainer could not complete a save's staging copies; the writer wrote nothing."""


class MegatronAdapterError(CkptError, RuntimeError):
    """megatron.training cannot be hooked here; the message names the version and the seam."""
