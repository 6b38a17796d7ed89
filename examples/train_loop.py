#!/usr/bin/env python3
"""A complete data-parallel training loop checkpointed with megatron-ckpt-ext: train, then resume.

CPU (gloo) or one GPU per rank (NCCL), launched with torch.distributed.run (torchrun); our flags
plus Megatron's ``--save --load --train-iters --save-interval``:

    CKPT=$(mktemp -d)
    python -m torch.distributed.run --nproc-per-node 2 examples/train_loop.py --async-save \\
        --save $CKPT --save-interval 5 --train-iters 10
    python -m torch.distributed.run --nproc-per-node 2 examples/train_loop.py --async-save \\
        --save $CKPT --save-interval 5 --train-iters 20 --load $CKPT

The second run resumes from the latest committed checkpoint (iteration 10) and trains 11..20; the
last iteration is always saved, as in Megatron-LM. With ``--exit-signal-handler``, SIGTERM (or
``--exit-signal``) to any rank, or to every process of the job, makes the loop save the iteration
it is at, wait until that checkpoint is durable, and exit 0. ``--logging-level 20`` shows the
per-save lines (rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor

import megatron_ckpt_ext as mcx


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # every rank parses the same command line: say it once
        if os.environ.get("RANK", "0") != "0":
            sys.exit(2)
        super().error(message)


def parse_args() -> argparse.Namespace:
    parser = mcx.add_arguments(_Parser(description=__doc__.splitlines()[0], allow_abbrev=False))
    parser.add_argument("--save", help="checkpoint directory to save to")
    parser.add_argument("--load", help="checkpoint directory to resume from (its latest commit)")
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--save-interval", type=int, default=0, help="save every N iterations")
    args = parser.parse_args()
    if args.save and args.save_interval < 1:
        parser.error("--save needs --save-interval N (N >= 1)")
    return args


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       data: torch.Generator) -> dict:
    """Every tensor as a megatron-core ShardedTensor (save() refuses plain tensors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {}
    for name, p in model.named_parameters():
        # Replicated: the same values on every data-parallel rank. replica_id=rank makes rank 0's
        # copy the main one; the copies are written once (spread over the ranks).
        state[f"model.{name}"] = ShardedTensor.from_rank_offsets(
            f"model.{name}", p.detach(), replica_id=rank)
        state[f"momentum.{name}"] = ShardedTensor.from_rank_offsets(
            f"optimizer.momentum.{name}", optimizer.state[p]["momentum_buffer"], replica_id=rank)
    # Sharded: each rank holds a different piece (here the state of its own data stream).
    # (axis, rank, world): this rank's piece is chunk `rank` of `world` along axis 0.
    state["data"] = ShardedTensor.from_rank_offsets("data_generator", data.get_state(),
                                                    (0, rank, world))
    return state


def restore(loaded: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            data: torch.Generator) -> int:
    """Copy a loaded checkpoint into the live objects; the iteration it was saved at."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(loaded[f"model.{name}"])
            optimizer.state[p]["momentum_buffer"].copy_(loaded[f"momentum.{name}"])
    data.set_state(loaded["data"])
    return int(loaded["iteration"])  # a plain value: rank 0's was saved


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               data: torch.Generator, device: torch.device) -> float:
    x = torch.randn(16, 8, generator=data).to(device)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():  # data parallel: average the gradients
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # the mean loss over the ranks, for the log
    return loss.item() / dist.get_world_size()


def main() -> None:
    args = parse_args()
    options = mcx.CkptOptions.from_args(args)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=options.distributed_timeout())
    rank, device = dist.get_rank(), torch.device("cuda" if cuda else "cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():  # momentum buffers exist before the first step, to load into
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    data = torch.Generator().manual_seed(1000 + rank)  # a different data stream per rank

    loss, iteration = float("nan"), 0
    # [readme] start
    # Checks the options and that --save is writable; starts the async writer now, not in save 1.
    with mcx.Checkpointer(options, save_dir=args.save) as ckpt:
        loaded = None  # the latest committed checkpoint, or None: nothing committed yet
        if args.load:
            loaded = ckpt.load(sharded_state_dict(model, optimizer, data), args.load)
        start = 0 if loaded is None else restore(loaded, model, optimizer, data)
        if rank == 0:
            resumed = f" (resumed from {args.load} at iteration {start})" if start else ""
            print(f"training iterations {start + 1}..{args.train_iters}{resumed}"
                  if start < args.train_iters else
                  f"nothing to train: --train-iters {args.train_iters}{resumed}")
        if args.save:  # optional: with --async-ckpt-use-cpu-shm, allocate staging memory now
            ckpt.prepare(sharded_state_dict(model, optimizer, data))
        for iteration in range(start + 1, args.train_iters + 1):  # `start` is already committed
            loss = train_step(model, optimizer, data, device)
            ckpt.maybe_finalize()  # every rank calls it: commits the async saves that are done
            stop = ckpt.preempted()  # --exit-signal-handler: a rank got SIGTERM (collective)
            last = iteration == args.train_iters  # the end of training is saved, as in Megatron-LM
            if args.save and (iteration % args.save_interval == 0 or stop or last):
                state = sharded_state_dict(model, optimizer, data)
                ckpt.save(dict(state, iteration=iteration), args.save, iteration=iteration)
            if stop:
                break
    # Leaving the block (close()) waits until every pending save is committed.
    # [readme] end
    if rank == 0:
        print(f"done at iteration {max(iteration, start)}"
              + (f": loss {loss!r}" if iteration > start else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (mcx.CkptOptionsError, mcx.errors.SaveDirectoryInUse, mcx.errors.CheckpointNotFound,
            mcx.errors.CheckpointIntegrityError, mcx.errors.CheckpointLoadError) as e:
        # at start-up: its message names the fix
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike: say it once
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
