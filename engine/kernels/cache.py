"""store_kv: write one layer's new K/V rows into the paged, block-major KV cache (float, or
int8 / fp8 codes with a scale per token and head: engine.quant.kv's layout and math; the
scale is each row's own, or a static one per layer, K/V and head)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (FLOAT_DTYPES, check_kv_cache, check_shape,
                                    check_tensor, kv_geometry, kv_quant_kind, next_pow2)

_QMAX = {1: 127.0, 2: 448.0}  # int8, e4m3: engine.quant.kv._QMAX
# float32(1 / qmax), engine.quant.kv.INV_QMAX: a scale is max|x| times it
_INV = {k: float(torch.tensor(1.0 / q, dtype=torch.float32)) for k, q in _QMAX.items()}


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, layer, n_heads, head_dim, block_size,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     s_blk, s_layer, s_kv, s_tok, s_head,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < n_heads) & (d < head_dim)
        dst = (cache_ptr + (slot // block_size) * s_blk + layer * s_layer
               + (slot % block_size) * s_tok + h * s_head + d)
        k = tl.load(k_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
        v = tl.load(v_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + s_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, qmax, inv_qmax, static, KVQ: tl.constexpr, STATIC: tl.constexpr):
    """x float32 [H, D] (masked columns 0) -> (codes as uint8 [H, D], scale float32 [H]):
    scale = max(max|x|, 1e-8) * float32(1 / qmax), or ``static`` [H] when STATIC; codes =
    clamp(x / scale) rounded half to even (int8) or to the nearest e4m3 (fp8), as
    engine.quant.kv.quantize."""
    if STATIC:
        scale = static
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8) * inv_qmax
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -qmax, qmax)
    if KVQ == 1:
        r = tl.floor(y + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)  # a tie goes to the even code
        codes = r.to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return codes, scale


@triton.jit(do_not_specialize=["layer"])
def _store_kv_quant_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, layer, n_heads, head_dim,
                           block_size, qmax, inv_qmax, stride_k_tok, stride_k_head,
                           stride_v_tok, stride_v_head, s_blk, s_layer, s_kv, s_tok, s_head,
                           sc_off, sc_head, static_ptr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr, KVQ: tl.constexpr, ALIGN: tl.constexpr,
                           STATIC: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)[None, :]
        h_mask = h < n_heads
        mask = h_mask[:, None] & (d < head_dim)
        slab = cache_ptr + (slot // block_size) * s_blk + layer * s_layer
        row = slab + (slot % block_size) * s_tok + h * s_head  # uint8 pointers, one per head
        row = tl.multiple_of(row, ALIGN)  # code rows (engine.kernels._checks.kv_geometry)
        sc = slab + sc_off + h * sc_head + (slot % block_size) * 4
        k = tl.load(k_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d, mask=mask,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d, mask=mask,
                    other=0.0).to(tl.float32)
        ks = None
        vs = None
        if STATIC:  # static_ptr: float32 [num_layers, 2, n_heads]
            st = static_ptr + layer * 2 * n_heads + h
            ks = tl.load(st, mask=h_mask, other=1.0)
            vs = tl.load(st + n_heads, mask=h_mask, other=1.0)
        kc, ks = _quantize_rows(k, qmax, inv_qmax, ks, KVQ, STATIC)
        vc, vs = _quantize_rows(v, qmax, inv_qmax, vs, KVQ, STATIC)
        tl.store(row[:, None] + d, kc, mask=mask)
        tl.store(row[:, None] + s_kv + d, vc, mask=mask)
        tl.store(sc.to(tl.pointer_type(tl.float32)), ks, mask=h_mask)
        tl.store((sc + s_kv).to(tl.pointer_type(tl.float32)), vs, mask=h_mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor, static_scales: torch.Tensor | None = None) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> kv_cache[slot // bs, layer, 0/1,
    slot % bs]. slot_mapping int64 [num_tokens]; slot -1 skips the token (padding).
    Slots are not bounds-checked on device (that would need a host sync). A quantized
    cache (int8 / float8_e4m3fn, engine.kernels._checks' slab layout) gets each row's codes
    and scale; ``static_scales`` (float32 [num_layers, 2, num_kv_heads], quantized caches
    only) gives every row of a (layer, K/V, head) the same scale instead of its own."""
    _, block_size, n_heads, head_dim = check_kv_cache(kv_cache, layer, quantized=True)
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, device=kv_cache.device)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=kv_cache.device)
    check_shape("key", key, (None, n_heads, head_dim))
    check_shape("value", value, tuple(key.shape))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32),
                 device=kv_cache.device)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    if key.shape[0] == 0:
        return
    s = kv_cache.stride()
    kvq = kv_quant_kind(kv_cache)
    if static_scales is not None:
        if not kvq:
            raise ValueError("static_scales need a quantized (int8 / fp8) KV cache")
        check_tensor("static_scales", static_scales, ndim=3, dtypes=(torch.float32,),
                     device=kv_cache.device)
        check_shape("static_scales", static_scales, (kv_cache.shape[1], 2, n_heads))
        if not static_scales.is_contiguous():
            raise ValueError("static_scales must be contiguous")
    if kvq:
        *geom, align = kv_geometry(kv_cache)
        static = static_scales is not None
        _store_kv_quant_kernel[(key.shape[0],)](
            key, value, kv_cache.view(torch.uint8), slot_mapping, int(layer), n_heads,
            head_dim, block_size, _QMAX[kvq], _INV[kvq], key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), *geom,
            static_scales if static else slot_mapping,  # unused pointer when not STATIC
            BLOCK_H=next_pow2(n_heads), BLOCK_D=next_pow2(head_dim), KVQ=kvq, ALIGN=align,
            STATIC=static)
        return
    _store_kv_kernel[(key.shape[0],)](
        key, value, kv_cache, slot_mapping, int(layer), n_heads, head_dim, block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        s[0], s[1], s[2], s[3], s[4], BLOCK_H=next_pow2(n_heads), BLOCK_D=next_pow2(head_dim))


