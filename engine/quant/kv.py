"""The quantized KV cache (``kv_dtype = int8 | fp8``) and the attention that reads it.

Layout: the cache keeps its block-major shape ``[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim + 4]`` in int8 or float8_e4m3fn, so it holds 4 bytes more per (token,
KV head) than its codes. Each (block, layer, K/V) slab of those bytes holds the codes
``[block_size, num_kv_heads, head_dim]`` first, then the float32 scales ``[num_kv_heads,
block_size]``: dynamic, per token and head (``max|x| / 127`` for int8, ``max|x| / 448`` for
fp8, as a product with the float32 reciprocal), or static (``kv_scales``: one calibrated
scale per layer, K/V and head, engine.quant.kv_scales, written into every row's slot so the
readers are the same for both; values beyond the static range saturate). Code rows start at multiples of head_dim,
so the kernels load them 16 bytes at a time (rows of head_dim + 4 bytes, as an earlier
layout had them, allowed only 4-byte loads), and one head's scales for a block are
contiguous. A block therefore carries its own scales: a KV transfer that moves blocks moves
the scales with them, and the layout two workers compare at the handshake (dtype and the
last dim of ``head_dim + 4``) tells a quantized cache from a float one and int8 from fp8,
so a mismatched pair refuses instead of reading garbage.

:class:`QuantKVAttention` stores the step's K/V quantized, then attends every query to its
sequence's context read back (dequantized) from the cache, the step's own tokens included:
a prefill sees exactly the K/V a later decode step sees.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention import AttentionBackend, _sdpa

SCALE_BYTES = 4
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# the name of this layout in a KV transfer's layout (kvtransfer.api.PACKED_DTYPES), per dtype
PACKED_KV = {torch.int8: "int8/slab", torch.float8_e4m3fn: "fp8/slab"}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# a scale is max|x| times the float32 reciprocal of qmax, not max|x| / qmax: torch on CUDA
# divides by a Python scalar as a multiplication by its reciprocal, so only the product
# gives the same bits on the CPU, on CUDA and in the Triton store (engine.kernels.cache)
INV_QMAX = {dt: float(torch.tensor(1.0 / q, dtype=torch.float32)) for dt, q in _QMAX.items()}

__all__ = ["SCALE_BYTES", "CODE_DTYPES", "PACKED_KV", "quantize", "dequantize", "slabs",
           "read_cache", "QuantKVAttention"]


def quantize(x: torch.Tensor, code_dtype: torch.dtype, scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D], scales float32 [...]). ``scale``: static scales
    (float32, broadcast to ``x.shape[:-1]``, e.g. one per head for x [tokens, heads, D]);
    None: each row's own (dynamic)."""
    xf = x.float()
    qmax = _QMAX[code_dtype]
    if scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) * INV_QMAX[code_dtype]
    else:
        scale = scale.float().expand(xf.shape[:-1]).unsqueeze(-1)
    y = (xf / scale).clamp_(-qmax, qmax)
    if code_dtype == torch.int8:
        y = torch.round(y)
    return y.to(code_dtype).view(torch.uint8), scale.squeeze(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, code_dtype: torch.dtype,
               out_dtype: torch.dtype) -> torch.Tensor:
    """codes uint8 [..., D], scales float32 [...] (see :func:`quantize`) -> out_dtype."""
    return (codes.view(code_dtype).float() * scales.unsqueeze(-1)).to(out_dtype)


