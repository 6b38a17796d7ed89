"""``python -m megatron_ckpt_ext doctor``: what this environment can do, feature by feature.

Every row is derived from :func:`megatron_ckpt_ext.backend.detect`; nothing here probes a backend
itself. Status is one of ``available`` (used as asked), ``fallback`` (the flag works, another
mechanism does the job; the reason says which) or ``missing`` (the feature is off here). Any
``MCX_*`` debug switch set to a non-default value is listed (docs/DEBUGGING.md), since it changes
how a save runs. The text report ends with a one-line verdict on the async save path
(:func:`verdict`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable

from . import backend
from .backend import Capabilities
from .debug import ENV_SWITCHES, non_default_switches

__all__ = ["Row", "backend_key", "format_text", "report", "rows", "to_json", "verdict"]

AVAILABLE, FALLBACK, MISSING = "available", "fallback", "missing"


@dataclass(frozen=True)
class Row:
    feature: str
    status: str
    detail: str
    flag: str = ""


def backend_key(caps: Capabilities) -> str:
    """The column name for this backend combination (as used in docs/COMPAT.md)."""
    nvrx = f"nvrx {caps.nvrx_version}" if caps.nvrx_version else "no nvrx"
    return f"mcore {caps.mcore_version or 'none'} + {nvrx}"


def _nvrx(caps: Capabilities) -> str:
    return f"nvidia-resiliency-ext {caps.nvrx_version}" if caps.nvrx_version else "no nvidia-resiliency-ext"


def _yes_no(feature: str, ok: bool, yes: str, no: str, flag: str = "", *, fallback: bool = False) -> Row:
    return Row(feature, AVAILABLE if ok else (FALLBACK if fallback else MISSING), yes if ok else no, flag)


def _dist_ckpt(c: Capabilities) -> Row:
    return _yes_no("mcore_dist_ckpt", c.mcore_dist_ckpt_importable,
                   f"megatron.core.dist_checkpointing from megatron-core {c.mcore_version}",
                   c.mcore_error or "not importable")


def _nvrx_async(c: Capabilities) -> Row:
    return _yes_no("nvrx_async_ckpt", c.nvrx_importable,
                   f"nvidia_resiliency_ext.checkpointing.async_ckpt {c.nvrx_version}",
                   c.nvrx_error or "not importable")


def _async_save(c: Capabilities) -> Row:
    flag = "--async-save"
    if c.async_provider == "nvrx":
        return Row("async_save", AVAILABLE, f"nvrx AsyncCallsQueue ({_nvrx(c)})", flag)
    if c.async_provider == "mcore":
        return Row("async_save", FALLBACK,
                   f"megatron-core {c.mcore_version} built-in async path ({c.nvrx_error})", flag)
    return Row("async_save", FALLBACK, "synchronous save: no async backend here", flag)


def _persistent_worker(c: Capabilities) -> Row:
    flag = "--use-persistent-ckpt-worker"
    runs, why = backend.persistent_worker_runs_here(c, cpu_shm_mode=c.queue_cpu_shm_mode)
    if runs:
        mode = " (with cpu_shm_mode)" if why != "ok" else ""
        return Row("persistent_worker", AVAILABLE, f"{c.async_provider} persistent worker{mode}", flag)
    return Row("persistent_worker", FALLBACK, f"fresh worker per save: {why}", flag)


def _cpu_shm_staging(c: Capabilities) -> Row:
    ours = "ours (per-tensor shm staging)"
    if c.async_provider == "nvrx" and c.queue_cpu_shm_mode:
        return Row("cpu_shm_staging", AVAILABLE,
                   f"{ours}; nvrx cpu_shm_mode keeps CUDA out of the worker", "--async-ckpt-use-cpu-shm")
    return Row("cpu_shm_staging", FALLBACK,
               f"{ours}; no nvrx cpu_shm_mode with {_nvrx(c)}, so the worker still initialises CUDA "
               "(upgrade to nvidia-resiliency-ext >= 0.7.0)", "--async-ckpt-use-cpu-shm")


def _nvrx_cpu_shm_mode(c: Capabilities) -> Row:
    ok = c.async_provider == "nvrx" and c.queue_cpu_shm_mode
    return _yes_no("nvrx_cpu_shm_mode", ok, "AsyncCallsQueue(cpu_shm_mode=...) accepted",
                   f"{_nvrx(c)}: AsyncCallsQueue takes no cpu_shm_mode (added in 0.7.0)")


def _dist_sync(c: Capabilities) -> Row:
    ok, why = backend.dist_sync_runs_here(c)
    return _yes_no("queue_dist_sync", ok, "queue agrees across ranks itself",
                   f"{why}: finalize with no_dist=True and agree over the process group",
                   fallback=True)


_SIMPLE: tuple[tuple[str, str, str, str], ...] = (
    # (feature, Capabilities field, flag, what is used when it is absent)
    ("worker_priorities", "queue_priorities", "--async-ckpt-cpu-priority/--async-ckpt-io-priority",
     "priorities ignored (nvidia-resiliency-ext >= 0.7.0 adds them)"),
    # Either way the Checkpointer starts the persistent worker when it is built, not in save 1.
    ("warmup_persistent_caller", "warmup_persistent_caller", "",
     "a warm-up request starts the persistent worker when the Checkpointer is built instead"),
    ("writer_use_cpu_shm", "writer_use_cpu_shm", "", "the writer does not stage to shm; ours does"),
    ("writer_cached_structure", "writer_cached_structure", "", "write buckets rebuilt every save"),
    ("writer_multiproc_io", "writer_multiproc_io", "", "the writer's fixed I/O mode"),
    ("writer_use_msc", "writer_use_msc", "", "local filesystem only"),
    ("write_results_queue_mp_mode", "write_results_queue_mp_mode", "", "the backend's fixed mp mode"),
    ("strategy_thread_count", "strategy_thread_count", "--dist-ckpt-workers", "the strategy's default"),
    ("strategy_cached_metadata", "strategy_cached_metadata", "--ckpt-assume-constant-structure",
     "plan and metadata recomputed every save"),
    ("strategy_cpu_shm_mode", "strategy_cpu_shm_mode", "", "ours stages to shm instead"),
    ("mcore_async_utils", "mcore_async_utils", "", "no megatron-core async path"),
    ("megatron_training", "megatron_training", "", "megatron_lm adapter unavailable"),
    ("fsdp_symm_mem", "fsdp_symm_mem", "--fsdp-use-symm-mem",
     "plain FSDP buffers (megatron-core >= 0.19 adds use_symm_mem)"),
)


def _simple_rows(c: Capabilities) -> list[Row]:
    return [_yes_no(feature, getattr(c, field), "supported by the installed backend", absent, flag)
            for feature, field, flag, absent in _SIMPLE]


_ROW_BUILDERS: tuple[Callable[[Capabilities], Row], ...] = (
    _dist_ckpt, _nvrx_async, _async_save, _persistent_worker, _cpu_shm_staging,
    _nvrx_cpu_shm_mode, _dist_sync,
)


def rows(caps: Capabilities) -> list[Row]:
    """One row per feature, in a fixed order."""
    return [build(caps) for build in _ROW_BUILDERS] + _simple_rows(caps)


def verdict(caps: Capabilities) -> str:
    """One line: can this installation save, and what of the async path falls back."""
    by = {r.feature: r for r in rows(caps)}
    if by["mcore_dist_ckpt"].status != AVAILABLE:
        return ("verdict: NOT USABLE - megatron-core dist_checkpointing cannot be imported: "
                f"{by['mcore_dist_ckpt'].detail}")
    falls = []
    if caps.async_provider == "sync":
        falls.append("--async-save saves synchronously (no async backend)")
    elif by["async_save"].status != AVAILABLE:
        falls.append(f"--async-save uses megatron-core's async path ({_nvrx(caps)})")
    if by["persistent_worker"].status != AVAILABLE:
        falls.append("--use-persistent-ckpt-worker starts a fresh writer process per save")
    if by["cpu_shm_staging"].status != AVAILABLE and caps.cuda_available:
        falls.append("with --async-ckpt-use-cpu-shm the writer still initialises CUDA "
                     "(nvidia-resiliency-ext >= 0.7.0 keeps it out)")
    if not falls:
        if by["cpu_shm_staging"].status != AVAILABLE:  # only reached without CUDA
            return ("verdict: OK - async saves with a persistent worker available (no CUDA "
                    "here, so cpu_shm_staging's fallback does not matter on this host)")
        return "verdict: OK - async cpu-shm saves with a persistent worker available"
    return "verdict: OK with fallbacks - " + "; ".join(falls)


def report(caps: Capabilities | None = None) -> dict[str, Any]:
    """The doctor's findings as plain data (what ``--json`` prints)."""
    caps = caps or backend.detect()
    return {
        "backend": backend_key(caps),
        "versions": {"python": caps.python_version, "torch": caps.torch_version,
                     "megatron-core": caps.mcore_version, "nvidia-resiliency-ext": caps.nvrx_version},
        "cuda_available": caps.cuda_available,
        "async_provider": caps.async_provider,
        "crc32": _crc32_line(),
        "features": [dataclasses.asdict(r) for r in rows(caps)],
        "capabilities": dataclasses.asdict(caps),
        "debug_switches": non_default_switches(),
        "verdict": verdict(caps),
    }


