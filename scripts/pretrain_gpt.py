#!/usr/bin/env python3
"""A Megatron-style GPT trainer over megatron-core, checkpointing through megatron-ckpt-ext.

Launch with torchrun (gloo on CPU, NCCL on GPU), any number of ranks (data parallel):

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --train-iters 20 \\
        --save ckpt --save-interval 10 --async-save --async-ckpt-use-cpu-shm \\
        --ckpt-assume-constant-structure --metrics-file metrics.json

Model + optimizer + RNG + iteration are saved with the Checkpointer; ``--load DIR`` resumes from
the tracker's iteration. As in Megatron-LM, a DIR that holds no committed checkpoint (empty or
missing) gives a warning and training starts from scratch; ``--exit-on-missing-checkpoint`` makes it
an error. Flags are never abbreviated (``allow_abbrev=False``, as Megatron-LM). The loss and every
gradient are checked for NaN/Inf each step (``--no-check-for-nan-in-loss-and-grad`` turns it off).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpt  # noqa: E402

import megatron_ckpt_ext as mcx  # noqa: E402

log = logging.getLogger("pretrain_gpt")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # every rank parses the same command line: say it once
        if os.environ.get("RANK", "0") != "0":
            sys.exit(2)
        super().error(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    g = p.add_argument_group("model and training (Megatron spellings)")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--vocab-size", type=int, default=512)
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="only 1 is supported by this trainer (data parallel across ranks)")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--metrics-file", default=None, help="per-step losses (exact, hex) as JSON")
    g.add_argument("--ckpt-config", default=None,
                   help="YAML with checkpoint knobs (NeMo-RL megatron_cfg style); overrides flags")
    mcx.add_arguments(p)
    args = p.parse_args(argv)
    if args.tensor_model_parallel_size != 1:
        p.error("--tensor-model-parallel-size: this trainer runs data parallel only; use 1")
    if args.save_interval and not args.save:
        p.error("--save-interval needs --save DIR")
    return args


_SEED = [1234]


def options_seed() -> int:
    return _SEED[0]


def init_distributed(options: mcx.CkptOptions) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = options.distributed_timeout()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    if cuda:  # the stock local attention forks megatron's CUDA RNG tracker
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(options_seed())


def sharded_state(model, optimizer, iteration: int, options: mcx.CkptOptions) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"model": model.sharded_state_dict(),
             "optimizer": _gpt.optimizer_sharded_state(model, optimizer, rank),
             "iteration": iteration}
    if options.save_rng:
        state["rng_state"] = _gpt.rng_sharded_state(rank, world)
    return state


def load(ckpt: mcx.Checkpointer, model, optimizer, args, options) -> int:
    """The iteration to continue from: the loaded one, or 0 where ``--load`` holds no committed
    checkpoint (the Checkpointer warned; with --exit-on-missing-checkpoint it raised)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    like = {"model": model.sharded_state_dict(),
            "optimizer": _gpt.optimizer_sharded_state(model, optimizer, rank)}
    if options.load_rng:
        like["rng_state"] = _gpt.rng_sharded_state(rank, world)
    try:
        loaded = ckpt.load(like, args.load)
    except (FileNotFoundError, mcx.errors.CheckpointIntegrityError,
            mcx.errors.CheckpointLoadError) as e:
        startup_error(f"--load {args.load}: {e}")
    if loaded is None:
        return 0
    model.load_state_dict(loaded["model"], strict=False)
    for name, p in model.named_parameters():
        st = optimizer.state[p]
        st["exp_avg"].copy_(loaded["optimizer"][f"exp_avg.{name}"])
        st["exp_avg_sq"].copy_(loaded["optimizer"][f"exp_avg_sq.{name}"])
        st["step"].copy_(loaded["optimizer"][f"step.{name}"].reshape(()))
    if options.load_rng:
        _gpt.restore_rng(loaded["rng_state"])
    return int(loaded["iteration"])


