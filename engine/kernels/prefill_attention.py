"""Paged varlen prefill attention (FlashAttention-2 style), causal, with a cached prefix.

Every K/V row, the new tokens' included, is read from the paged cache: the caller runs
store_kv for the new tokens first, so no separate k/v arguments are needed. Grid is
(query tiles of the longest query, num_seqs, num_heads); tiles past a sequence's query
length do nothing. KV tiles left of the diagonal run without the causal mask. A quantized
cache is read as decode_attention reads it (``kv_tile``: codes converted in registers, the
rows' scales folded into scores and probabilities).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (FLOAT_DTYPES, check_kv_cache, check_shape, check_tensor,
                                    kv_geometry, kv_quant_kind, next_pow2)
from engine.kernels.decode_attention import kv_tile, softmax_accumulate

_LOG2E = 1.4426950408889634
_INT = (torch.int32, torch.int64)
CUDA_CONFIG = (128, 64, 8, 2)  # picked on the H200 for bf16, head_dim 128 (docs/performance.md)


@triton.jit
def _tile(q, acc, m_i, l_i, kv_base, sc_base, bt_row, s_blk, s_tok, s_kv, lo, hi, q_pos,
          qk_scale, block_size, d, d_mask, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
          UPCAST: tl.constexpr, KVQ: tl.constexpr, ALIGN: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        blk = tl.load(bt_row + pos // block_size, mask=n_mask, other=0)
        slab = blk.to(tl.int64) * s_blk
        off = slab + (pos % block_size) * s_tok
        sc_ptrs = sc_base + slab + (pos % block_size) * 4
        if KVQ:  # code rows start ALIGN-byte aligned (engine.kernels._checks.kv_geometry)
            off = tl.multiple_of(off, ALIGN)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k, k_scale = kv_tile(kv_base + off[:, None] + d[None, :], sc_ptrs, kv_mask, n_mask,
                             KVQ, False)
        v, v_scale = kv_tile(kv_base + s_kv + off[:, None] + d[None, :], sc_ptrs + s_kv,
                             kv_mask, n_mask, KVQ, False)
        if UPCAST:  # the CPU interpreter's tl.dot mishandles bf16
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        else:
            k, v = k.to(q.dtype), v.to(q.dtype)  # codes -> q's dtype (a float cache: as is)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if KVQ:
            s = s * k_scale[None, :]
        if CAUSAL:
            s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        acc, m_i, l_i = softmax_accumulate(s, v, v_scale, acc, m_i, l_i, KVQ)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["layer", "stride_bt"])  # see decode_attention._VARYING
def _prefill_kernel(q_ptr, cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, layer, qk_scale,
                    group, head_dim, block_size, stride_q_tok, stride_q_head, stride_o_tok,
                    stride_o_head, stride_bt, s_blk, s_layer, s_kv, s_tok, s_head, sc_off,
                    sc_head, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, KVQ: tl.constexpr,
                    ALIGN: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    prefix = tl.load(seq_lens_ptr + seq) - q_len
    live = m0 < q_len
    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < head_dim
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + m
    # [0, full_hi): every query row of the tile sees it; [full_hi, hi): diagonal, masked
    full_hi = tl.where(live, (prefix + m0) // BLOCK_N * BLOCK_N, 0)
    hi = tl.where(live, prefix + tl.minimum(m0 + BLOCK_M, q_len), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_base = cache_ptr + layer * s_layer + (head // group) * s_head
    sc_base = cache_ptr + layer * s_layer + sc_off + (head // group) * sc_head
    if KVQ:
        kv_base = tl.multiple_of(kv_base, ALIGN)
    bt_row = bt_ptr + seq * stride_bt
    acc, m_i, l_i = _tile(q, acc, m_i, l_i, kv_base, sc_base, bt_row, s_blk, s_tok, s_kv, 0,
                          full_hi, q_pos, qk_scale, block_size, d, d_mask, BLOCK_N, False,
                          UPCAST, KVQ, ALIGN)
    acc, m_i, l_i = _tile(q, acc, m_i, l_i, kv_base, sc_base, bt_row, s_blk, s_tok, s_kv,
                          full_hi, hi, q_pos, qk_scale, block_size, d, d_mask, BLOCK_N, True,
                          UPCAST, KVQ, ALIGN)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            max_query_len: int | None = None) -> torch.Tensor:
    """q [total_tokens, num_heads, head_dim]: sequence i's new tokens are rows
    query_start_loc[i]:query_start_loc[i+1] (int32 [num_seqs + 1]); seq_lens int32
    [num_seqs] = cached prefix + new tokens, all already in the cache. Query j of sequence i
    sits at position seq_lens[i] - query_len_i + j and attends causally.
    max_query_len sizes the grid; None reads it from the device (one host sync).
    kv_cache: float, of q's dtype, or quantized (engine.kernels.decode_attention)."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache, layer, quantized=True)
    kvq = kv_quant_kind(kv_cache)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES if kvq else (kv_cache.dtype,),
                 device=kv_cache.device)
    check_shape("q", q, (None, None, head_dim))
    num_heads = q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=_INT, device=q.device)
    num_seqs = block_tables.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=_INT,
                 device=q.device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_INT, device=q.device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    out = torch.empty_like(q)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # (BLOCK_M, BLOCK_N, num_warps, num_stages); the interpreter gets small tiles
    block_m, block_n, warps, stages = CUDA_CONFIG if q.is_cuda else (16, 16, 4, 1)
    *geom, align = kv_geometry(kv_cache)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, kv_cache.view(torch.uint8) if kvq else kv_cache, block_tables, query_start_loc,
        seq_lens, out, int(layer), scale * _LOG2E, num_heads // num_kv_heads, head_dim,
        block_size, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *geom, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=next_pow2(head_dim), UPCAST=not q.is_cuda, KVQ=kvq, ALIGN=align,
        num_warps=warps, num_stages=stages)
    return out
