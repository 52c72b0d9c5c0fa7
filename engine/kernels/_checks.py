"""Argument checks shared by the kernel wrappers: every failure is a ValueError naming the arg."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None,
                 last_contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """`shape` may hold None for dims that are not checked."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


# A quantized KV cache (engine.quant.kv): int8 or float8_e4m3fn. Its shape is the float
# cache's with a last dim of head_dim + 4 bytes, but each (block, layer, K/V) slab of
# block_size * num_kv_heads * (head_dim + 4) bytes holds the codes [block_size, num_kv_heads,
# head_dim] first, then the float32 scales [num_kv_heads, block_size]: code rows start at
# multiples of head_dim (16-byte loads) and one head's scales for a block are contiguous.
# KV_CODES: the kernels' KVQ constexpr.
KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
SCALE_BYTES = 4


def kv_quant_kind(kv_cache: torch.Tensor) -> int:
    """0: a float cache; 1: int8 codes + scales; 2: fp8 (e4m3) codes + scales."""
    return KV_CODES.get(kv_cache.dtype, 0)


def check_kv_cache(kv_cache, layer: int, device=None, quantized: bool = False
                   ) -> tuple[int, int, int, int]:
    """kv_cache is [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (a float
    cache) or, with ``quantized``, also [..., head_dim + 4] of int8 / fp8 codes and scales
    (the slab layout above).

    Returns (num_layers, block_size, num_kv_heads, head_dim)."""
    dtypes = FLOAT_DTYPES + tuple(KV_CODES) if quantized else FLOAT_DTYPES
    check_tensor("kv_cache", kv_cache, ndim=6, dtypes=dtypes, device=device)
    _, num_layers, two, block_size, num_kv_heads, head_dim = kv_cache.shape
    if kv_quant_kind(kv_cache):
        head_dim -= SCALE_BYTES
        st = kv_cache.stride()
        # the kernels read the scales as float32 and address a slab as one contiguous region
        if (head_dim < 1 or head_dim % SCALE_BYTES or kv_cache.data_ptr() % SCALE_BYTES
                or any(x % SCALE_BYTES for x in st[:3])
                or st[3:] != (num_kv_heads * (head_dim + SCALE_BYTES), head_dim + SCALE_BYTES,
                              1)):
            raise ValueError(f"a quantized kv_cache must hold head_dim codes + "
                             f"{SCALE_BYTES} scale bytes per (token, head) in contiguous "
                             f"slabs, 4-byte aligned (head_dim a multiple of 4); got shape "
                             f"{tuple(kv_cache.shape)}, strides {st}")
    if two != 2:
        raise ValueError(f"kv_cache dim 2 must be 2 (K, V), got {two}")
    if not (0 <= int(layer) < num_layers):
        raise ValueError(f"layer {layer} out of range for kv_cache with {num_layers} layers")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return num_layers, block_size, num_kv_heads, head_dim


def kv_geometry(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """The kernels' cache addressing, in elements (bytes for a quantized cache):
    (s_blk, s_layer, s_kv, s_tok, s_head, sc_off, sc_head, align). A float cache: its
    strides, sc_* 0, align 1. A quantized cache (slab layout above): a code at slab +
    tok * s_tok + head * s_head + d, a scale at slab + sc_off + head * sc_head + tok * 4;
    align 16 when every code row starts 16-byte aligned (head_dim a multiple of 16), else
    4."""
    s = kv_cache.stride()
    if not kv_quant_kind(kv_cache):
        return (s[0], s[1], s[2], s[3], s[4], 0, 0, 1)
    block_size, heads, row = kv_cache.shape[3:]
    d = row - SCALE_BYTES
    aligned = all(x % 16 == 0 for x in (d, kv_cache.data_ptr(), s[0], s[1], s[2]))
    return (s[0], s[1], s[2], heads * d, d, block_size * heads * d, block_size * SCALE_BYTES,
            16 if aligned else 4)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
