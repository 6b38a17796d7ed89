"""Megatron-FSDP for the model, with NCCL symmetric-memory staging behind ``--fsdp-use-symm-mem``.

:func:`wrap_fsdp` applies megatron-core's experimental ``fully_shard`` (found by ``backend``) to a
model in place. With ``--fsdp-use-symm-mem`` (config key ``fsdp_use_symm_mem``) it passes
``use_symm_mem=True``, so the all-gather and reduce-scatter staging buffers come from PyTorch's NCCL
symmetric-memory pool (Megatron-LM PR #5440), and :func:`register_sharded_buffers` puts the other
side of each collective (sharded compute weights, sharded gradients) there too, so NCCL picks its
symmetric kernels. Where the installed ``fully_shard`` has no ``use_symm_mem``, one warning
(rank 0) and plain FSDP buffers; on CPU or with fewer than 2 GPUs in the mesh the flag is an error.

:func:`fsdp_sharded_state_dict` and :func:`load_fsdp_state_dict` give the Checkpointer the state of
a wrapped model (fp32 main weights) and of its optimizer: each rank saves the rows of each
parameter it owns. Megatron-FSDP packs the parameters of a unit into one flat buffer split evenly
across ranks, so a rank may own an uneven number of rows of a tensor (or none): the shards are
megatron-core ShardedTensors on an irregular grid (``axis_fragmentations=None``), which its
torch_dist format stores as they are.

This module works on Megatron-FSDP objects (parameter groups and their DBuffers); the classes and
functions it calls, and the reads of a DBuffer's layout and placements, come from ``backend`` (the
one package that imports megatron-core). Importing it needs no CUDA and detects nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from . import backend, validation
from ._runtime import rank
from .errors import BackendUnavailable
from .options import CkptOptions

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "default_mesh",
    "flat_placements",
    "fsdp_sharded_state_dict",
    "load_fsdp_state_dict",
    "register_sharded_buffers",
    "wrap_fsdp",
]

logger = logging.getLogger(__name__)


# -- wrapping ------------------------------------------------------------------------------------
def wrap_fsdp(
    model: nn.Module,
    options: CkptOptions,
    *,
    mesh: Any = None,
    placements: Any = None,
    mixed_precision_policy: Any = None,
    units: Iterable[nn.Module] = (),
    optimizer: torch.optim.Optimizer | None = None,
    precision_aware_optimizer: bool = False,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply Megatron-FSDP (experimental ``fully_shard``) to ``model`` in place; return it.

    ``units`` (submodules of ``model``) are sharded first, innermost first, as ``fully_shard``
    requires; ``model`` itself is sharded too when it holds parameters outside every unit. ``mesh``
    defaults to a 1-D mesh over the default process group on this process's device type;
    ``placements`` to all-``Flat`` (plain FSDP) on a 1-D mesh; ``mixed_precision_policy`` to
    Megatron-FSDP's default (fp32 main weights). ``optimizer`` (over ``model.parameters()``, built
    before or after this call, before its first step) is pointed at the sharded parameters and
    gets Megatron-FSDP's step hooks, which refresh the compute weights after each step. Other
    keywords go to ``fully_shard`` unchanged.

    Raises :class:`~megatron_ckpt_ext.errors.CkptOptionsError` for ``--fsdp-use-symm-mem`` on CPU
    or with fewer than 2 ranks in ``mesh``; :class:`~megatron_ckpt_ext.errors.BackendUnavailable`
    where no experimental Megatron-FSDP is installed.
    """
    api = backend.megatron_fsdp_api()
    mesh = mesh if mesh is not None else default_mesh()
    kwargs: dict[str, Any] = {
        "placements": placements if placements is not None else flat_placements(mesh, api=api),
        "mixed_precision_policy": mixed_precision_policy,
        **fully_shard_kwargs,
    }
    use_symm_mem = _use_symm_mem(options, api, mesh)
    if api.use_symm_mem:  # passed explicitly (False too) wherever fully_shard takes it
        kwargs["use_symm_mem"] = use_symm_mem
    before = dict(model.named_parameters())
    for module in _shard_order(model, units):
        api.fully_shard(module, mesh=mesh, **kwargs)
    if use_symm_mem:
        register_sharded_buffers(model, api=api)
    if optimizer is not None:
        _rebind_optimizer(optimizer, before, dict(model.named_parameters()))
        _adapt_optimizer(api, optimizer, precision_aware_optimizer)
    if rank() == 0:
        logger.info("Megatron-FSDP (%s) over %d ranks, use_symm_mem=%s", api.module, mesh.size(),
                    use_symm_mem)
    return model


