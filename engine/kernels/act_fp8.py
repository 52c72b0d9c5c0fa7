"""The fp8 activation kernels: per-token dynamic e4m3 quantization of a row (act_fp8), and
the same fused after the row-wise kernel that produces the row (norm_act_fp8 after an
rmsnorm / fused add-rmsnorm, silu_mul_act_fp8 after silu_and_mul), so its bf16 output is
neither written nor read again. The fp8 prefill (engine.quant.kernels, before _scaled_mm)
and the one-token GEMV on codes (engine.kernels.matvec.gemv xq) both read what they write.
Each is checked against engine.quant.reference.quant_act_fp8 (tests/unit/test_quant_kernels.py
through TRITON_INTERPRET=1, tests/gpu/test_quant_gpu.py at full size).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check_tensor, next_pow2
from engine.kernels.elementwise import rmsnorm_row, silu_mul_f32
from engine.quant.reference import FP8_MAX


# silu_mul_act_fp8: columns a step and warps a row (bench: scripts measured on the GPU)
SILU_ACT_BLOCK, SILU_ACT_WARPS = 1024, 4


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


def prologue_act_fp8(x: torch.Tensor, prologue: str = "none",
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None):
    """act_fp8(prologue(x)) by the kernel that fuses them: (codes, scales, new residual x +
    residual, or None). ``prologue``: "none" (act_fp8), "rmsnorm" / "add_rmsnorm"
    (norm_act_fp8, ``residual`` optional), "silu_mul" (silu_mul_act_fp8)."""
    if prologue == "silu_mul":
        return (*silu_mul_act_fp8(x), None)
    if prologue in ("rmsnorm", "add_rmsnorm"):
        return norm_act_fp8(x, norm_weight, eps, residual)
    if prologue == "none":
        return (*act_fp8(x), None)
    raise ValueError(f"unknown prologue {prologue!r}")
