"""TritonAttention: the GPU attention backend (store_kv + paged decode / prefill kernels).

Per layer it first writes the step's K/V into the paged cache (``store_kv``; slot -1 skips a
padded row, which the CUDA-graph decode path relies on), then:

* decode-only steps: ``paged_decode_attention``. Its split count depends only on the
  block-table width, so a graph captured with a fixed width replays for any context length;
* other steps, fp16 / bf16: every sequence whose chunk has at least ``long_min_query`` new
  tokens and a cached prefix no longer than the chunk goes through torch SDPA's fused causal
  kernel (cuDNN on an H200), one sequence at a time (engine/kernels/long_prefill.py); the
  rest (decode rows of a mixed step, short prompts, chunks after a long prefix) through one
  ``paged_prefill_attention`` launch over just those sequences. Measured on an H200 SDPA runs
  a 4096-token causal prefill at ~490 TFLOP/s against ~255 for the Triton paged kernel
  (bench/results/attention_prefill_gpu_h200.json);
* fp32 (or ``long_min_query=0``): a step whose sequences have no cached prefix and are long
  runs SDPA over the fresh K/V, one call per sequence; everything else one
  ``paged_prefill_attention`` launch over the whole ragged batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cache import rotary_store_kv, store_kv
from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.long_prefill import (LONG_MIN_QUERY, MAX_PREFIX_RATIO,
                                         long_prefill_attention, long_prefill_available,
                                         plan_for, sdpa_causal, warm_up)
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.layers.attention import AttentionBackend, AttentionMetadata

# Prefix-free sequences at least this long go through SDPA; shorter ones share one Triton
# launch (many small SDPA calls cost more in launches than they win in FLOP rate).
SDPA_MIN_TOKENS = 512


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, scale: float, sdpa_min_tokens: int = SDPA_MIN_TOKENS,
                 fuse_rotary: bool = True, long_min_query: int = LONG_MIN_QUERY):
        self.scale = scale
        self.sdpa_min_tokens = sdpa_min_tokens
        self.long_min_query = long_min_query  # 0: no cuDNN path for long chunks
        # the model passes rope=(positions, cos_sin_cache) instead of rotating q/k itself
        self.fuses_rotary = fuse_rotary

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, max_chunk: int, max_len: int) -> int:
        """Build the long-chunk path's SDPA plans for every length it can meet: prefix +
        chunk, at most twice the longest chunk (the step's token budget). Returns how many."""
        if not (self.long_min_query and device.type == "cuda" and dtype in (torch.float16,
                                                                             torch.bfloat16)):
            return 0
        longest = min(max_len, int((1 + MAX_PREFIX_RATIO) * max_chunk))
        return warm_up(num_heads, num_kv_heads, head_dim, dtype, device, longest)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, rope=None) -> torch.Tensor:
        if rope is not None:  # rotate q/k in place and store k/v: one launch
            rotary_store_kv(rope[0], q, k, v, rope[1], kv_cache, layer, meta.slot_mapping)
        else:
            store_kv(k, v, kv_cache, layer, meta.slot_mapping)
        if meta.decode_only:
            return paged_decode_attention(q, kv_cache, layer, meta.block_tables, meta.seq_lens,
                                          self.scale)
        if self.long_min_query and long_prefill_available(q, kv_cache):
            plan = plan_for(meta, kv_cache, q, self.long_min_query)
            if plan is not None:
                return long_prefill_attention(layer, q, k, v, kv_cache, meta, self.scale, plan)
        qlens, slens = meta.query_lens_list, meta.seq_lens_list
        if (all(a == b for a, b in zip(qlens, slens))
                and min(qlens) >= self.sdpa_min_tokens):
            out = torch.empty_like(q)
            start = 0
            for n in qlens:
                out[start:start + n] = sdpa_causal(q[start:start + n], k[start:start + n],
                                                   v[start:start + n], self.scale)
                start += n
            return out
        return paged_prefill_attention(q, kv_cache, layer, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens, self.scale,
                                       max_query_len=meta.max_query_len)
