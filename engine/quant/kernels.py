"""Triton kernels of the quantized projections (GPU), each checked against
engine.quant.reference.quant_matmul_ref (tests/unit/test_quant_kernels.py through
TRITON_INTERPRET=1 at small shapes, tests/gpu/test_quant_gpu.py at full size).

    one token                          engine.kernels.matvec.gemv (w_format): the weight
                                       stream of the dense GEMV, codes expanded in registers
                                       (fp8: x quantized per token in the kernel, a8)
    int8 / int4, <= GEMV_MAX_ROWS      _gemv: one program per (BLOCK_N outputs, token); the
                                       weight codes are read once and expanded in registers
                                       (int8: code * channel scale after the sum;
                                       int4: low / high nibble against the even / odd
                                       features, code * group scale + group zero)
    more tokens, int8 / int4           _gemm: tl.dot tiles, each weight tile expanded to the
                                       activation dtype in registers (W8A16 / W4A16)
    fp8, two tokens or more            torch._scaled_mm: per-token dynamic activation scales
                                       (act_fp8, one kernel) and per-channel weight scales, FP8
                                       tensor cores (W8A8); after an rmsnorm or silu_and_mul
                                       the row-wise kernel itself writes the codes and scales
                                       (engine.kernels.act_fp8: fp8_prologue_linear)

All of it is launch-only (no host sync, no allocation that depends on values), so the decode
steps replay under the CUDA graphs like the dense ones.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check_tensor
from engine.kernels.act_fp8 import (act_fp8, norm_act_fp8,  # noqa: F401 (re-exported)
                                    prologue_act_fp8, silu_mul_act_fp8)
from engine.kernels.matvec import gemv
from engine.quant.reference import GEMV_MAX_ROWS, gemv_keywords

_FMT = {"int8": 0, "int4": 1, "fp8": 2}


@triton.jit
def _gemv(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, KB, stride_xm, stride_qn,
          stride_sn, stride_ym, FMT: tl.constexpr, GROUP: tl.constexpr,
          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if FMT == 1:  # int4: BLOCK_K bytes hold 2 * BLOCK_K features
        for j0 in range(0, KB, BLOCK_K):
            rj = j0 + tl.arange(0, BLOCK_K)  # byte index
            jmask = rj < KB
            b = tl.load(q_ptr + rn[:, None] * stride_qn + rj[None, :],
                        mask=nmask[:, None] & jmask[None, :], other=0).to(tl.int32)
            xe = tl.load(x_ptr + m * stride_xm + 2 * rj, mask=2 * rj < K, other=0.0)
            xo = tl.load(x_ptr + m * stride_xm + 2 * rj + 1, mask=2 * rj + 1 < K, other=0.0)
            g = (2 * rj) // GROUP
            smask = nmask[:, None] & jmask[None, :]
            s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=smask, other=0.0)
            z = tl.load(z_ptr + rn[:, None] * stride_sn + g[None, :], mask=smask, other=0.0)
            lo = (b & 0xF).to(tl.float32) * s + z
            hi = (b >> 4).to(tl.float32) * s + z
            acc += tl.sum(lo * xe.to(tl.float32)[None, :] + hi * xo.to(tl.float32)[None, :],
                          axis=1)
    else:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            w = tl.load(q_ptr + rn[:, None] * stride_qn + rk[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0).to(tl.float32)
            x = tl.load(x_ptr + m * stride_xm + rk, mask=kmask, other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        acc *= tl.load(s_ptr + rn, mask=nmask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemm(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn,
          stride_ym, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        if FMT == 1:
            b = tl.load(q_ptr + rn[None, :] * stride_qn + (rk // 2)[:, None], mask=wmask,
                        other=0).to(tl.int32)
            code = (b >> ((rk % 2) * 4)[:, None]) & 0xF
            g = rk // GROUP
            s = tl.load(s_ptr + rn[None, :] * stride_sn + g[:, None], mask=wmask, other=0.0)
            z = tl.load(z_ptr + rn[None, :] * stride_sn + g[:, None], mask=wmask, other=0.0)
            w = (code.to(tl.float32) * s + z).to(x.dtype)
        else:
            w = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None], mask=wmask,
                        other=0).to(tl.float32).to(x.dtype)
        acc = tl.dot(x, w, acc)
    if FMT != 1:
        acc *= tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _check(x: torch.Tensor, qw: dict) -> int:
    fmt = qw["format"]
    if fmt not in _FMT:
        raise ValueError(f"unknown weight format {fmt!r}")
    check_tensor("x", x, ndim=2)
    q, s = qw["q"], qw["scale"]
    k = qw["k"]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight {k}")
    check_tensor("q", q, ndim=2, device=x.device)
    check_tensor("scale", s, dtypes=(torch.float32,), device=x.device)
    if fmt == "int4":
        if q.dtype != torch.uint8 or 2 * q.shape[1] < k or qw["zero"].shape != s.shape:
            raise ValueError("int4 weights: q uint8 [N, Kp/2], scale and zero [N, Kp/group]")
    elif q.shape[1] != k or s.shape != (q.shape[0],):
        raise ValueError(f"{fmt} weights: q [N, K] and scale [N], got {tuple(q.shape)}, "
                         f"{tuple(s.shape)}")
    return q.shape[0]


def quant_gemv(x: torch.Tensor, qw: dict, bias: torch.Tensor | None = None,
               block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """int8 / int4 weight-only rows (fp8 quantizes its activations: matvec.gemv, a8)."""
    n = _check(x, qw)
    if qw["format"] == "fp8":
        raise ValueError("fp8 GEMVs quantize their activations: engine.kernels.matvec.gemv "
                         "with a8 (quant_linear)")
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fmt = _FMT[qw["format"]]
    q, s = qw["q"], qw["scale"]
    z = qw.get("zero") if fmt == 1 else s
    grid = (triton.cdiv(n, block_n), m)
    _gemv[grid](x, q, s, z, bias if bias is not None else s, y, n, k, q.shape[1],
                x.stride(0), q.stride(0), s.stride(0) if s.dim() == 2 else 1, y.stride(0),
                FMT=fmt, GROUP=qw.get("group", 1), HAS_BIAS=bias is not None,
                BLOCK_N=block_n, BLOCK_K=block_k // 2 if fmt == 1 else block_k)
    return y


def quant_gemm(x: torch.Tensor, qw: dict, bias: torch.Tensor | None = None,
               block_m: int = 64, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """int8 / int4 weight-only GEMM (fp8 goes through :func:`fp8_gemm`)."""
    n = _check(x, qw)
    fmt = _FMT[qw["format"]]
    if fmt == 2:
        raise ValueError("fp8 GEMMs run through fp8_gemm (torch._scaled_mm)")
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    q, s = qw["q"], qw["scale"]
    z = qw.get("zero") if fmt == 1 else s
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gemm[grid](x, q, s, z, bias if bias is not None else s, y, m, n, k, x.stride(0),
                q.stride(0), s.stride(0) if s.dim() == 2 else 1, y.stride(0), FMT=fmt,
                GROUP=qw.get("group", 1), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def fp8_gemm(x: torch.Tensor, qw: dict, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: per-token fp8 activations x per-channel fp8 weights on the FP8 tensor cores."""
    _check(x, qw)
    xq, sx = act_fp8(x)
    return fp8_gemm_codes(xq, sx, qw, bias, x.dtype)