def _crc32_line() -> str:
    """Which CRC-32 the manifests, seals and verifying loads use: ISA-L's, or zlib's where the
    ``isal`` dependency is not importable (same values, several times slower per core)."""
    from . import _crc

    if _crc.IMPLEMENTATION == "isal":
        return "isal (ISA-L)"
    return ("zlib: isal is not importable (pip install isal, a dependency of this package); "
            "verifying loads and seals run several times slower")


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=False)


def format_text(data: dict[str, Any]) -> str:
    """A human-readable report: versions, the feature table, the debug switches set, then the
    verdict."""
    v = data["versions"]
    lines = [f"{name:<22} {value or 'not installed'}" for name, value in v.items()]
    lines += [f"{'CUDA available':<22} {data['cuda_available']}",
              f"{'async provider':<22} {data['async_provider']}"]
    if data.get("crc32"):
        lines.append(f"{'CRC-32':<22} {data['crc32']}")
    lines.append("")
    width = max(len(r["feature"]) for r in data["features"])
    lines.append(f"{'feature':<{width}}  {'status':<9}  detail")
    lines.append(f"{'-' * width}  {'-' * 9}  {'-' * 40}")
    for r in data["features"]:
        flag = f" [{r['flag']}]" if r["flag"] else ""
        lines.append(f"{r['feature']:<{width}}  {r['status']:<9}  {r['detail']}{flag}")
    lines += _switch_lines(data.get("debug_switches") or {})
    if data.get("verdict"):
        lines += ["", data["verdict"]]
    return "\n".join(lines)


def _switch_lines(switches: dict[str, str]) -> list[str]:
    """One line per debug switch set, so a pasted report shows a run was not on the defaults."""
    if not switches:
        return []
    return [""] + [f"debug switch {name}={value} "
                   f"(default: {ENV_SWITCHES[name].default or 'unset'}; docs/DEBUGGING.md)"
                   for name, value in switches.items()]
