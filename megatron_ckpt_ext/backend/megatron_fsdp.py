"""Megatron-FSDP's experimental ``fully_shard``: which package provides it and what it takes,
and the reads of its parameter groups and DBuffers (private attributes, so a rename reads as
"absent" here rather than as an error elsewhere)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import BackendUnavailable
from ._imports import MCORE_DIST, _attr, _installed_version, _module_present, _try_import
from .introspect import _names_param

# Where the experimental fully_shard lives, in order of preference: megatron-core's own copy (the
# one its models use), then the separate megatron-fsdp package. All classes are taken from the
# package whose fully_shard is used: its isinstance checks reject another copy's Placements.
FSDP_EXPERIMENTAL_MODULES = (
    "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental",
    "megatron_fsdp.experimental",
)
FSDP_SYMM_MEM_RELEASE = "megatron-core 0.19.2"  # a release whose fully_shard takes use_symm_mem


@dataclass(frozen=True)
class FsdpApi:
    """The experimental Megatron-FSDP entry points of one installed package."""

    module: str  # the package they come from
    version: str | None  # of its distribution, for messages
    fully_shard: Callable[..., Any]
    fully_shard_optimizer: Callable[..., Any] | None
    flat: type  # placement: dim-0 sharded
    placements: type  # Placements(dp_axes, parameter, gradient, optimizer)
    mixed_precision_policy: type | None
    fsdp_module: type  # the mixin fully_shard attaches (isinstance marks a wrapped module)
    use_symm_mem: bool  # fully_shard declares a ``use_symm_mem`` parameter


def megatron_fsdp_api() -> FsdpApi:
    """The experimental Megatron-FSDP API; raises BackendUnavailable saying why not and the fix."""
    api, problem = _fsdp_probe()
    if api is None:
        raise BackendUnavailable(
            f"no experimental Megatron-FSDP fully_shard can be imported here ({problem}); "
            f"install {FSDP_SYMM_MEM_RELEASE} or newer (megatron.core.distributed.fsdp.src."
            "megatron_fsdp.experimental)."
        )
    return api


def fsdp_symm_mem_support() -> tuple[bool, str]:
    """Does the installed experimental fully_shard take ``use_symm_mem``? (answer, reason).

    Detected once, lazily, from ``inspect.signature`` of the real callable (a ``**kwargs``
    catch-all does not count); never raises."""
    try:
        api, problem = _fsdp_probe()
    except Exception as e:  # noqa: BLE001 - detection must never take the run down
        return False, f"Megatron-FSDP detection failed: {type(e).__name__}: {e}"
    if api is None:
        return False, (f"no experimental Megatron-FSDP fully_shard is importable ({problem}); "
                       f"{FSDP_SYMM_MEM_RELEASE} has one with use_symm_mem")
    where = f"{api.module}.fully_shard ({_fsdp_dist(api.module)} {api.version or 'unknown'})"
    if not api.use_symm_mem:
        return False, f"{where} has no use_symm_mem parameter; {FSDP_SYMM_MEM_RELEASE} has it"
    return True, f"{where} takes use_symm_mem"


@functools.lru_cache(maxsize=8)
def _fsdp_probe(
    candidates: tuple[str, ...] = FSDP_EXPERIMENTAL_MODULES,
) -> tuple[FsdpApi | None, str]:
    """(the first candidate package's API, "") or (None, why none was usable); cached."""
    problems = []
    for name in candidates:
        api, problem = _fsdp_api_from(name)
        if api is not None:
            return api, ""
        problems.append(f"{name}: {problem}")
    return None, "; ".join(problems)


def _fsdp_api_from(name: str) -> tuple[FsdpApi | None, str]:
    if not _module_present(name.split(".")[0]):
        return None, "not installed"
    module, error = _try_import(name)
    if module is None:
        return None, error or "import failed"
    fully_shard = _attr(module, "fully_shard")
    flat, placements = _attr(module, "Flat"), _attr(module, "Placements")
    fsdp_module = _attr(_try_import(f"{name}.module")[0], "FsdpModule")
    if not callable(fully_shard) or None in (flat, placements, fsdp_module):
        return None, "no fully_shard/Flat/Placements/FsdpModule"
    parent = name.rsplit(".", 1)[0]
    parent_module = _try_import(parent)[0]
    version = _installed_version(parent.split(".")[0], _fsdp_dist(name))
    if version in (None, "unknown"):  # a source checkout: the package's own version string
        version = str(_attr(parent_module, "__version__") or "unknown")
    return FsdpApi(
        module=name,
        version=version,
        fully_shard=fully_shard,
        fully_shard_optimizer=_attr(module, "fully_shard_optimizer"),
        flat=flat,
        placements=placements,
        mixed_precision_policy=_attr(parent_module, "MixedPrecisionPolicy"),
        fsdp_module=fsdp_module,
        use_symm_mem=_names_param(fully_shard, "use_symm_mem"),
    ), ""


def _fsdp_dist(module_name: str) -> str:
    return MCORE_DIST if module_name.startswith("megatron.") else "megatron-fsdp"


def fsdp_group_symm_pool(group: Any) -> Any:
    """The NCCL symmetric-memory pool a Megatron-FSDP parameter group allocates its staging
    buffers from, or None (flag off, or a layout without one). Megatron-FSDP 0.19.2's
    experimental ``ParameterGroup`` keeps it in ``_symm_mem_pool``; read here, not elsewhere,
    so a renamed attribute reads as "no pool" (plain buffers), never as an error."""
    return getattr(group, "_symm_mem_pool", None)


def fsdp_parameter_groups(model: Any, api: FsdpApi) -> Any:
    """(module name, parameter group) for every module ``fully_shard`` wrapped, in model order."""
    for name, module in model.named_modules():
        if isinstance(module, api.fsdp_module):
            for group in module.parameter_groups:
                yield name, group


def dbuffer_slice(buffer: Any, index: int) -> tuple[tuple[int, ...], Any, int]:
    """(global shape, this rank's local tensor, elements of it held by lower ranks) of tensor
    ``index`` of a DBuffer: the buffer holds its tensors back to back
    (``layout.tensor_to_offset``), and this rank the elements from ``buffer.offset`` on."""
    shape = tuple(buffer.layout.tensor_shapes[index])
    if not shape:
        return shape, None, 0
    local = buffer.get_local_tensor(index)
    return shape, local, max(0, buffer.offset - buffer.layout.tensor_to_offset[index])


def dbuffer_replicated_coordinates(buffer: Any, api: FsdpApi) -> tuple[int, ...]:
    """This rank's coordinates on the DBuffer's mesh axes it is replicated on (not ``Flat``)."""
    coordinate = buffer.mesh.get_coordinate() or ()
    return tuple(c for c, p in zip(coordinate, buffer.placements) if not isinstance(p, api.flat))


def dbuffer_flat_axes(buffer: Any, api: FsdpApi) -> list[int]:
    """The DBuffer's mesh axes it is sharded on (``Flat``), where a rendezvous is needed."""
    return [axis for axis, placement in enumerate(buffer.placements)
            if isinstance(placement, api.flat)]
