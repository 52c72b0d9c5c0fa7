"""What the GEMV kernels of engine.kernels.matvec load: the prologue's values of x (one row,
or rows of up to 16), the passes over x that run before the weight stream (1 / rms of the
rmsnorm prologues, the a8 activation scale), and the weight tiles of each format.

Shared by _gemv_kernel, _gemv_mma_kernel and _gemv_f8_kernel (matvec's docstring has the
prologues and weight formats).
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.elementwise import silu_mul_f32


@triton.jit
def _load_x(x_ptr, res_ptr, nw_ptr, kk, km, K, inv, PRO: tl.constexpr):
    """The prologue's value of x at columns kk, fp32 (rounded through x's dtype)."""
    dt = x_ptr.dtype.element_ty
    if PRO == 3:
        g = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + kk, mask=km, other=0.0).to(tl.float32)
        xv = silu_mul_f32(g, u).to(dt).to(tl.float32)
    else:
        xv = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        if PRO == 2:
            r = tl.load(res_ptr + kk, mask=km, other=0.0).to(tl.float32)
            xv = (xv + r).to(dt).to(tl.float32)
        if PRO == 1 or PRO == 2:
            nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
            xv = (xv * inv * nw).to(dt).to(tl.float32)
    return xv


@triton.jit
def _rms_inv(x_ptr, res_ptr, new_res_ptr, ks, K, eps, writer, PRO: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """The rmsnorm prologues' 1 / rms over the whole row (1.0 without a norm prologue);
    add_rmsnorm's ``writer`` program also stores x + residual as the new residual."""
    inv = 1.0
    if PRO == 1 or PRO == 2:
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            km = kk < K
            xv = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
            if PRO == 2:
                r = tl.load(res_ptr + kk, mask=km, other=0.0).to(tl.float32)
                s = (xv + r).to(new_res_ptr.dtype.element_ty)
                tl.store(new_res_ptr + kk, s, mask=km & writer)
                xv = s.to(tl.float32)
            ss += xv * xv
        inv = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    return inv


@triton.jit
def _w_tile(w_rows, k0, n_mask, K, KW, EVEN: tl.constexpr, WFMT: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The raw weight tile at feature k0: [BLOCK_N, BLOCK_K] values or fp8 bytes, or
    [BLOCK_N, BLOCK_K // 2] int4 bytes (KW: bytes per row)."""
    if WFMT == 2:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        lim = KW
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        lim = K
    if EVEN:
        w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & (cols < lim)[None, :],
                    other=0, eviction_policy="evict_first")
    return w


@triton.jit
def _x_rows(x_ptr, res_ptr, nw_ptr, ms, m_mask, kk, km, K, inv, stride_xm, stride_rm,
            PRO: tl.constexpr):
    """_load_x for rows ``ms`` of x ([R] offsets, ``inv`` [R]): the prologue's values at
    columns kk, [R, C] fp32 (rounded through x's dtype)."""
    dt = x_ptr.dtype.element_ty
    msk = m_mask[:, None] & km[None, :]
    xo = x_ptr + ms[:, None] * stride_xm + kk[None, :]
    if PRO == 3:
        g = tl.load(xo, mask=msk, other=0.0).to(tl.float32)
        u = tl.load(xo + K, mask=msk, other=0.0).to(tl.float32)
        xv = silu_mul_f32(g, u).to(dt).to(tl.float32)
    else:
        xv = tl.load(xo, mask=msk, other=0.0).to(tl.float32)
        if PRO == 2:
            r = tl.load(res_ptr + ms[:, None] * stride_rm + kk[None, :], mask=msk,
                        other=0.0).to(tl.float32)
            xv = (xv + r).to(dt).to(tl.float32)
        if PRO == 1 or PRO == 2:
            nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
            xv = (xv * inv[:, None] * nw[None, :]).to(dt).to(tl.float32)
    return xv


@triton.jit
def _row_stats(x_ptr, res_ptr, nw_ptr, new_res_ptr, ms, m_mask, K: tl.constexpr, eps, writer,
               stride_xm, stride_rm, stride_nrm, PRO: tl.constexpr, XC: tl.constexpr,
               A8: tl.constexpr):
    """(1 / rms, activation scale (A8; else 1)), each [R], of rows ``ms`` of the prologue's
    output: _rms_inv and the a8 pass in [R, XC] chunks, unrolled (K is a constant) so that a
    pass's loads are in flight together, not one round trip to L2 per chunk (a loop of
    BLOCK_K chunks did that). add_rmsnorm's ``writer`` also stores x + residual as the new
    residual."""
    ks = tl.arange(0, XC)
    inv = tl.full(ms.shape, 1.0, tl.float32)
    if PRO == 1 or PRO == 2:
        ss = tl.zeros([ms.shape[0], XC], tl.float32)
        for k0 in tl.static_range(0, K, XC):
            kk = k0 + ks
            msk = m_mask[:, None] & (kk < K)[None, :]
            xv = tl.load(x_ptr + ms[:, None] * stride_xm + kk[None, :], mask=msk,
                         other=0.0).to(tl.float32)
            if PRO == 2:
                r = tl.load(res_ptr + ms[:, None] * stride_rm + kk[None, :], mask=msk,
                            other=0.0).to(tl.float32)
                s = (xv + r).to(new_res_ptr.dtype.element_ty)
                tl.store(new_res_ptr + ms[:, None] * stride_nrm + kk[None, :], s,
                         mask=msk & writer)
                xv = s.to(tl.float32)
            ss += xv * xv
        inv = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
    sx = tl.full(ms.shape, 1.0, tl.float32)
    if A8:
        am = tl.zeros([ms.shape[0], XC], tl.float32)
        for k0 in tl.static_range(0, K, XC):
            kk = k0 + ks
            am = tl.maximum(am, tl.abs(_x_rows(x_ptr, res_ptr, nw_ptr, ms, m_mask, kk, kk < K,
                                               K, inv, stride_xm, stride_rm, PRO)))
        sx = tl.maximum(tl.max(am, axis=1), 1e-12) / 448.0
    return inv, sx
