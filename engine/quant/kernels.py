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
                                       (_act_fp8, one kernel) and per-channel weight scales, FP8
                                       tensor cores (W8A8); after an rmsnorm or silu_and_mul
                                       the row-wise kernel itself writes the codes and scales
                                       (_norm_act_fp8, _silu_mul_act_fp8: fp8_prologue_linear)

All of it is launch-only (no host sync, no allocation that depends on values), so the decode
steps replay under the CUDA graphs like the dense ones.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check_tensor, next_pow2
from engine.kernels.elementwise import rmsnorm_row, silu_mul_f32
from engine.quant.reference import FP8_MAX, GEMV_MAX_ROWS, gemv_keywords

_FMT = {"int8": 0, "int4": 1, "fp8": 2}


# silu_mul_act_fp8: columns a step and warps a row (bench: scripts measured on the GPU)
SILU_ACT_BLOCK, SILU_ACT_WARPS = 1024, 4


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


@triton.jit
def _act_fp8(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
             BLOCK: tl.constexpr):
    """One row: scale = max(max|x|, 1e-12) / FP8_MAX, q = clamp(x / scale) as e4m3 bytes
    (reference.quant_act_fp8's math: fp32, division rounded to nearest)."""
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride_x
    q_ptr += row * stride_q
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + c, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=c < K)


def act_fp8(x: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic fp8 quantization in one kernel (two passes over each row, the
    second from L2): (xq float8_e4m3fn [M, K], scale float32 [M, 1]), as
    reference.quant_act_fp8 computes them (tests compare the two)."""
    check_tensor("x", x, ndim=2)
    if x.stride(1) != 1:
        raise ValueError("x needs a contiguous last dim")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        _act_fp8[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK=block)
    return q.view(torch.float8_e4m3fn), s


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


@triton.jit
def _codes_out(h, q_ptr, s_ptr, row, mask, FP8_MAX: tl.constexpr):
    """Store one row's act_fp8 codes and scale (h: the row in fp32, already rounded to the
    activation dtype as the unfused kernel's output is)."""
    scale = tl.maximum(tl.max(tl.abs(h), axis=0), 1e-12) / FP8_MAX
    tl.store(s_ptr + row, scale)
    q = tl.clamp(tl.math.div_rn(h, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _norm_act_fp8(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, new_res_ptr, hidden, eps, stride_x,
                  stride_res, stride_q, stride_new_res, HAS_RESIDUAL: tl.constexpr,
                  FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """elementwise._rmsnorm_kernel's row (x + residual stored as the new residual), then its
    output rounded to x's dtype and quantized as _act_fp8 does, in one pass."""
    row = tl.program_id(0).to(tl.int64)
    h, offs, mask = rmsnorm_row(x_ptr, res_ptr, w_ptr, new_res_ptr, row, hidden, eps, stride_x,
                                stride_res, stride_new_res, HAS_RESIDUAL, BLOCK)
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    _codes_out(h, q_ptr + row * stride_q + offs, s_ptr, row, mask, FP8_MAX)


@triton.jit
def _silu_mul_act_fp8(x_ptr, q_ptr, s_ptr, d, stride_x, stride_q, FP8_MAX: tl.constexpr,
                      BLOCK: tl.constexpr):
    """elementwise._silu_and_mul_kernel's row, rounded to x's dtype, quantized as _act_fp8
    does: one pass when the row fits in BLOCK, else two (the row's maximum, then the codes,
    recomputed from the row as L2 holds it)."""
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride_x
    q_ptr += row * stride_q
    offs = tl.arange(0, BLOCK)
    if BLOCK >= d:
        mask = offs < d
        g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + d + offs, mask=mask, other=0.0).to(tl.float32)
        h = silu_mul_f32(g, u).to(x_ptr.dtype.element_ty).to(tl.float32)
        _codes_out(h, q_ptr + offs, s_ptr, row, mask, FP8_MAX)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, d, BLOCK):
            c = k0 + offs
            g = tl.load(x_ptr + c, mask=c < d, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + d + c, mask=c < d, other=0.0).to(tl.float32)
            h = silu_mul_f32(g, u).to(x_ptr.dtype.element_ty).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(h))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
        tl.store(s_ptr + row, scale)
        for k0 in range(0, d, BLOCK):
            c = k0 + offs
            g = tl.load(x_ptr + c, mask=c < d, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + d + c, mask=c < d, other=0.0).to(tl.float32)
            h = silu_mul_f32(g, u).to(x_ptr.dtype.element_ty).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(h, scale), -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + c, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=c < d)