def fp8_gemm_codes(xq: torch.Tensor, sx: torch.Tensor, qw: dict, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """The GEMM of fp8_gemm on activations already quantized (act_fp8's codes and scales)."""
    y = torch._scaled_mm(xq, qw["q"].t(), scale_a=sx, scale_b=qw["scale"][None, :],
                         out_dtype=dtype if dtype != torch.float32 else torch.bfloat16)
    y = y.to(dtype)
    return y if bias is None else y.add_(bias)


def fp8_prologue_linear(qw: dict, bias: torch.Tensor | None, prologue: str, x: torch.Tensor,
                        residual: torch.Tensor | None = None,
                        norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
    """linear(prologue(x)) for fp8 weights of more than one row: the row-wise
    kernel writes the codes _scaled_mm reads, so the prologue's bf16 output is neither
    written nor read again. prologue "rmsnorm" -> (y, x + residual or None); "silu_mul" ->
    y. The values are those of the prologue kernel, act_fp8 and fp8_gemm in turn."""
    if prologue not in ("rmsnorm", "silu_mul"):
        raise ValueError(f"unknown prologue {prologue!r}")
    xq, sx, new_res = prologue_act_fp8(x, prologue, norm_weight, eps, residual)
    y = fp8_gemm_codes(xq, sx, qw, bias, x.dtype)
    return y if prologue == "silu_mul" else (y, new_res)


def quant_linear(x: torch.Tensor, qw: dict, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) for a quantized W, by the call's size (module docstring)."""
    if x.shape[0] > 1 and qw["format"] == "fp8":
        # two tokens or more of fp8: act_fp8 + _scaled_mm. Until 2026-12-07 calls of 2..8
        # rows took the FP8 tensor-core GEMV (matvec.gemv f8mma), which on the H100 was 2.1-3.7x
        # slower than this at 2 and 8 rows (32 Llama-3-8B layers, e.g. qkv at 8 rows 1.367 ms
        # against 0.653), and an eager prefill of <= 8 tokens then took another kernel than the
        # mixed-step graphs (>= 129 rows) do, so its first token could differ
        return fp8_gemm(x.contiguous(), qw, bias)
    if x.shape[0] == 1:
        # one token: the bandwidth GEMV of engine.kernels.matvec (fp8: a8)
        _check(x, qw)
        return gemv(x.contiguous(), qw["q"], bias, **gemv_keywords(qw))
    if x.shape[0] <= GEMV_MAX_ROWS:
        return quant_gemv(x.contiguous(), qw, bias)
    if qw["format"] == "fp8":
        return fp8_gemm(x.contiguous(), qw, bias)
    return quant_gemm(x.contiguous(), qw, bias)
