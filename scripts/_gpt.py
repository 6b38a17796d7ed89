"""Model, data, optimizer state and RNG pieces of scripts/pretrain_gpt.py (megatron-core GPT).

On CPU the local layer spec's core attention (DotProductAttention) needs CUDA (fused softmax, the
CUDA RNG tracker), so :class:`SDPAttention`, core attention through
``torch.nn.functional.scaled_dot_product_attention``, replaces it automatically when CUDA is absent.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SDPAttention", "batch", "build_model", "optimizer_sharded_state", "param_digest",
           "rng_sharded_state", "restore_rng"]


class SDPAttention(torch.nn.Module):
    """Causal core attention: [s, b, heads, dim] x3 -> [s, b, heads * dim]."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def build_model(args: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cuda = torch.cuda.is_available()
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        bf16=bool(args.bf16), params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    spec = get_gpt_layer_local_spec()
    if not cuda:
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True)
    return model.cuda() if cuda else model


def batch(args: Any, iteration: int, dp_rank: int, device: torch.device) -> tuple:
    """Deterministic synthetic tokens for (seed, iteration, data-parallel rank): no download, and
    independent of the RNG state, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration * 1009 + dp_rank)
    # A learnable pattern: each sequence repeats a short random motif.
    motif = torch.randint(0, args.vocab_size, (args.micro_batch_size, 8), generator=g)
    tokens = motif.repeat(1, args.seq_length // 8 + 2)[:, : args.seq_length + 1]
    tokens = tokens.to(device)
    position_ids = torch.arange(args.seq_length, device=device).unsqueeze(0).expand(args.micro_batch_size, -1)
    return tokens[:, :-1].contiguous(), position_ids, tokens[:, 1:].contiguous()


def init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's state tensors up front, so a checkpoint can be loaded into them."""
    for p in model.parameters():
        if p not in optimizer.state or not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def optimizer_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            dp_rank: int) -> dict:
    """Adam state as ShardedTensors, replicated over data-parallel ranks (rank 0 writes)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    out: dict = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        for field in ("exp_avg", "exp_avg_sq"):
            out[f"{field}.{name}"] = ShardedTensor.from_rank_offsets(
                f"optimizer.{field}.{name}", state[field], replica_id=dp_rank)
        out[f"step.{name}"] = ShardedTensor.from_rank_offsets(
            f"optimizer.step.{name}", state["step"].reshape(1), replica_id=dp_rank)
    return out


def rng_sharded_state(rank: int, world: int) -> Any:
    """Every RNG of this rank, as a ShardedObject (one per rank) so resume is bit-exact."""
    from megatron.core.dist_checkpointing import ShardedObject

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
             "cuda_tracker": _tracker().get_states() if torch.cuda.is_available() else None}
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("cuda_tracker") is not None and torch.cuda.is_available():
        _tracker().set_states(state["cuda_tracker"])


def _tracker():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()
