"""Paged decode attention (one query token per sequence), GQA, flash-decoding splits.

Grid (num_seqs, num_kv_heads, num_splits): each program loads the query heads of one kv-head
group (padded to >= 16 rows for tl.dot) and streams that group's K/V once over its share of
the context. With one split it writes the output; with several it writes fp32 partials
(acc, running max, sum-exp) and a reduce kernel combines them. num_splits is chosen from
shapes only (never from device values), so the launch is CUDA-graph safe.

A quantized cache (int8 / fp8 codes and a float32 scale per token and head, in the slab
layout of engine.kernels._checks) is read as bytes: each K/V tile's codes (16-byte loads of
head_dim-aligned rows) are converted in registers and its rows' scales fold into the
scores (K: s[:, n] * k_scale[n]) and the probabilities (V: p[:, n] * v_scale[n]), so no
dequantized tile is ever written. ``kv_tile`` is shared with the prefill kernel.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (FLOAT_DTYPES, check_kv_cache, check_shape, check_tensor,
                                    kv_geometry, kv_quant_kind, next_pow2)

_LOG2E = 1.4426950408889634
_INT = (torch.int32, torch.int64)


# Triton compiles a kernel again for every new "class" of an integer argument (== 1, a
# multiple of 16, other). The arguments below change from step to step (the layer, the
# split count and the block-table width of eager steps), so each new class met under load
# cost a compile in the middle of serving, which every request of that step waited for
# (docs/performance.md, "Triton compiles during serving"). Unspecialized, each kernel
# compiles once per constexpr set, which warm-up and graph capture reach.
_VARYING = ["layer", "num_splits", "stride_bt"]
# (BLOCK_N, num_warps, num_stages, TYPED, F16) on CUDA per KVQ (0 float, 1 int8, 2 fp8);
# TYPED / F16 only matter for a quantized cache (kv_tile, _decode_kernel). Picked on the
# H200 by bench/kernels_gpu.py --decode-sweep (set kernels_gpu/h200-kvslab, 2026-12-03):
# bf16 64 / 3 stages within 5% of the best at every batch and context timed (32 / 2 was up
# to 31% slower at 32k context); fp8 128 / 2 with fp16 dots (codes convert to fp16 in one
# instruction; 10-15% faster than bf16 dots); int8 64 / 2 in q's dtype (fp16 dots slower).
DECODE_CONFIG = {0: (64, 4, 3, False, False), 1: (64, 4, 2, False, False),
                 2: (128, 4, 2, True, True)}


@triton.jit
def kv_tile(ptrs, scale_ptrs, mask, n_mask, KVQ: tl.constexpr, TYPED: tl.constexpr):
    """A [N, D] K or V tile and its rows' scales (float32 [N]). KVQ 0, a float cache: the
    tile as stored, scales unused. KVQ 1 / 2: ``ptrs`` point at int8 / e4m3 code bytes, the
    tile is the codes as int8 / float8e4nv (the caller converts them to its compute dtype:
    exact in bf16 / fp16, |int8| <= 127 and every e4m3 value), loaded through pointers of
    that type (TYPED) or as bytes then bitcast; ``scale_ptrs`` at each row's float32 scale
    (byte pointers)."""
    if KVQ == 0:
        tile = tl.load(ptrs, mask=mask, other=0.0)
        scales = tl.zeros(n_mask.shape, tl.float32)
    else:
        if TYPED and KVQ == 1:
            tile = tl.load(ptrs.to(tl.pointer_type(tl.int8)), mask=mask, other=0)
        elif TYPED:
            tile = tl.load(ptrs.to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0)
        elif KVQ == 1:
            tile = tl.load(ptrs, mask=mask, other=0).to(tl.int8, bitcast=True)
        else:
            tile = tl.load(ptrs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
        scales = tl.load(scale_ptrs.to(tl.pointer_type(tl.float32)), mask=n_mask, other=0.0)
    return tile, scales


@triton.jit
def softmax_accumulate(s, v, v_scale, acc, m_i, l_i, KVQ: tl.constexpr):
    """One online-softmax step over a tile of scores ``s`` [M, N] (base 2, masked entries
    -inf) and its V tile: (acc, m_i, l_i) updated. A quantized V's row scales multiply the
    probabilities after their sum is taken (the sum is of the softmax, not of V)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KVQ:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=_VARYING)