@triton.jit
def _rotary_store_kv_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, cache_ptr, slot_ptr, layer,
                            half, n_q_heads, n_kv_heads, head_dim, block_size,
                            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                            stride_v_tok, stride_v_head, stride_cs,
                            s_blk, s_layer, s_kv, s_tok, s_head,
                            BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    r = tl.arange(0, BLOCK_R)[None, :]
    r_mask = r < half
    cos = tl.load(cs_ptr + pos * stride_cs + r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + half + r, mask=r_mask, other=0.0).to(tl.float32)
    # q: rotated in place
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    mq = (hq < n_q_heads) & r_mask
    pq = q_ptr + tok * stride_q_tok + hq * stride_q_head + r
    q1 = tl.load(pq, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(pq + half, mask=mq, other=0.0).to(tl.float32)
    tl.store(pq, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=mq)
    tl.store(pq + half, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=mq)
    # k: rotated in place and into the cache; v (and k's unrotated tail dims) copied
    hk = tl.arange(0, BLOCK_HK)[:, None]
    mk = (hk < n_kv_heads) & r_mask
    pk = k_ptr + tok * stride_k_tok + hk * stride_k_head + r
    k1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(pk + half, mask=mk, other=0.0).to(tl.float32)
    o1 = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty)
    o2 = (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
    tl.store(pk, o1, mask=mk)
    tl.store(pk + half, o2, mask=mk)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // block_size) * s_blk + layer * s_layer + (slot % block_size) * s_tok
        ct = cache_ptr.dtype.element_ty
        tl.store(dst + hk * s_head + r, o1.to(ct), mask=mk)
        tl.store(dst + hk * s_head + half + r, o2.to(ct), mask=mk)
        d = tl.arange(0, BLOCK_D)[None, :]
        hm = hk < n_kv_heads
        tail = hm & (d >= 2 * half) & (d < head_dim)
        kt = tl.load(k_ptr + tok * stride_k_tok + hk * stride_k_head + d, mask=tail)
        tl.store(dst + hk * s_head + d, kt.to(ct), mask=tail)
        vm = hm & (d < head_dim)
        vv = tl.load(v_ptr + tok * stride_v_tok + hk * stride_v_head + d, mask=vm)
        tl.store(dst + s_kv + hk * s_head + d, vv.to(ct), mask=vm)


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int, slot_mapping: torch.Tensor) -> None:
    """rotary_embedding (in place on q and key, NeoX convention) then store_kv, in one launch.
    Same arguments and semantics as the two kernels it replaces."""
    _, block_size, n_heads, head_dim = check_kv_cache(kv_cache, layer)
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, device=kv_cache.device)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=kv_cache.device)
    check_tensor("q", q, ndim=3, dtypes=(key.dtype,), device=kv_cache.device)
    check_shape("key", key, (None, n_heads, head_dim))
    check_shape("value", value, tuple(key.shape))
    n = key.shape[0]
    check_shape("q", q, (n, None, head_dim))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32),
                 device=kv_cache.device)
    check_shape("slot_mapping", slot_mapping, (n,))
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=kv_cache.device)
    check_shape("positions", positions, (n,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES,
                 device=kv_cache.device)
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_dim:
        raise ValueError(f"cos_sin_cache dim 1 must be even and <= head_dim {head_dim}, got {rot}")
    if n == 0:
        return
    s = kv_cache.stride()
    _rotary_store_kv_kernel[(n,)](
        positions, q, key, value, cos_sin_cache, kv_cache, slot_mapping, int(layer), rot // 2,
        q.shape[1], n_heads, head_dim, block_size, q.stride(0), q.stride(1), key.stride(0),
        key.stride(1), value.stride(0), value.stride(1), cos_sin_cache.stride(0),
        s[0], s[1], s[2], s[3], s[4], BLOCK_HQ=next_pow2(q.shape[1]),
        BLOCK_HK=next_pow2(n_heads), BLOCK_R=next_pow2(rot // 2), BLOCK_D=next_pow2(head_dim))
