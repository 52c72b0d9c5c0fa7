"""The quantized KV cache (``kv_dtype = int8 | fp8``) and the attention that reads it.

Layout: the cache keeps its block-major shape ``[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim + 4]`` in int8 or float8_e4m3fn. Each (token, KV head) row holds the
head's ``head_dim`` codes, then the 4 bytes of its float32 scale (dynamic, per token and
head: ``max|x| / 127`` for int8, ``max|x| / 448`` for fp8, as a product with the float32
reciprocal). A block therefore carries its own
scales: a KV transfer that moves blocks moves the scales with them, and the layout two
workers compare at the handshake (dtype and the row of ``head_dim + 4``) tells a quantized
cache from a float one and int8 from fp8, so a mismatched pair refuses instead of reading
garbage.

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
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# a scale is max|x| times the float32 reciprocal of qmax, not max|x| / qmax: torch on CUDA
# divides by a Python scalar as a multiplication by its reciprocal, so only the product
# gives the same bits on the CPU, on CUDA and in the Triton store (engine.kernels.cache)
INV_QMAX = {dt: float(torch.tensor(1.0 / q, dtype=torch.float32)) for dt, q in _QMAX.items()}

__all__ = ["SCALE_BYTES", "CODE_DTYPES", "quantize_rows", "dequantize_rows", "QuantKVAttention"]


def quantize_rows(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> uint8 [..., D + 4]: the codes, then the row's float32 scale."""
    xf = x.float()
    qmax = _QMAX[code_dtype]
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) * INV_QMAX[code_dtype]
    y = (xf / scale).clamp_(-qmax, qmax)
    if code_dtype == torch.int8:
        y = torch.round(y)
    codes = y.to(code_dtype).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, code_dtype: torch.dtype, out_dtype: torch.dtype
                    ) -> torch.Tensor:
    """uint8 [..., D + 4] (see :func:`quantize_rows`) -> out_dtype [..., D]."""
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d].view(code_dtype).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (codes * scale).to(out_dtype)


class QuantKVAttention(AttentionBackend):
    """Torch attention over an int8 / fp8 cache (CPU, and the GPU's torch backend)."""

    name = "torch-kvq"

    def __init__(self, scale: float, code_dtype: torch.dtype):
        self.scale = scale
        self.code_dtype = code_dtype

    def _store(self, k, v, kv_cache, layer, meta) -> None:
        raw = kv_cache.view(torch.uint8)
        bs = kv_cache.shape[3]
        blk, off = meta.slot_mapping // bs, meta.slot_mapping % bs
        raw[:, layer, 0][blk, off] = quantize_rows(k, self.code_dtype)
        raw[:, layer, 1][blk, off] = quantize_rows(v, self.code_dtype)

    def _gather(self, kv_cache, layer, which: int, blocks: torch.Tensor, dtype) -> torch.Tensor:
        rows = kv_cache.view(torch.uint8)[:, layer, which].index_select(0, blocks)
        return dequantize_rows(rows, self.code_dtype, dtype)  # [nb, bs, Hk, D]

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
