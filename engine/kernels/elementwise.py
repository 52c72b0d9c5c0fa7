"""Row-wise kernels: rmsnorm, fused add + rmsnorm, silu_and_mul, rotary embedding (in place).

All math is fp32; inputs and outputs are fp32, fp16 or bf16. Rows may be strided (the last
dim must be contiguous); outputs are new contiguous tensors except rotary, which is in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor, next_pow2


@triton.jit
def silu_mul_f32(g, u):
    """silu(g) * u in fp32 (g, u fp32): the one formula every kernel with a SiLU-and-mul uses."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def rmsnorm_row(x_ptr, res_ptr, w_ptr, new_res_ptr, row, hidden, eps, stride_x, stride_res,
                stride_new_res, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """(rmsnorm(x [+ residual]) * w of one row in fp32, before rounding; offsets; mask). With
    a residual, x + residual is stored (rounded) as the new residual and normalized as
    rounded, as the unfused model does."""
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + offs, s, mask=mask)
        x = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x * inv * w, offs, mask


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, hidden, eps,
                    stride_x, stride_res, stride_out, stride_new_res,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h, offs, mask = rmsnorm_row(x_ptr, res_ptr, w_ptr, new_res_ptr, row, hidden, eps, stride_x,
                                stride_res, stride_new_res, HAS_RESIDUAL, BLOCK)
    tl.store(out_ptr + row * stride_out + offs, h.to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm(x, weight):
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("weight", weight, (x.shape[1],))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, hidden] -> x * rsqrt(mean(x^2) + eps) * weight, in x.dtype."""
    _check_norm(x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        _rmsnorm_kernel[(x.shape[0],)](x, x, weight, out, out, x.shape[1], eps, x.stride(0), 0,
                                       out.stride(0), 0, HAS_RESIDUAL=False,
                                       BLOCK=next_pow2(x.shape[1]), num_warps=8)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual); inputs are not modified."""
    _check_norm(x, weight)
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("residual", residual, tuple(x.shape))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_res = torch.empty_like(out)
    if x.shape[0]:
        _rmsnorm_kernel[(x.shape[0],)](x, residual, weight, out, new_res, x.shape[1], eps,
                                       x.stride(0), residual.stride(0), out.stride(0),
                                       new_res.stride(0), HAS_RESIDUAL=True,
                                       BLOCK=next_pow2(x.shape[1]), num_warps=8)
    return out, new_res


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul_f32(g, u)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2*d] (gate first) -> silu(gate) * up, [n, d]."""
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up last dim must be even, got {gate_up.shape[1]}")
    n, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, d), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(d))
    if n and d:
        _silu_and_mul_kernel[(n, triton.cdiv(d, block))](gate_up, out, d, gate_up.stride(0),
                                                         out.stride(0), BLOCK=block)
    return out


@triton.jit
def _rotate(x_ptr, tok, stride_tok, stride_head, n_heads, cos, sin, half,
            BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < n_heads) & (r < half)
    p1 = x_ptr + tok * stride_tok + h * stride_head + r
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, half, n_q_heads, n_k_heads,
                   stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cs,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    r = tl.arange(0, BLOCK_R)[None, :]
    cos = tl.load(cs_ptr + pos * stride_cs + r, mask=r < half, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + half + r, mask=r < half, other=0.0).to(tl.float32)
    _rotate(q_ptr, tok, stride_q_tok, stride_q_head, n_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_R)
    _rotate(k_ptr, tok, stride_k_tok, stride_k_head, n_k_heads, cos, sin, half, BLOCK_HK, BLOCK_R)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """In place, NeoX rotate_half convention. q [n, heads, head_dim], k [n, kv_heads, head_dim],
    positions int [n], cos_sin_cache [max_pos, rot_dim] (cos first half, sin second half;
    fp32 recommended); the first rot_dim <= head_dim dims of every head are rotated.
    Positions are not bounds-checked on device (that would need a host sync)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=q.device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=q.device)
    n, _, head_dim = q.shape
    check_shape("k", k, (n, None, head_dim))
    check_shape("positions", positions, (n,))
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_dim:
        raise ValueError(f"cos_sin_cache dim 1 must be even and <= head_dim {head_dim}, got {rot}")
    if n == 0:
        return
    _rotary_kernel[(n,)](positions, q, k, cos_sin_cache, rot // 2, q.shape[1], k.shape[1],
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos_sin_cache.stride(0), BLOCK_HQ=next_pow2(q.shape[1]),
                         BLOCK_HK=next_pow2(k.shape[1]), BLOCK_R=next_pow2(rot // 2))