def register_sharded_buffers(model: nn.Module, *, api: backend.FsdpApi | None = None
                             ) -> dict[str, Any]:
    """Put the other side of each symmetric-memory collective into the pool too.

    Megatron-FSDP 0.19.2 (``use_symm_mem=True``) allocates from PyTorch's NCCL symmetric pool and
    rendezvouses only the all-gather *output* (the unsharded weights) and the reduce-scatter
    *input* (the unsharded gradients), but NCCL picks its symmetric kernels (``ncclSymk*``) only
    when both buffers of a collective lie in registered windows; otherwise every collective runs
    as a ring (see docs/FSDP.md and ``tools/probe_nccl_symk.py``). This moves the two persistent
    sharded buffers of each parameter group -- ``model_weight`` (the all-gather input, the
    compute-dtype shard) and ``main_grad`` (the reduce-scatter output) -- into the group's own
    pool (one copy each, at wrap time) and rendezvouses them once, on every mesh axis they are
    sharded on (collective: every rank walks the groups in the same order).

    Safe because both are reached only through their DBuffer (``local_buffer``; views are cut per
    use), at wrap time no gradient view exists yet, and the values are copied. Not moved, with
    the reason recorded: a ``model_weight`` that *is* the optimizer's ``main_weight`` (main
    params in the compute dtype: the sharded parameters are views of it), and a gradient reduced
    into a temporary (``main_grads_dtype`` unlike the compute dtype, or accumulation into
    existing grads); those collectives keep NCCL's ring kernels. Returns what it did.
    """
    import torch

    api = api or backend.megatron_fsdp_api()
    done: dict[str, Any] = {"moved": [], "bytes": 0, "kept": []}
    for module_name, group in _named_parameter_groups(model):
        pool = backend.fsdp_group_symm_pool(group)
        if pool is None:
            continue
        for attr in ("model_weight", "main_grad"):
            buffer, where = getattr(group, attr, None), f"{module_name or '<root>'}.{attr}"
            if buffer is None:
                continue
            if buffer is group.main_weight:
                done["kept"].append(f"{where}: is the optimizer's main weight buffer")
                continue
            old = buffer.local_buffer
            with torch.cuda.use_mem_pool(pool):
                new = torch.empty_like(old)
            new.copy_(old)
            buffer.local_buffer = new
            for axis in backend.dbuffer_flat_axes(buffer, api):
                buffer.rendezvous(axis)
            done["moved"].append(where)
            done["bytes"] += new.numel() * new.element_size()
    if rank() == 0:
        logger.info("symmetric memory: moved %d sharded buffers (%.1f MiB) into the NCCL pool%s",
                    len(done["moved"]), done["bytes"] / 2**20,
                    f"; kept: {'; '.join(done['kept'])}" if done["kept"] else "")
    return done


def default_mesh() -> Any:
    """A 1-D device mesh over the default process group, on CUDA when this process has it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("wrap_fsdp needs torch.distributed initialized (launch with torchrun "
                           "and call torch.distributed.init_process_group first), or mesh=...")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def flat_placements(mesh: Any, *, api: backend.FsdpApi | None = None) -> Any:
    """Plain FSDP placements (parameters, gradients and optimizer state all ``Flat``) for a 1-D
    mesh, built from the classes of the installed Megatron-FSDP."""
    api = api or backend.megatron_fsdp_api()
    if mesh.ndim != 1:
        raise ValueError(f"flat_placements builds placements for a 1-D mesh; this mesh has "
                         f"{mesh.ndim} dimensions: pass placements=... for HSDP meshes")
    flat = [api.flat()]
    return api.placements(dp_axes=[0], parameter=flat, gradient=list(flat), optimizer=list(flat))


def _use_symm_mem(options: CkptOptions, api: backend.FsdpApi, mesh: Any) -> bool:
    """Whether to stage through symmetric memory: the flag, checked against this environment
    (errors raise; a fully_shard without use_symm_mem is one warning and False)."""
    if not options.fsdp_use_symm_mem:
        return False
    caps = dataclasses.replace(backend.detect(), fsdp_symm_mem=api.use_symm_mem)
    validation.check_fsdp(options, caps, fsdp_ranks=mesh.size())
    return api.use_symm_mem


def _shard_order(model: nn.Module, units: Iterable[nn.Module]) -> list[nn.Module]:
    """``units`` innermost first, then ``model`` when it owns parameters outside them."""
    depth = {id(m): name.count(".") + 1 if name else 0 for name, m in model.named_modules()}
    units = list(units)
    strangers = [type(u).__name__ for u in units if id(u) not in depth]
    if strangers:
        raise ValueError(f"wrap_fsdp: units must be submodules of the model; not found: "
                         f"{strangers}")
    ordered = sorted(units, key=lambda m: -depth[id(m)])  # stable: siblings keep their order
    covered = {id(p) for u in units for p in u.parameters()}
    if model not in units and any(id(p) not in covered for p in model.parameters()):
        ordered.append(model)
    return ordered


def _rebind_optimizer(optimizer: Any, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    """Point an optimizer built over the unsharded parameters at their sharded replacements
    (``fully_shard`` installs new Parameter objects under the same names)."""
    if optimizer.state:
        raise ValueError("wrap_fsdp: the optimizer has already taken a step; wrap the model "
                         "before the first optimizer step")
    sharded = {id(p): after[name] for name, p in before.items() if name in after}
    for group in optimizer.param_groups:
        group["params"] = [sharded.get(id(p), p) for p in group["params"]]


def _adapt_optimizer(api: backend.FsdpApi, optimizer: Any, precision_aware: bool) -> None:
    if api.fully_shard_optimizer is None:
        raise BackendUnavailable(
            f"{api.module} has no fully_shard_optimizer, so the compute weights would not follow "
            "optimizer steps; install a Megatron-FSDP that has it (megatron-core >= 0.19.2)")
    backend.call_with_supported(api.fully_shard_optimizer, optimizer,
                                precision_aware=precision_aware)


# -- checkpointing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shard:
    """This rank's rows of one FSDP-managed parameter (a view of the fp32 main-weight buffer)."""

    key: str  # parameter name relative to the model
    parameter: Any  # the sharded (DTensor) parameter the optimizer holds
    local: torch.Tensor
    global_shape: tuple[int, ...]
    row_offset: int
    replica_id: Any