def _decode_kernel(q_ptr, cache_ptr, bt_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr, layer, qk_scale,
                   group, head_dim, block_size, num_splits,
                   stride_q_seq, stride_q_head, stride_o_seq, stride_o_head, stride_bt,
                   s_blk, s_layer, s_kv, s_tok, s_head, sc_off, sc_head,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, UPCAST: tl.constexpr, KVQ: tl.constexpr,
                   ALIGN: tl.constexpr, TYPED: tl.constexpr, F16: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if F16:  # a quantized cache's dots in fp16 (codes convert to it directly)
        q = q.to(tl.float16)
    ctx = tl.load(ctx_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(ctx, start + chunk)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    base = cache_ptr + layer * s_layer + kvh * s_head
    sc_base = cache_ptr + layer * s_layer + sc_off + kvh * sc_head  # quantized: scales
    if KVQ:  # code rows start ALIGN-byte aligned (engine.kernels._checks.kv_geometry)
        base = tl.multiple_of(base, ALIGN)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        blk = tl.load(bt_ptr + seq * stride_bt + pos // block_size, mask=n_mask, other=0)
        slab = blk.to(tl.int64) * s_blk
        tok_off = slab + (pos % block_size) * s_tok
        sc_ptrs = sc_base + slab + (pos % block_size) * 4
        if KVQ:
            tok_off = tl.multiple_of(tok_off, ALIGN)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k, k_scale = kv_tile(base + tok_off[:, None] + d[None, :], sc_ptrs,
                             kv_mask, n_mask, KVQ, TYPED)  # [N, D], [N]
        v, v_scale = kv_tile(base + s_kv + tok_off[:, None] + d[None, :], sc_ptrs + s_kv,
                             kv_mask, n_mask, KVQ, TYPED)
        if UPCAST:  # the CPU interpreter's tl.dot mishandles bf16
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        else:
            k, v = k.to(q.dtype), v.to(q.dtype)  # codes -> q's dtype (a float cache: as is)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # qk_scale = scale * log2(e): softmax in exp2
        if KVQ:
            s = s * k_scale[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        acc, m_i, l_i = softmax_accumulate(s, v, v_scale, acc, m_i, l_i, KVQ)
    if SPLIT:
        row = (seq * tl.num_programs(1) * group + heads) * num_splits + split  # [B, H, S]
        tl.store(acc_ptr + row[:, None] * head_dim + d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=g_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(acc_ptr, ml_ptr, out_ptr, num_heads, head_dim, num_splits,
                   stride_o_seq, stride_o_head, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    row = (seq * num_heads + head) * num_splits + sp
    m = tl.load(ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # no split had tokens
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    acc = tl.load(acc_ptr + row[:, None] * head_dim + d[None, :],
                  mask=s_mask[:, None] & (d[None, :] < head_dim), other=0.0)
    denom = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


@functools.lru_cache(maxsize=None)
def _sm_count(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device) -> int:
    """Enough (seq, kv head, split) programs to fill the GPU, each with >= 256 tokens."""
    sms = _sm_count(device.index) if device.type == "cuda" else 132
    programs = max(1, num_seqs * num_kv_heads)
    want = triton.cdiv(2 * sms, programs)
    return int(max(1, min(want, max_context // 256, 64)))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] (the last token of each sequence, whose K/V are
    already stored) attends to context_lens[i] cached tokens. block_tables int32
    [num_seqs, max_blocks]; context_lens int32 [num_seqs] (0 gives a zero output row).
    num_splits None picks from shapes: max context is taken as max_blocks * block_size.
    kv_cache: float, of q's dtype, or quantized (int8 / fp8 codes + scales, module doc)."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache, layer, quantized=True)
    kvq = kv_quant_kind(kv_cache)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES if kvq else (kv_cache.dtype,),
                 device=kv_cache.device)
    num_seqs, num_heads = q.shape[0], q.shape[1]
    check_shape("q", q, (num_seqs, None, head_dim))
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=_INT, device=q.device)
    check_shape("block_tables", block_tables, (num_seqs, None))
    check_tensor("context_lens", context_lens, ndim=1, dtypes=_INT, device=q.device)
    check_shape("context_lens", context_lens, (num_seqs,))
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads,
                                       block_tables.shape[1] * block_size, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    split = num_splits > 1
    acc = ml = out  # placeholders when not split
    if split:
        acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                          device=q.device)
        ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32,
                         device=q.device)
    *geom, align = kv_geometry(kv_cache)
    block_d = next_pow2(head_dim)
    block_n, warps, stages, typed, f16 = (DECODE_CONFIG[kvq] if q.is_cuda
                                          else (32, 4, 1, True, False))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache.view(torch.uint8) if kvq else kv_cache, block_tables, context_lens, out,
        acc, ml, int(layer), scale * _LOG2E, group, head_dim, block_size, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *geom,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n, SPLIT=split,
        UPCAST=not q.is_cuda, KVQ=kvq, ALIGN=align, TYPED=typed,
        F16=f16 and bool(kvq) and q.dtype != torch.float32,
        num_warps=warps, num_stages=stages)
    if split:
        _reduce_kernel[(num_seqs, num_heads)](acc, ml, out, num_heads, head_dim, num_splits,
                                              out.stride(0), out.stride(1),
                                              BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d)
    return out
