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
    """The rank's model over ``weights`` (HF names, this rank's slices), which it empties:
    each tensor becomes a parameter without a copy (q/k/v and gate/up are fused one layer
    at a time, their parts freed), so loading peaks at about one shard, not two."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(mc)(mc)
            shard_model(model, plan, group)
        model.load_state_dict(_fused_state(mc, weights, device, dtype), strict=True,
                              assign=True)
        with torch.device(device):  # computed at construction: rebuilt for real
            model.rotary = RotaryEmbedding(mc.head_dim, mc.max_position, mc.rope_theta,
                                           mc.rope_scaling_dict)
    finally:
        torch.set_default_dtype(prev)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def _fused_state(mc: ModelConfig, w: dict, device, dtype) -> dict:
    """HF-named weights -> the model's state dict (the fusions of LlamaForCausalLM's
    ``load_weights``), taking each tensor out of ``w`` as it goes."""
    def take(name: str) -> torch.Tensor:
        if name not in w:
            raise ValueError(f"checkpoint is missing {name}")
        return w.pop(name).to(device=device, dtype=dtype)

    def cat(names: list[str]) -> torch.Tensor:
        return torch.cat([take(n) for n in names])

    sd = {"embed_tokens.weight": take("model.embed_tokens.weight"),
          "norm.weight": take("model.norm.weight")}
    if not mc.tie_word_embeddings:
        sd["lm_head.weight"] = take("lm_head.weight")
    for i in range(mc.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        a, m = src + "self_attn.", src + "mlp."
        sd[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        sd[dst + "post_attention_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        sd[dst + "self_attn.qkv_proj.weight"] = cat([a + x + "_proj.weight" for x in "qkv"])
        if mc.attention_bias:
            sd[dst + "self_attn.qkv_proj.bias"] = cat([a + x + "_proj.bias" for x in "qkv"])
        sd[dst + "self_attn.o_proj.weight"] = take(a + "o_proj.weight")
        sd[dst + "mlp.gate_up_proj.weight"] = cat([m + "gate_proj.weight", m + "up_proj.weight"])
        sd[dst + "mlp.down_proj.weight"] = take(m + "down_proj.weight")
    return sd


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
