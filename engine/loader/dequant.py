"""Dequantize ggml block formats with torch (on any device), to float32.

Each function takes the raw bytes of a tensor as a uint8 tensor and the row-major shape, and
returns a float32 tensor of that shape. Block layouts (ggml-common.h), per block of 32 values
unless noted, `d`/`m` are float16:

    Q8_0: d, 32 x int8 q                      x = d * q
    Q4_0: d, 16 bytes (low nibbles = values 0..15, high nibbles = 16..31)   x = d * (q - 8)
    Q4_1: d, m, 16 bytes (same nibble order)  x = d * q + m
    Q6_K: 256 values: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], d
          x = d * scale[sub-block of 16] * (q6 - 32)

Other types fall back to `gguf.quants.dequantize` (numpy, slower). `tests/unit/test_loader.py`
checks every function here against that independent implementation.
"""
from __future__ import annotations

import logging

import torch

from engine.loader.gguf_reader import GGML_TYPES

logger = logging.getLogger(__name__)


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    return raw.reshape(-1, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2k) uint8 -> (n, k) float32, reinterpreting the bytes as little-endian float16."""
    return b.contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) packed bytes -> (n, 32) float32: low nibbles are values 0..15, high 16..31.
    Written straight into the output (fewer large temporaries: page faults dominate on CPU)."""
    out = torch.empty(qs.shape[0], 32, dtype=torch.float32, device=qs.device)
    out[:, :16].copy_(qs & 0x0F)
    out[:, 16:].copy_(qs >> 4)
    return out


def dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 34)
    out = torch.empty(b.shape[0], 32, dtype=torch.float32, device=raw.device)
    out.copy_(b[:, 2:].contiguous().view(torch.int8))
    return out.mul_(_f16(b[:, :2]))


def dequant_q4_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 18)
    return _unpack_nibbles(b[:, 2:]).sub_(8.0).mul_(_f16(b[:, :2]))


def dequant_q4_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 20)
    dm = _f16(b[:, :4])
    return _unpack_nibbles(b[:, 4:]).mul_(dm[:, :1]).add_(dm[:, 1:])


def dequant_q6_k(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 210)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)  # two halves of 128 values
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 16)
    d = _f16(b[:, 208:210])
    # Within a half: values [0:32] use ql[0:32] low nibble, [32:64] ql[32:64] low,
    # [64:96] ql[0:32] high, [96:128] ql[32:64] high; qh bits 0-1, 2-3, 4-5, 6-7 in that order.
    low = torch.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4,
                       ql[..., 32:] >> 4], dim=2)  # (n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).view(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03
    q = (low | (high << 4)).float() - 32.0  # (n, 2, 4, 32)
    q = q.reshape(n, 16, 16)  # sub-blocks of 16 values, in order
    return (d.view(n, 1, 1) * scales.view(n, 16, 1) * q).reshape(n, 256)


_TORCH_DEQUANT = {"Q8_0": dequant_q8_0, "Q4_0": dequant_q4_0, "Q4_1": dequant_q4_1,
                  "Q6_K": dequant_q6_k}
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F64": torch.float64}


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes (uint8 tensor, any device) of one tensor -> float32 tensor of `shape`.
    Plain float types keep their dtype (no copy when it already matches)."""
    name = GGML_TYPES[ggml_type][0]
    if name in _PLAIN:
        return raw.view(_PLAIN[name]).reshape(shape)
    fn = _TORCH_DEQUANT.get(name)
    if fn is not None:
        return fn(raw).reshape(shape)
    logger.info("dequantizing %s with gguf.quants (numpy)", name)
    from gguf.quants import dequantize as np_dequantize

    arr = np_dequantize(raw.cpu().numpy(), ggml_type)
    return torch.from_numpy(arr.reshape(shape).astype("float32", copy=False)).to(raw.device)