def norm_act_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """act_fp8(rmsnorm(x [+ residual]) * weight) in one kernel: (codes, scales, new residual
    x + residual, or None without a residual); the same values as elementwise.rmsnorm /
    fused_add_rmsnorm followed by act_fp8."""
    check_tensor("x", x, ndim=2)
    check_tensor("weight", weight, ndim=1, device=x.device)
    if x.stride(1) != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError("x needs a contiguous last dim and weight its width")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    new_res = None
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        if tuple(residual.shape) != (m, k) or residual.stride(1) != 1:
            raise ValueError("residual must match x")
        new_res = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m and k:
        _norm_act_fp8[(m,)](x, residual if residual is not None else x, weight, q, s,
                            new_res if new_res is not None else x, k, float(eps), x.stride(0),
                            residual.stride(0) if residual is not None else 0, q.stride(0),
                            new_res.stride(0) if new_res is not None else 0,
                            HAS_RESIDUAL=residual is not None, FP8_MAX=FP8_MAX,
                            BLOCK=next_pow2(k), num_warps=8)
    return q.view(torch.float8_e4m3fn), s, new_res


def silu_mul_act_fp8(gate_up: torch.Tensor, block: int = SILU_ACT_BLOCK,
                     num_warps: int = SILU_ACT_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """act_fp8(silu_and_mul(gate_up)) in one kernel: (codes [M, d], scales [M, 1]).
    ``block``: columns a step (0: the whole row in one pass)."""
    check_tensor("gate_up", gate_up, ndim=2)
    if gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError("gate_up needs an even, contiguous last dim")
    m, d = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty(m, d, dtype=torch.uint8, device=gate_up.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    if m and d:
        _silu_mul_act_fp8[(m,)](gate_up, q, s, d, gate_up.stride(0), q.stride(0),
                                FP8_MAX=FP8_MAX, BLOCK=block or next_pow2(d),
                                num_warps=num_warps)
    return q.view(torch.float8_e4m3fn), s


def fp8_prologue_linear(qw: dict, bias: torch.Tensor | None, prologue: str, x: torch.Tensor,
                        residual: torch.Tensor | None = None,
                        norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
    """linear(prologue(x)) for fp8 weights of more than one row: the row-wise
    kernel writes the codes _scaled_mm reads, so the prologue's bf16 output is neither
    written nor read again. prologue "rmsnorm" -> (y, x + residual or None); "silu_mul" ->
    y. The values are those of the prologue kernel, act_fp8 and fp8_gemm in turn."""
    if prologue == "silu_mul":
        xq, sx = silu_mul_act_fp8(x)
        return fp8_gemm_codes(xq, sx, qw, bias, x.dtype)
    if prologue != "rmsnorm":
        raise ValueError(f"unknown prologue {prologue!r}")
    xq, sx, new_res = norm_act_fp8(x, norm_weight, eps, residual)
    return fp8_gemm_codes(xq, sx, qw, bias, x.dtype), new_res


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
        from engine.kernels.matvec import gemv
        _check(x, qw)
        return gemv(x.contiguous(), qw["q"], bias, **gemv_keywords(qw))
    if x.shape[0] <= GEMV_MAX_ROWS:
        return quant_gemv(x.contiguous(), qw, bias)
    if qw["format"] == "fp8":
        return fp8_gemm(x.contiguous(), qw, bias)
    return quant_gemm(x.contiguous(), qw, bias)
