"""Triton kernels, each with a torch reference of the same signature in reference.py.

Import the wrappers from here. They need triton and either CUDA or TRITON_INTERPRET=1 (set
before this package is first imported: triton decides at decoration time whether a kernel
is compiled or interpreted). Without triton the names below raise ImportError on use, and
callers should check triton_available() and use engine.kernels.reference instead.

KV cache layout: one tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
(block-major, 0 = K, 1 = V); kernels take it with a layer index and use its strides.
"""
from __future__ import annotations

import importlib.util

from pdcore.config_tree import environ

__all__ = [
    "triton_available", "store_kv", "paged_decode_attention", "paged_prefill_attention",
    "rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rotary_embedding", "sample", "gemv",
    "rotary_store_kv", "apply_token_bitmask",
    "masked_argmax", "seeded_exponentials",
]

_WRAPPERS = {
    "store_kv": "cache",
    "paged_decode_attention": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "rmsnorm": "elementwise",
    "fused_add_rmsnorm": "elementwise",
    "silu_and_mul": "elementwise",
    "rotary_embedding": "elementwise",
    "sample": "sampling",
    "gemv": "matvec",
    "rotary_store_kv": "cache",
    "apply_token_bitmask": "sampling",
    "masked_argmax": "sampling",
    "seeded_exponentials": "sampling",
}


def triton_available() -> bool:
    """True when triton imports and kernels can run: on CUDA, or interpreted on CPU."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    if environ().get("TRITON_INTERPRET") == "1":  # Triton's own variable, not a setting
        return True
    import torch
    return torch.cuda.is_available()


def __getattr__(name):
    module = _WRAPPERS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.kernels' has no attribute {name!r}")
    mod = importlib.import_module(f"engine.kernels.{module}")
    return getattr(mod, name)