def slabs(kv_cache: torch.Tensor, layer: int, which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's K (``which`` 0) or V (1) in every block of a quantized cache:
    codes uint8 [num_blocks, block_size, num_kv_heads, head_dim] and scales float32
    [num_blocks, num_kv_heads, block_size]. Writing through them writes the cache."""
    nb, _, _, bs, hk, row = kv_cache.shape
    d = row - SCALE_BYTES
    flat = kv_cache.view(torch.uint8)[:, layer, which].view(nb, bs * hk * row)
    codes = flat[:, :bs * hk * d].view(nb, bs, hk, d)
    scales = flat[:, bs * hk * d:].view(torch.float32).view(nb, hk, bs)
    return codes, scales


def read_cache(kv_cache: torch.Tensor, layer: int, out_dtype: torch.dtype,
               blocks: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of a quantized cache dequantized: [num_blocks (or len(blocks)), 2,
    block_size, num_kv_heads, head_dim] of out_dtype (a float cache's layer, for references
    and benchmarks)."""
    code_dtype = kv_cache.dtype
    out = []
    for which in (0, 1):
        codes, scales = slabs(kv_cache, layer, which)
        if blocks is not None:
            codes, scales = codes.index_select(0, blocks), scales.index_select(0, blocks)
        out.append(dequantize(codes, scales.transpose(1, 2), code_dtype, out_dtype))
    return torch.stack(out, dim=1)


class QuantKVAttention(AttentionBackend):
    """Torch attention over an int8 / fp8 cache (CPU, and the GPU's torch backend)."""

    name = "torch-kvq"

    def __init__(self, scale: float, code_dtype: torch.dtype,
                 static_scales: torch.Tensor | None = None):
        """``static_scales``: float32 [num_layers, 2, num_kv_heads] (engine.quant.kv_scales),
        or None for dynamic scales."""
        self.scale = scale
        self.code_dtype = code_dtype
        self.static_scales = static_scales

    def _store(self, k, v, kv_cache, layer, meta) -> None:
        bs = kv_cache.shape[3]
        blk, off = meta.slot_mapping // bs, meta.slot_mapping % bs
        for which, x in ((0, k), (1, v)):
            codes, scales = slabs(kv_cache, layer, which)
            static = None if self.static_scales is None else self.static_scales[layer, which]
            c, sc = quantize(x, self.code_dtype, static)
            codes[blk, off] = c
            scales[blk, :, off] = sc

    def _gather(self, kv_cache, layer, which: int, blocks: torch.Tensor, dtype) -> torch.Tensor:
        codes, scales = slabs(kv_cache, layer, which)
        return dequantize(codes.index_select(0, blocks),
                          scales.index_select(0, blocks).transpose(1, 2), self.code_dtype,
                          dtype)  # [nb, bs, Hk, D]

    def forward(self, layer, q, k, v, kv_cache, meta):
        self._store(k, v, kv_cache, layer, meta)
        if meta.decode_only:
            return self._decode(layer, q, kv_cache, meta)
        out = torch.empty_like(q)
        bs = kv_cache.shape[3]
        start = 0
        for i, (qlen, slen) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            end = start + qlen
            blocks = meta.block_tables[i, :-(-slen // bs)].long()
            kk = self._gather(kv_cache, layer, 0, blocks, q.dtype).flatten(0, 1)[:slen]
            vv = self._gather(kv_cache, layer, 1, blocks, q.dtype).flatten(0, 1)[:slen]
            out[start:end] = _sdpa(q[start:end], kk, vv, self.scale, causal=True,
                                   offset=slen - qlen)
            start = end
        return out

    def _decode(self, layer, q, kv_cache, meta):
        bs = kv_cache.shape[3]
        b, hq, d = q.shape
        hk = kv_cache.shape[4]
        nb = -(-meta.max_seq_len // bs)
        idx = meta.block_tables[:, :nb].reshape(-1).long()
        pos = torch.arange(nb * bs, device=q.device)
        mask = (pos[None, :] < meta.seq_lens.long()[:, None])[:, None, None, :]
        k = self._gather(kv_cache, layer, 0, idx, q.dtype).view(b, nb * bs, hk, d).transpose(1, 2)
        v = self._gather(kv_cache, layer, 1, idx, q.dtype).view(b, nb * bs, hk, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.view(b, hk, hq // hk, d), k, v, attn_mask=mask,
                                             scale=self.scale)
        return out.reshape(b, hq, d)
