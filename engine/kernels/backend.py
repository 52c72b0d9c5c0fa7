"""TritonAttention: the GPU attention backend (store_kv + paged decode / prefill kernels).

Per layer it first writes the step's K/V into the paged cache (``store_kv``; slot -1 skips a
padded row, which the CUDA-graph decode path relies on), then:

* decode-only steps: ``paged_decode_attention``. Its split count depends only on the
  block-table width, so a graph captured with a fixed width replays for any context length;
* a step whose sequences have no cached prefix and are long: torch SDPA (flash) over the
  fresh K/V, one call per sequence: on a long causal prefill the flash kernel runs about
  twice as fast as the Triton paged kernel (docs/performance.md, "Kernels"); not with a
  quantized cache, whose prefills attend to the K/V as stored (codes), like its decodes;
* everything else (prefix hits, chunked prefill, many short prompts): one
  ``paged_prefill_attention`` launch over the whole ragged batch, reading K/V back from the
  cache;
* a mixed step (running sequences decoding while others prefill): the model runner puts the
  one-token rows first, and they take the decode kernel while the rest take one of the two
  paths above. The prefill kernel reads a sequence's context once per query head; the decode
  kernel once per K/V head, split over the GPU, so decode rows cost in a mixed step what they
  cost in a decode step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cache import rotary_store_kv, store_kv
from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.layers.attention import AttentionBackend, AttentionMetadata

# Prefix-free sequences at least this long go through SDPA; shorter ones share one Triton
# launch (many small SDPA calls cost more in launches than they win in FLOP rate).
SDPA_MIN_TOKENS = 512


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, scale: float, sdpa_min_tokens: int = SDPA_MIN_TOKENS,
                 fuse_rotary: bool = True, split_mixed: bool = True,
                 kv_quantized: bool = False, static_scales: torch.Tensor | None = None):
        """``kv_quantized``: the cache holds int8 / fp8 codes and scales (engine.quant.kv):
        store_kv quantizes, the attention kernels read codes, every prefill reads its K/V
        back from the cache (as a later decode step sees them: no SDPA over the fresh
        float K/V), and rotary runs apart from the store. ``static_scales``: a quantized
        cache's static scales (float32 [num_layers, 2, num_kv_heads]), None: dynamic."""
        self.scale = scale
        self.kv_quantized = kv_quantized
        self.static_scales = static_scales
        self.sdpa_min_tokens = sdpa_min_tokens
        # False: a mixed step's decode rows go through the prefill kernel with the rest
        self.split_mixed = split_mixed
        # the model passes rope=(positions, cos_sin_cache) instead of rotating q/k itself
        self.fuses_rotary = fuse_rotary and not kv_quantized

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, rope=None) -> torch.Tensor:
        if rope is not None:  # rotate q/k in place and store k/v: one launch
            rotary_store_kv(rope[0], q, k, v, rope[1], kv_cache, layer, meta.slot_mapping)
        else:
            store_kv(k, v, kv_cache, layer, meta.slot_mapping, self.static_scales)
        if meta.decode_only:
            return paged_decode_attention(q, kv_cache, layer, meta.block_tables, meta.seq_lens,
                                          self.scale)
        nd = meta.num_decode if self.split_mixed else 0
        if nd:  # a mixed step: its one-token rows come first and take the decode kernel
            out = torch.empty_like(q)
            out[:nd] = paged_decode_attention(q[:nd], kv_cache, layer, meta.block_tables[:nd],
                                              meta.seq_lens[:nd], self.scale)
            out[nd:] = self._prefill(layer, q[nd:], k[nd:], v[nd:], kv_cache, meta.rest)
            return out
        return self._prefill(layer, q, k, v, kv_cache, meta)

    def _prefill(self, layer, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Sequences of any query length (no one-token rows in a mixed step's ``rest``)."""
        qlens, slens = meta.query_lens_list, meta.seq_lens_list
        if (not self.kv_quantized  # its prefills read the stored codes, like its decodes
                and all(a == b for a, b in zip(qlens, slens))
                and min(qlens) >= self.sdpa_min_tokens):
            out = torch.empty_like(q)
            start = 0
            for n in qlens:
                out[start:start + n] = _sdpa_causal(q[start:start + n], k[start:start + n],
                                                    v[start:start + n], self.scale)
                start += n
            return out
        return paged_prefill_attention(q, kv_cache, layer, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens, self.scale,
                                       max_query_len=meta.max_query_len)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [n, Hk, D], causal with no prefix -> [n, Hq, D]."""
    # 4-D [1, H, n, D]: torch's flash / mem-efficient kernels take 4-D inputs only; 3-D falls
    # back to the math kernel, several times slower. K/V heads are shared by the kernel
    # (enable_gqa), not expanded by a copy first: faster, with the same output bits
    # (bench/attention_prefill_gpu.py compares the two)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)
