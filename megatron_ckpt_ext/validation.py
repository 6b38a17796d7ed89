"""Rules over options and backend capabilities: pure functions returning findings.

:func:`validate` does no I/O: it maps (options, capabilities) to a list of :class:`Finding`.
:func:`check` is the start-up entry point: it raises :class:`CkptOptionsError` listing every error,
and emits each warning once, on rank 0 only (through ``_runtime.warn_once``).

Single-value checks (types, ranges) are in ``options.py`` and already hold for any
:class:`CkptOptions`; this module relates knobs to each other and to the installed backend, so a
user learns at start-up, not at the first save, what will not happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ._runtime import warn_once
from .errors import CkptOptionsError
from .options import CkptOptions

if TYPE_CHECKING:
    from .backend import Capabilities

__all__ = ["Finding", "check", "check_fsdp", "validate"]


@dataclass(frozen=True)
class Finding:
    level: str  # "warning" | "error"
    code: str  # stable id, also the warn-once key
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


Rule = Callable[[CkptOptions, "Capabilities | None"], Iterable[Finding]]


def _warn(code: str, message: str) -> Finding:
    return Finding("warning", code, message)


def _error(code: str, message: str) -> Finding:
    return Finding("error", code, message)


# -- rules over options alone ---------------------------------------------------------------
def _workers_with_async(o: CkptOptions, caps: Any) -> Iterable[Finding]:
    if o.async_save and o.dist_ckpt_workers > 1:
        yield _warn(
            "async-forked-writers",
            f"--async-save with --dist-ckpt-workers {o.dist_ckpt_workers} forks writer "
            "processes for every save (CUDA context and pinned-memory hazards under fork). "
            "The default --dist-ckpt-workers 1 writes sequentially in one process; use more "
            "workers only if one writer cannot saturate your storage.",
        )


def _shm_without_constant(o: CkptOptions, caps: Any) -> Iterable[Finding]:
    if o.async_save and o.async_ckpt_use_cpu_shm and not o.ckpt_assume_constant_structure:
        yield _warn(
            "shm-not-reused",
            "--async-ckpt-use-cpu-shm without --ckpt-assume-constant-structure re-creates the "
            "shared-memory staging buffers at every save, which is costly; add "
            "--ckpt-assume-constant-structure (the cache re-validates itself every save).",
        )


def _shm_without_async(o: CkptOptions, caps: Any) -> Iterable[Finding]:
    if o.async_ckpt_use_cpu_shm and not o.async_save:
        yield _warn(
            "shm-no-effect",
            "--async-ckpt-use-cpu-shm has no effect without --async-save; add --async-save "
            "or drop the flag.",
        )


def _persistent_without_async(o: CkptOptions, caps: Any) -> Iterable[Finding]:
    if o.use_persistent_ckpt_worker and not o.async_save:
        yield _warn(
            "persistent-no-effect",
            "--use-persistent-ckpt-worker has no effect without --async-save; add --async-save "
            "or drop the flag.",
        )


def _overlap_snapshot(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if not o.ckpt_overlap_snapshot:
        return
    missing = [flag for flag, on in (("--async-save", o.async_save),
                                      ("--async-ckpt-use-cpu-shm", o.async_ckpt_use_cpu_shm),
                                      ("--use-persistent-ckpt-worker",
                                       o.use_persistent_ckpt_worker)) if not on]
    if missing:
        yield _warn(
            "overlap-snapshot-no-effect",
            "--ckpt-overlap-snapshot has no effect without " + ", ".join(missing) + ": only "
            "copies staged in shared memory and handed to a long-lived writer can run after "
            "save() returns (a fresh writer process is forked only once they are done). Add "
            "them or drop the flag.",
        )
    elif caps is not None and not caps.cuda_available:
        yield _warn(
            "overlap-snapshot-no-cuda",
            "--ckpt-overlap-snapshot: this process has no CUDA device; host tensors are copied "
            "inside save(), so there is nothing to overlap. Drop the flag on CPU-only runs.",
        )


def _priorities_without_async(o: CkptOptions, caps: Any) -> Iterable[Finding]:
    asked = [f for f, v in (("--async-ckpt-cpu-priority", o.async_ckpt_cpu_priority),
                            ("--async-ckpt-io-priority", o.async_ckpt_io_priority)) if v is not None]
    if asked and not o.async_save:
        yield _warn(
            "priority-no-effect",
            f"{' and '.join(asked)} only apply to the async worker; add --async-save or drop them.",
        )


# -- rules over options and the installed backend --------------------------------------------
def _backend_unusable(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if caps is not None and not caps.mcore_dist_ckpt_importable:
        yield _error(
            "mcore-dist-ckpt-unusable",
            f"megatron.core.dist_checkpointing cannot be imported here: {caps.mcore_error}",
        )


def _async_provider(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if caps is None or not o.async_save or caps.async_provider == "nvrx":
        return
    if caps.async_provider == "mcore":
        yield _warn(
            "async-via-mcore",
            f"--async-save: nvidia-resiliency-ext is not usable here ({caps.nvrx_error}); async "
            f"saves use megatron-core {caps.mcore_version}'s built-in async path instead.",
        )
    else:
        yield _warn(
            "async-unavailable",
            f"--async-save: neither nvidia-resiliency-ext ({caps.nvrx_error}) nor megatron-core "
            f"{caps.mcore_version} provides async checkpointing here; saves run synchronously. "
            "Install nvidia-resiliency-ext>=0.4 to enable it.",
        )


def _persistent_worker(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if caps is None or not (o.async_save and o.use_persistent_ckpt_worker):
        return
    if not caps.queue_persistent:
        yield _warn(
            "persistent-unsupported",
            f"--use-persistent-ckpt-worker: the installed async backend ({_versions(caps)}) has no "
            "persistent worker; a fresh writer process is used per save. Upgrade "
            "nvidia-resiliency-ext to >= 0.4 for it.",
        )


def _shm_worker_context(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if caps is None or not (o.async_save and o.async_ckpt_use_cpu_shm and caps.cuda_available):
        return
    if o.use_persistent_ckpt_worker and caps.queue_persistent and not caps.queue_cpu_shm_mode:
        yield _warn(
            "shm-worker-cuda-context",
            f"--async-ckpt-use-cpu-shm: staging into CPU shared memory is done by this plugin, but "
            f"nvidia-resiliency-ext {caps.nvrx_version} has no cpu_shm_mode, so its persistent "
            "worker still creates a CUDA context. Upgrade nvidia-resiliency-ext to >= 0.7.0 to "
            "keep CUDA out of the worker.",
        )


def _priorities_supported(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    asked = o.async_ckpt_cpu_priority is not None or o.async_ckpt_io_priority is not None
    if caps is not None and o.async_save and asked and not caps.queue_priorities:
        yield _warn(
            "priority-unsupported",
            f"--async-ckpt-cpu-priority/--async-ckpt-io-priority: the installed async backend "
            f"({_versions(caps)}) cannot set worker priorities; they are ignored. Upgrade "
            "nvidia-resiliency-ext to >= 0.7.0.",
        )


def _cached_metadata(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if caps is not None and o.ckpt_assume_constant_structure and not caps.strategy_cached_metadata:
        yield _warn(
            "cached-metadata-unsupported",
            f"--ckpt-assume-constant-structure: megatron-core {caps.mcore_version} cannot cache "
            "the save plan/metadata; staging buffers are still reused. Upgrade megatron-core.",
        )


def _fully_parallel_load_needs_cuda(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if caps is not None and o.ckpt_fully_parallel_load and not caps.cuda_available:
        yield _warn(
            "fully-parallel-load-needs-cuda",
            "fully parallel load (--ckpt-fully-parallel-load, or a config's fully_parallel_load,"
            " on by default there): megatron-core exchanges the loaded shards on CUDA, which "
            "this process does not have, so loads run without it (each rank reads what it "
            "needs; nothing is lost). To silence this on CPU-only runs: drop the flag, or set "
            "fully_parallel_load: false.",
        )


def _symm_mem(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    if not o.fsdp_use_symm_mem or caps is None:
        return
    if not caps.cuda_available:
        yield _error(
            "symm-mem-needs-cuda",
            "--fsdp-use-symm-mem needs CUDA and at least 2 GPUs; this process has no CUDA "
            "device. Drop the flag for CPU runs.",
        )
    elif not caps.fsdp_symm_mem:
        yield _warn(
            "symm-mem-unsupported",
            f"--fsdp-use-symm-mem: megatron-core {caps.mcore_version} (Megatron-FSDP) has no "
            "use_symm_mem; plain FSDP buffers are used. Upgrade megatron-core to >= 0.19.",
        )


def _symm_mem_ranks(o: CkptOptions, caps: Capabilities | None,
                    fsdp_ranks: int) -> Iterable[Finding]:
    if o.fsdp_use_symm_mem and caps is not None and caps.cuda_available and fsdp_ranks < 2:
        yield _error(
            "symm-mem-needs-2-gpus",
            f"--fsdp-use-symm-mem needs at least 2 GPUs in the FSDP mesh (one rank per GPU); "
            f"this mesh has {fsdp_ranks}. Launch with torchrun --nproc-per-node 2 (or more), "
            "or drop the flag.",
        )


def _snapshot_sets(o: CkptOptions, caps: Capabilities | None) -> Iterable[Finding]:
    missing = [flag for flag, on in (("--async-save", o.async_save),
                                     ("--async-ckpt-use-cpu-shm", o.async_ckpt_use_cpu_shm))
               if not on]
    if not missing and o.ckpt_memory_restore:
        return
    why = (f"add {' and '.join(missing)}" if missing
           else "drop --no-ckpt-memory-restore (the snapshot is the memory tier's)")
    if o.ckpt_memory_snapshot_sets >= 2:
        yield _error(
            "snapshot-sets-need-memory-tier",
            "--ckpt-memory-snapshot-sets 2 keeps a second set of shared-memory staging buffers "
            f"for the memory tier, which this run does not use: {why}, or drop the flag.",
        )
    if o.ckpt_memory_partner:
        yield _error(
            "partner-needs-memory-tier",
            "--ckpt-memory-partner copies the memory tier's sealed snapshot to another node, "
            f"and this run seals none: {why}, or drop the flag.",
        )


def _versions(caps: Capabilities) -> str:
    return f"nvidia-resiliency-ext {caps.nvrx_version}, megatron-core {caps.mcore_version}"


RULES: tuple[Rule, ...] = (
    _workers_with_async,
    _shm_without_constant,
    _shm_without_async,
    _persistent_without_async,
    _overlap_snapshot,
    _priorities_without_async,
    _backend_unusable,
    _async_provider,
    _persistent_worker,
    _shm_worker_context,
    _priorities_supported,
    _cached_metadata,
    _fully_parallel_load_needs_cuda,
    _symm_mem,
    _snapshot_sets,
)


def validate(options: CkptOptions, caps: Capabilities | None = None) -> list[Finding]:
    """All findings for ``options`` (and the backend ``caps``, when given). No I/O."""
    return [finding for rule in RULES for finding in rule(options, caps)]


def check(options: CkptOptions, caps: Capabilities | None = None) -> list[Finding]:
    """Raise on errors (all of them, in one message); warn once on rank 0; return the findings."""
    return _raise_or_warn(validate(options, caps))


def check_fsdp(options: CkptOptions, caps: Capabilities | None, *,
               fsdp_ranks: int) -> list[Finding]:
    """:func:`check` for wrapping a model with Megatron-FSDP over ``fsdp_ranks`` ranks: the
    ``--fsdp-use-symm-mem`` rules plus the GPU count, which only the wrapping call knows."""
    return _raise_or_warn([*_symm_mem(options, caps), *_symm_mem_ranks(options, caps, fsdp_ranks)])


def _raise_or_warn(findings: list[Finding]) -> list[Finding]:
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise CkptOptionsError("invalid checkpoint options:\n  " + "\n  ".join(map(str, errors)))
    for f in findings:
        warn_once(f.code, f.message)
    return findings