def fsdp_sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                            prefix: str = "") -> dict[str, Any]:
    """The state of a :func:`wrap_fsdp` model (fp32 main weights) and, when given, its optimizer,
    as a megatron-core sharded state dict for :meth:`Checkpointer.save` / ``load``.

    Tensors are views of the live buffers, so a load writes into them in place; call
    :func:`load_fsdp_state_dict` with what ``load`` returns to finish (it refreshes the compute
    weights). Optimizer state must exist (load after the first step, as Megatron does): tensors
    shaped like their parameter are saved sharded, scalars (``step``) and hyperparameters as
    common state.
    """
    import torch

    shards = list(_fsdp_shards(model))
    _check_all_parameters_sharded(model, shards)
    with torch.no_grad():  # DTensor.to_local() then hands out the local tensor itself
        state: dict[str, Any] = {
            "model": {s.key: _sharded_tensor(f"{prefix}model.{s.key}", s.local, s)
                      for s in shards if s.local.numel()}}
        if optimizer is not None:
            state["optimizer"] = _optimizer_state(optimizer, shards, prefix)
    return state


def load_fsdp_state_dict(model: nn.Module, loaded: Mapping[str, Any],
                         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Put a loaded :func:`fsdp_sharded_state_dict` into ``model`` (and ``optimizer``), then
    recompute the compute-dtype weights from the loaded main weights."""
    import torch

    shards = list(_fsdp_shards(model))
    with torch.no_grad():
        for shard in shards:
            if shard.local.numel():
                shard.local.copy_(_entry(loaded["model"], shard.key, "model"))
        if optimizer is not None:
            _load_optimizer_state(optimizer, shards, _entry(loaded, "optimizer", "checkpoint"))
        for group in _parameter_groups(model):
            group.sync_model_weight_from_main_weight()


def _fsdp_shards(model: nn.Module) -> Iterator[_Shard]:
    for module_name, group in _named_parameter_groups(model):
        buffer = group.main_weight
        for index, (name, parameter) in enumerate(zip(group.parameter_names,
                                                      group.sharded_parameters)):
            key = f"{module_name}.{name}" if module_name else name
            yield _shard_of(key, parameter, buffer, index)


def _named_parameter_groups(model: nn.Module) -> Iterator[tuple[str, Any]]:
    yield from backend.fsdp_parameter_groups(model, backend.megatron_fsdp_api())


def _parameter_groups(model: nn.Module) -> Iterator[Any]:
    return (group for _, group in _named_parameter_groups(model))


def _shard_of(key: str, parameter: Any, buffer: Any, index: int) -> _Shard:
    """Where this rank's slice of tensor ``index`` of a DBuffer lies in the global tensor (it
    holds whole rows)."""
    shape, local, skipped = backend.dbuffer_slice(buffer, index)
    if not shape:
        raise ValueError(f"FSDP parameter {key!r} is a scalar; sharded checkpoints need dim >= 1")
    row = math.prod(shape[1:])
    if local.numel() and skipped % row:
        raise ValueError(f"FSDP parameter {key!r}: this rank's shard starts inside a row")
    return _Shard(key, parameter, local, shape, skipped // row if local.numel() else 0,
                  _replica_id(buffer))


def _replica_id(buffer: Any) -> Any:
    """0 on every rank of plain FSDP; with replicated mesh axes (HSDP), the rank's coordinates on
    them (the shard at all-zero coordinates is the one that is written)."""
    replicated = backend.dbuffer_replicated_coordinates(buffer, backend.megatron_fsdp_api())
    return replicated if any(replicated) else 0


def _sharded_tensor(key: str, data: torch.Tensor, shard: _Shard) -> Any:
    """A ShardedTensor on an irregular grid: ranks may own different numbers of rows."""
    offset = (shard.row_offset,) + (0,) * (len(shard.global_shape) - 1)
    return backend.sharded_tensor_cls()(
        key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
        global_shape=shard.global_shape, global_offset=offset, axis_fragmentations=None,
        replica_id=shard.replica_id)


def _check_all_parameters_sharded(model: nn.Module, shards: list[_Shard]) -> None:
    owned = {id(s.parameter) for s in shards}
    plain = [name for name, p in model.named_parameters() if id(p) not in owned]
    if plain:
        raise ValueError(f"parameters not managed by Megatron-FSDP: {plain[:5]}; wrap the model "
                         "with wrap_fsdp (and save between steps, when parameters are resharded)")


def _optimizer_state(optimizer: Any, shards: list[_Shard], prefix: str) -> dict[str, Any]:
    by_parameter = {id(s.parameter): s for s in shards}
    state: dict[str, Any] = {}
    for parameter in _optimizer_parameters(optimizer):
        shard = _shard_for(by_parameter, parameter)
        state[shard.key] = {
            name: _optimizer_entry(f"{prefix}optimizer.{shard.key}.{name}", value, shard)
            for name, value in _existing_state(optimizer, parameter, shard).items()
            if not _is_sharded(value) or _local(value).numel()  # no rows here: nothing to save
        }
    return {"state": state, "param_groups": _hyperparameters(optimizer)}


def _optimizer_entry(key: str, value: Any, shard: _Shard) -> Any:
    """A sharded tensor for state shaped like the parameter; the value itself (common state,
    written by rank 0) for scalars and non-tensors."""
    if not _is_sharded(value):
        return value
    if tuple(value.shape) != shard.global_shape:
        raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, neither a "
                         f"scalar nor the parameter's {shard.global_shape}: not supported")
    local = _local(value)
    if tuple(local.shape) != tuple(shard.local.shape):
        raise ValueError(f"optimizer state {key!r}: local shard {tuple(local.shape)} is not laid "
                         f"out like the parameter's {tuple(shard.local.shape)}")
    return _sharded_tensor(key, local, shard)


def _load_optimizer_state(optimizer: Any, shards: list[_Shard], loaded: Mapping[str, Any]) -> None:
    import torch

    by_parameter = {id(s.parameter): s for s in shards}
    for parameter in _optimizer_parameters(optimizer):
        shard = _shard_for(by_parameter, parameter)
        saved = _entry(loaded["state"], shard.key, "optimizer state")
        entries = _existing_state(optimizer, parameter, shard)
        for name, live in list(entries.items()):
            if _is_sharded(live) and not _local(live).numel():
                continue  # this rank holds no rows of the parameter
            value = _entry(saved, name, f"optimizer state of {shard.key}")
            if isinstance(live, torch.Tensor):
                _local(live).copy_(value)  # in place: keeps the optimizer's device and dtype
            else:
                entries[name] = value
    for group, hyper in zip(optimizer.param_groups, loaded["param_groups"], strict=True):
        group.update(hyper)


def _existing_state(optimizer: Any, parameter: Any, shard: _Shard) -> dict[str, Any]:
    entries = optimizer.state.get(parameter)
    if not entries:
        raise ValueError(f"optimizer state for {shard.key!r} does not exist yet; save or load the "
                         "optimizer after its first step (as Megatron does)")
    return entries


def _is_sharded(value: Any) -> bool:
    """Optimizer state kept per element of the parameter (a tensor of dimension >= 1)."""
    import torch

    return isinstance(value, torch.Tensor) and value.dim() > 0


def _local(tensor: Any) -> torch.Tensor:
    """The local tensor of a DTensor (the same storage, so writes reach the optimizer)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _optimizer_parameters(optimizer: Any) -> Iterator[Any]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _shard_for(by_parameter: Mapping[int, _Shard], parameter: Any) -> _Shard:
    shard = by_parameter.get(id(parameter))
    if shard is None:
        raise ValueError("the optimizer holds a parameter that is not managed by Megatron-FSDP; "
                         "build it over model.parameters() after wrap_fsdp")
    return shard


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _entry(mapping: Mapping[str, Any], key: str, what: str) -> Any:
    try:
        return mapping[key]
    except KeyError:
        raise KeyError(f"{what} entry {key!r} is missing from the loaded checkpoint: was it saved "
                       "from a model with the same structure?") from None
