"""Tensor parallelism as a module swap: :func:`shard_model` takes a model built from the full
``ModelConfig`` (on the meta device: nothing allocated) and replaces its projections and
embeddings with the parallel modules below, sized for one rank (engine.parallel.plan); the
model file stays plain. Column-parallel modules are ordinary linears over a slice of the
output features; row-parallel ones all-reduce their partial sums; the vocabulary-parallel
embedding looks up the rows it holds and all-reduces (other ranks contribute zeros).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import QLinear
from engine.parallel.group import TPGroup
from engine.parallel.plan import ShardPlan


class ColumnParallelLinear(QLinear):
    """``[.., in] -> [.., out/n]``: this rank's slice of the output features (no traffic)."""


class RowParallelLinear(QLinear):
    """``[.., in/n] -> [.., out]``: this rank's partial sum, all-reduced over the group."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x):
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of the vocabulary (``weight`` padded to ``per_rank`` rows)."""

    def __init__(self, plan: ShardPlan, hidden: int, group: TPGroup):
        super().__init__()
        self.start, self.end = plan.vocab_range
        self.weight = nn.Parameter(torch.empty(plan.vocab_per_rank, hidden), requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(x)


def shard_model(model: nn.Module, plan: ShardPlan, group: TPGroup) -> nn.Module:
    """Swap ``model``'s (a LlamaForCausalLM) modules for their parallel forms, in place; call
    under ``torch.device("meta")`` and materialise with ``to_empty`` before loading."""
    c = model.config
    hd = c.head_dim
    q, kv = plan.num_heads * hd, plan.num_kv_heads * hd
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        a.num_heads, a.num_kv_heads = plan.num_heads, plan.num_kv_heads
        a.q_size, a.kv_size = q, kv
        a.qkv_proj = ColumnParallelLinear(c.hidden_size, q + 2 * kv, bias=c.attention_bias)
        a.o_proj = RowParallelLinear(q, c.hidden_size, group)
        m.inter = plan.intermediate_size
        m.gate_up_proj = ColumnParallelLinear(c.hidden_size, 2 * m.inter, bias=False)
        m.down_proj = RowParallelLinear(m.inter, c.hidden_size, group)
    model.embed_tokens = VocabParallelEmbedding(plan, c.hidden_size, group)
    if model.lm_head is not None:  # vocabulary-parallel head: logits of this rank's rows
        model.lm_head = ColumnParallelLinear(c.hidden_size, plan.vocab_per_rank, bias=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model
