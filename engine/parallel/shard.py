"""Build one rank's model shard, and carry a step's inputs from rank 0 to the others.

Both rank 0 (inside the engine's model runner) and every other rank (engine.parallel.rank)
build their shard with :func:`build_shard`: the model is defined on the meta device, swapped
to its parallel form (engine.parallel.layers), materialised empty on the rank's device and
filled with the weights the loader read for that rank only.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.config import ModelConfig
from engine.layers.attention import AttentionMetadata
from engine.layers.rotary import RotaryEmbedding
from engine.models.registry import model_class
from engine.parallel.group import TPGroup
from engine.parallel.layers import shard_model
from engine.parallel.plan import ShardPlan


def build_shard(mc: ModelConfig, plan: ShardPlan, group: TPGroup, weights: dict,
                device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(mc)(mc)
            shard_model(model, plan, group)
        model.to_empty(device=device)
        with torch.device(device):  # computed at construction: rebuilt for real
            model.rotary = RotaryEmbedding(mc.head_dim, mc.max_position, mc.rope_theta,
                                           mc.rope_scaling_dict)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(weights)
    model.eval()
    return model


# ------------------------------------------------------------------ step messages
def pack_step(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> dict:
    """What another rank needs to run the same forward pass (host arrays; no tensors)."""
    return {"ids": ids.cpu().numpy(), "pos": pos.cpu().numpy(),
            "slots": meta.slot_mapping.cpu().numpy(), "tables": meta.block_tables.cpu().numpy(),
            "qsl": meta.query_start_loc.cpu().numpy(), "seq_lens": list(meta.seq_lens_list),
            "qlens": list(meta.query_lens_list), "num_decode": meta.num_decode}


def unpack_step(msg: dict, device: torch.device):
    """``pack_step``'s inverse: (ids, positions, AttentionMetadata) on ``device``."""
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    seq_lens, qlens = msg["seq_lens"], msg["qlens"]
    meta = AttentionMetadata(
        slot_mapping=t(msg["slots"]), block_tables=t(msg["tables"]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=t(msg["qsl"]), seq_lens_list=seq_lens, query_lens_list=qlens,
        max_seq_len=max(seq_lens), max_query_len=max(qlens))
    nd = msg["num_decode"]
    if nd:  # as ModelRunner.prepare lays out a mixed step
        qsl = msg["qsl"].tolist()
        t0 = qsl[nd]
        meta.num_decode = nd
        meta.rest = AttentionMetadata(
            slot_mapping=meta.slot_mapping[t0:], block_tables=meta.block_tables[nd:],
            seq_lens=meta.seq_lens[nd:],
            query_start_loc=torch.tensor([x - t0 for x in qsl[nd:]], dtype=torch.int32,
                                         device=device),
            seq_lens_list=seq_lens[nd:], query_lens_list=qlens[nd:],
            max_seq_len=max(seq_lens[nd:]), max_query_len=max(qlens[nd:]))
    return t(msg["ids"]), t(msg["pos"]), meta


def head_view(cache: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """A rank's KV heads of a cache holding every head (``[.., num_kv_heads, head_dim]``)."""
    if cache.shape[4] == plan.num_kv_heads:
        return cache  # already this rank's own (GPU: one cache per rank)
    h0, h1 = plan.kv_heads
    return cache[:, :, :, :, h0:h1]


def local_logits(model: torch.nn.Module, hidden: torch.Tensor, group: TPGroup,
                 vocab: int) -> torch.Tensor:
    """Every rank's vocabulary slice of the logits, gathered (``[n, vocab]`` on all)."""
    return group.all_gather_last(model.compute_logits(hidden))[..., :vocab]