def startup_error(error: object) -> None:
    """A start-up error (a bad knob, an unusable --save or --load): every rank fails alike and
    the message names the fix, so rank 0 prints it once, with no traceback; exit 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


NAN_CHECK_FLAG = "--no-check-for-nan-in-loss-and-grad"


def check_finite(loss: torch.Tensor, model: torch.nn.Module, iteration: int) -> None:
    """Raise FloatingPointError, naming the iteration, when the loss or a gradient holds NaN/Inf.

    Called on the data-parallel averages, so every rank reaches the same verdict and raises at
    the same step (none is left waiting in a collective). One device sync per step: the norms
    are summed first and the culprit is looked for only on failure.
    """
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for _, g in grads]
    total = loss.float() + (torch.stack(norms).sum() if norms else 0.0)
    if bool(torch.isfinite(total)):
        return
    if not bool(torch.isfinite(loss)):
        what = f"the loss is {loss.item()}"
    else:
        name = next(n for n, g in grads if not bool(torch.isfinite(g).all()))
        what = f"the gradient of {name} holds NaN/Inf"
    raise FloatingPointError(
        f"iteration {iteration}: {what}; stopped before the optimizer step. Lower --lr or check "
        f"the data; {NAN_CHECK_FLAG} turns this check off.")


def train_step(model, optimizer, args, options: mcx.CkptOptions, iteration: int, device) -> float:
    tokens, position_ids, labels = _gpt.batch(args, iteration, dist.get_rank(), device)
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    world = dist.get_world_size()
    for p in model.parameters():  # data-parallel gradient average, in a fixed order
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    reduced /= world
    if options.check_for_nan_in_grad:
        check_finite(reduced, model, iteration)
    optimizer.step()
    return reduced.item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # a bad knob, key or file: its message names it and the fix; no traceback
        options = (mcx.CkptOptions.from_yaml(args.ckpt_config, extra="ignore") if args.ckpt_config
                   else mcx.CkptOptions.from_args(args))
    except mcx.CkptOptionsError as e:
        startup_error(e)
    logging.basicConfig(level=options.logging_level or logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    _SEED[0] = args.seed
    torch.use_deterministic_algorithms(True, warn_only=True)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    init_distributed(options)
    rank = dist.get_rank()
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # Built before the model, so its writer process starts while the model is being built.
    # An unwritable --save fails here, at start-up, not at the first save.
    try:
        checkpointer = mcx.Checkpointer(options, save_dir=args.save)
    except (mcx.CkptOptionsError, mcx.errors.SaveDirectoryInUse) as e:
        startup_error(e)
    if args.load:  # a snapshot this node holds of --load (a job killed here) is mapped, summed
        checkpointer.prepare_restore(args.load)  # and pinned while the model is built
    model = _gpt.build_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    _gpt.init_optimizer_state(model, optimizer)
    losses: dict[str, str] = {}
    with checkpointer as ckpt:
        start = load(ckpt, model, optimizer, args, options) if args.load else 0
        if start:
            log.info("resumed from %s at iteration %d", args.load, start)
        if args.save and args.save_interval:  # staging buffers allocated now, in the background
            ckpt.prepare(sharded_state(model, optimizer, start, options))
        for iteration in range(start + 1, args.train_iters + 1):
            t0 = time.perf_counter()
            loss = train_step(model, optimizer, args, options, iteration, device)
            losses[str(iteration)] = float(loss).hex()
            ckpt.maybe_finalize()
            if args.save_interval and iteration % args.save_interval == 0:
                ckpt.save(sharded_state(model, optimizer, iteration, options), args.save,
                          iteration=iteration)
            if iteration % args.log_interval == 0:
                log.info("iteration %d | loss %.6f | %.1f ms", iteration, loss,
                         1e3 * (time.perf_counter() - t0))
        ckpt.maybe_finalize(blocking=True)
        reports = ckpt.reports
    if rank == 0 and args.metrics_file:
        Path(args.metrics_file).write_text(json.dumps(
            {"losses": losses, "param_digest": _gpt.param_digest(model), "reports": reports,
             "options": options.to_dict(), "world_size": dist.get_world_size()}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
