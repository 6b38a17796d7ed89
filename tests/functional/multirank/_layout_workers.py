"""Rank bodies for the TP/PP/DP layout tests (a module of its own so spawned ranks can import them).

A small GPT-shaped model is described the way Megatron describes it to megatron-core: column-
parallel ``linear_fc1`` (split over tensor parallelism along axis 0), row-parallel ``linear_fc2``
(axis 1), vocab-parallel embedding and output layer (axis 0), layer norms replicated over TP.
Pipeline stages own distinct layers (keys carry the global layer number) and the first/last
stage own the embedding/output layer. Data-parallel replicas hold the same shards, told apart by
``replica_id`` (Megatron's ``(0, tp_rank for TP-replicated tensors else 0, dp_rank)``).

Every global tensor is a function of its key and the step only (a seeded ``torch.Generator``), so
any rank in any layout computes the exact slice it must hold.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import torch

from megatron_ckpt_ext import Checkpointer, CkptOptions
from megatron_ckpt_ext.save.layout import read_tracker

from tests._support.dist import device

LAYERS, HIDDEN, FFN, VOCAB = 4, 64, 256, 512


class Layout(NamedTuple):
    tp: int
    pp: int
    dp: int


class Coord(NamedTuple):
    tp: int
    pp: int
    dp: int


def coord(rank: int, lay: Layout) -> Coord:
    """Megatron's default rank order (tp fastest, then dp, then pp)."""
    return Coord(tp=rank % lay.tp, dp=(rank // lay.tp) % lay.dp, pp=rank // (lay.tp * lay.dp))


def specs() -> dict[str, tuple[tuple[int, ...], torch.dtype, int | None, str]]:
    """key -> (global shape, dtype, TP split axis or None (replicated over TP), owner), owner
    being 'first', 'last' or the global layer number as a string."""
    out = {"embedding.word_embeddings.weight": ((VOCAB, HIDDEN), torch.float32, 0, "first")}
    for layer in range(LAYERS):
        p = f"decoder.layers.{layer}."
        out[p + "input_layernorm.weight"] = ((HIDDEN,), torch.float32, None, str(layer))
        out[p + "mlp.linear_fc1.weight"] = ((FFN, HIDDEN), torch.bfloat16, 0, str(layer))
        out[p + "mlp.linear_fc2.weight"] = ((HIDDEN, FFN), torch.float32, 1, str(layer))
    out["decoder.final_layernorm.weight"] = ((HIDDEN,), torch.float32, None, "last")
    out["output_layer.weight"] = ((VOCAB, HIDDEN), torch.float32, 0, "last")
    return out


def global_tensor(key: str, step: int) -> torch.Tensor:
    shape, dtype, _, _ = specs()[key]
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + 7919 * step)
    return torch.randn(shape, generator=g).to(dtype)


def global_bytes() -> int:
    return sum(global_tensor(k, 0).nbytes for k in specs())


def owns(owner: str, c: Coord, lay: Layout) -> bool:
    if owner == "first":
        return c.pp == 0
    if owner == "last":
        return c.pp == lay.pp - 1
    per_stage = LAYERS // lay.pp
    return c.pp * per_stage <= int(owner) < (c.pp + 1) * per_stage


def local_state(rank: int, lay: Layout, step: int) -> dict[str, torch.Tensor]:
    """This rank's exact slices of the global tensors of ``step`` in layout ``lay``."""
    c = coord(rank, lay)
    out = {}
    for key, (_, _, axis, owner) in specs().items():
        if not owns(owner, c, lay):
            continue
        full = global_tensor(key, step)
        local = full if axis is None else full.chunk(lay.tp, dim=axis)[c.tp]
        out[key] = local.clone().to(device())
    return out


def describe(rank: int, lay: Layout, tensors: dict[str, torch.Tensor]) -> dict:
    """The sharded state dict of ``tensors`` (this rank's slices) in layout ``lay``."""
    from megatron.core.dist_checkpointing import ShardedTensor

    c = coord(rank, lay)
    out = {}
    for key, t in tensors.items():
        axis = specs()[key][2]
        if axis is None:  # replicated over TP and DP
            out[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=(0, c.tp, c.dp))
        else:
            out[key] = ShardedTensor.from_rank_offsets(key, t, (axis, c.tp, lay.tp),
                                                       replica_id=(0, 0, c.dp))
    return out


def dp_group(rank: int, lay: Layout):
    """This rank's data-parallel group (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    world = lay.tp * lay.pp * lay.dp
    mine = None
    for pp in range(lay.pp):
        for tp in range(lay.tp):
            ranks = [r for r in range(world) if coord(r, lay)[:2] == (tp, pp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


def assert_bit_exact(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, g.shape, w.dtype,
                                                           w.shape)
        same = torch.equal(g.cpu().contiguous().view(torch.uint8),
                           w.cpu().contiguous().view(torch.uint8))
        assert same, f"{what}: tensor {k!r} differs from its expected slice"


def load_layout(ck: Checkpointer, rank: int, lay: Layout, root: str, iteration: int) -> dict:
    like = {k: torch.zeros_like(v) for k, v in local_state(rank, lay, 0).items()}
    return ck.load(describe(rank, lay, like), root, iteration=iteration)


def save_layout(rank: int, lay: Layout, root: str, options: dict, step: int) -> None:
    """Save ``step``'s state in layout ``lay``; the live tensors are overwritten as soon as save()
    returns (the checkpoint must hold the values at save())."""
    with Checkpointer(CkptOptions(**options), dp_group=dp_group(rank, lay)) as ck:
        live = local_state(rank, lay, step)
        ck.save(describe(rank, lay, live), root, iteration=step)
        for v in live.values():
            v.fill_(-3)
        ck.maybe_finalize(blocking=True)
    assert read_tracker(root) == step


def roundtrip(rank: int, world: int, root: str, options: dict, mode: str, layouts: list) -> None:
    """For each layout: save step 1 (fully-parallel save over the layout's DP group), then load it
    back in the same layout; every rank gets its own slices bit-exactly. The save ran in ``mode``,
    and every rank wrote a data file (with DP replicas, only the fully-parallel save makes the
    DP rank 1 ranks write)."""
    from pathlib import Path

    for i, lay in enumerate(map(Layout._make, layouts)):
        assert lay.tp * lay.pp * lay.dp == world
        where = f"{root}/{i}"
        group = dp_group(rank, lay)
        with Checkpointer(CkptOptions(**options), dp_group=group) as ck:
            live = local_state(rank, lay, 1)
            ck.save(describe(rank, lay, live), where, iteration=1)
            for v in live.values():
                v.fill_(-3)
            ck.maybe_finalize(blocking=True)
            assert read_tracker(where) == 1
            assert ck.reports[-1]["mode"] == mode, ck.reports[-1]
            files = Path(where, "iter_0000001").glob("*.distcp")
            writers = sorted(int(f.name.split("_")[2]) for f in files)  # __{rank}_{n}.distcp
            assert writers == list(range(world)), (f"layout {tuple(lay)}: data files of ranks "
                                                   f"{writers}")
            torch.distributed.barrier()
            got = load_layout(ck, rank, lay, where, 1)
        assert_bit_exact(got, local_state(rank, lay, 1), f"rank {rank} layout {tuple(lay)}")


def resume(rank: int, world: int, root: str, options: dict, saved: list, loads: list) -> None:
    """Save in layout ``saved``, then load (a fresh Checkpointer each, like a restarted job) in
    each layout of ``loads``: megatron-core reshards, every rank gets exactly its new slices."""
    save_layout(rank, Layout._make(saved), root, options, step=2)
    torch.distributed.barrier()
    for lay in map(Layout._make, loads):
        with Checkpointer(CkptOptions(), dp_group=dp_group(rank, lay)) as ck:
            got = load_layout(ck, rank, lay, root, 2)
        assert_bit_exact(got, local_state(rank, lay, 2),
                         f"rank {rank}: saved {tuple(saved)}, loaded {tuple(lay)}")


def save_only(rank: int, world: int, root: str, options: dict, layout: list) -> None:
    save_layout(rank, Layout._make(layout), root, options, step=1)
