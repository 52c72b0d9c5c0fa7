"""store_kv: write one layer's new K/V rows into the paged, block-major KV cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (FLOAT_DTYPES, check_kv_cache, check_shape, check_tensor,
                                    next_pow2)


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


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> kv_cache[slot // bs, layer, 0/1,
    slot % bs]. slot_mapping int64 [num_tokens]; slot -1 skips the token (padding).
    Slots are not bounds-checked on device (that would need a host sync)."""
    _, block_size, n_heads, head_dim = check_kv_cache(kv_cache, layer)
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
    _store_kv_kernel[(key.shape[0],)](
        key, value, kv_cache, slot_mapping, int(layer), n_heads, head_dim, block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        s[0], s[1], s[2], s[3], s[4], BLOCK_H=next_pow2(n_heads), BLOCK_D=next_pow2(head_dim))
