"""megatron-core save and load strategies from the options.

* :func:`save_strategy`: torch_dist ``TorchDistSaveShardedStrategy`` with
  ``thread_count = dist_ckpt_workers`` and ``cached_metadata = ckpt_assume_constant_structure``
  (each only where the installed megatron-core accepts it), wrapped in the fully-parallel save
  wrapper when ``ckpt_fully_parallel_save`` and the data-parallel group has more than one rank.
  With one rank there is nothing to spread, and megatron-core then never caches the wrapper's
  (empty) distribution, so it would re-validate the sharding with collectives at every save
  (docs/notes/save_path.md).
* :func:`load_strategy`: the fully-parallel load wrapper when ``ckpt_fully_parallel_load`` (and
  CUDA is there: its shard exchange runs on CUDA), else megatron-core's default.

The changes we make to the write request itself are in :mod:`megatron_ckpt_ext.save.write_path`.
"""

from __future__ import annotations

from typing import Any

from . import backend
from .options import CkptOptions

__all__ = ["load_strategy", "save_strategy"]

_BACKEND = "torch_dist"
_VERSION = 1


def save_strategy(options: CkptOptions, *, dp_group: Any = None) -> Any:
    """The megatron-core save strategy the options ask for."""
    strategy = backend.call_with_supported(
        backend.torch_dist_save_strategy_cls(), _BACKEND, _VERSION,
        thread_count=options.dist_ckpt_workers,
        cached_metadata=options.ckpt_assume_constant_structure,
    )
    if fully_parallel_save(options, dp_group):
        strategy = backend.call_with_supported(
            backend.fully_parallel_save_wrapper_cls(), strategy, dp_group,
            do_cache_distribution=options.ckpt_assume_constant_structure,
        )
    return strategy


def fully_parallel_save(options: CkptOptions, dp_group: Any) -> bool:
    """Whether saves go through megatron-core's fully parallel wrapper (over ``dp_group``)."""
    return bool(options.ckpt_fully_parallel_save) and _group_size(dp_group) > 1


def _group_size(group: Any) -> int:
    """Ranks in ``group`` (None: the world); 1 without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def load_strategy(options: CkptOptions, *, dp_group: Any = None,
                  caps: backend.Capabilities | None = None) -> Any | None:
    """The load strategy, or None for megatron-core's default.

    megatron-core's fully-parallel load exchanges shards on CUDA (it allocates with
    ``device="cuda"``), so on a CPU-only host it falls back to the default load (validation warns).
    """
    caps = caps or backend.detect()
    if not options.ckpt_fully_parallel_load or not caps.cuda_available:
        return None
    base = backend.torch_dist_load_strategy_cls()()
    return backend.call_with_supported(backend.fully_parallel_load_wrapper_cls(), base, dp_group)
