"""GEMV for decode at batch 1: y = prologue(x) @ W.T (+ bias), W [N, K] as nn.Linear stores it.

At one token per step a projection is a pure weight stream (M = 1 leaves the matrix units
idle), so the kernel is built for bandwidth: each program owns BLOCK_N output rows and walks
the whole of K in [BLOCK_N, BLOCK_K] tiles of wide, contiguous loads, keeping a 2-D fp32
accumulator that is reduced once at the end.

Split-K (``split_k`` > 1) gives small matrices more programs (more loads in flight) without a
second launch: each of the ``split_k`` programs of a row block writes its fp32 partial sums to a
scratch buffer and bumps the row block's arrival counter; the program that arrives last sums
the partials in split order (so the result does not depend on which one was last), writes y
and resets the counter for the next launch. Counters live in one zeroed buffer per device and
are always left at zero, so the kernel replays inside CUDA graphs. Launches that share the
counter buffer must not run concurrently (the engine runs its GEMVs on one stream).

Optional prologues fold the neighbouring row-wise kernel into the GEMV (each program
recomputes it from the small input vector, which stays in L2):

* ``"rmsnorm"``: x -> rmsnorm(x) * norm_weight (rounded to x.dtype, as the separate kernel does);
* ``"add_rmsnorm"``: s = round(x + residual); x -> rmsnorm(s) * norm_weight; program 0 also
  writes s as the new residual;
* ``"silu_mul"``: x = [gate | up] of width 2K -> round(silu(gate) * up).

Rows of a multi-row x are handled by a second grid axis (each row re-reads W: correct, but
meant for M = 1). The choice between this kernel and cuBLAS is made per shape by the caller
(engine.kernels.gemv_tune), once per process.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor

PROLOGUES = {"none": 0, "rmsnorm": 1, "add_rmsnorm": 2, "silu_mul": 3}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 1 << 16


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The split-K arrival counters of ``device`` (int32, zero between launches)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv split-K counters must be allocated before graph capture "
                               "(run the kernel once outside the capture)")
        buf = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch needs a CUDA device of compute capability 9.0 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _load_x(x_ptr, res_ptr, nw_ptr, kk, km, K, inv, PRO: tl.constexpr):
    """The prologue's value of x at columns kk, fp32 (rounded through x's dtype)."""
    dt = x_ptr.dtype.element_ty
    if PRO == 3:
        g = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + kk, mask=km, other=0.0).to(tl.float32)
        xv = (g / (1.0 + tl.exp(-g)) * u).to(dt).to(tl.float32)
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
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, new_res_ptr, part_ptr, cnt_ptr,
                 N, K, eps, stride_xm, stride_rm, stride_w, stride_ym, stride_nrm,
                 PRO: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 PREFETCH: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    sk = tl.program_id(2)
    x_ptr += m * stride_xm
    res_ptr += m * stride_rm
    new_res_ptr += m * stride_nrm
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    k_len = K // SPLIT_K  # SPLIT_K > 1 only when BLOCK_K * SPLIT_K divides K
    k_lo = sk * k_len
    if PREFETCH:
        # With programmatic dependent launch (PDL) the next kernel's programs may be scheduled
        # once all of ours are; the weights are constant, so the first tile is fetched before
        # waiting for the previous kernel (whose output x / residual is only read after
        # gdc_wait). PREFETCH alone (no PDL: the CPU interpreter) runs the same peeled loop.
        if PDL:
            gdc_launch_dependents()
        kk0 = k_lo + ks
        if EVEN:
            w_first = tl.load(w_rows + kk0[None, :], eviction_policy="evict_first")
        else:
            w_first = tl.load(w_rows + kk0[None, :], mask=n_mask[:, None] & (kk0 < K)[None, :],
                              other=0.0, eviction_policy="evict_first")
        if PDL:
            gdc_wait()
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
                tl.store(new_res_ptr + kk, s, mask=km & (pid == 0) & (sk == 0))
                xv = s.to(tl.float32)
            ss += xv * xv
        inv = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_start = k_lo
    if PREFETCH:
        acc += w_first.to(tl.float32) * _load_x(x_ptr, res_ptr, nw_ptr, kk0, kk0 < K, K, inv,
                                                PRO)[None, :]
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_lo + k_len, BLOCK_K):
        kk = k0 + ks
        km = kk < K
        xv = _load_x(x_ptr, res_ptr, nw_ptr, kk, km, K, inv, PRO)
        if EVEN:
            w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & km[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        num_m = tl.num_programs(1)
        tl.store(part_ptr + (sk * num_m + m) * N + rows, y, mask=n_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        ctr = cnt_ptr + m * tl.num_programs(0) + pid
        arrived = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # last of the row block: the others' partials are visible
            tot = tl.zeros([BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                tot += tl.load(part_ptr + (s * num_m + m) * N + rows, mask=n_mask, other=0.0,
                               cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + rows, tot.to(y_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(ctr, 0, sem="relaxed", scope="gpu")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         prologue: str = "none", residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         block_n: int = 8, block_k: int = 1024, num_warps: int = 4, split_k: int = 1,
         num_stages: int | None = None, pdl: bool = False):
    """x [M, K] (or [M, 2K] for silu_mul), weight [N, K] -> y [M, N] in x.dtype.

    With prologue "add_rmsnorm" returns (y, x + residual); with "rmsnorm" returns (y, x);
    otherwise y. The last dims must be contiguous. ``split_k`` > 1 needs
    ``block_k * split_k`` to divide K. ``pdl`` launches with programmatic dependent launch
    (Hopper and later, CUDA only): the kernel prefetches its first weight tile and lets the
    next kernel be scheduled while it runs; a no-op request elsewhere."""
    pro = PROLOGUES[prologue]
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    n, k = weight.shape
    check_shape("x", x, (None, 2 * k if pro == 3 else k))
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    m = x.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
        check_shape("bias", bias, (n,))
    res = new_res = nw = x
    stride_rm = stride_nrm = 0
    if pro in (1, 2):
        if norm_weight is None:
            raise ValueError(f"prologue {prologue!r} needs norm_weight")
        check_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
        check_shape("norm_weight", norm_weight, (k,))
        nw = norm_weight
    if pro == 2:
        if residual is None:
            raise ValueError("prologue 'add_rmsnorm' needs residual")
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        check_shape("residual", residual, tuple(x.shape))
        res = residual
        new_res = torch.empty_like(x, memory_format=torch.contiguous_format)
        stride_rm, stride_nrm = residual.stride(0), new_res.stride(0)
    if split_k < 1 or (split_k > 1 and k % (block_k * split_k)):
        raise ValueError(f"split_k={split_k} needs block_k * split_k ({block_k * split_k}) "
                         f"to divide K ({k})")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(n, block_n)
    part = cnt = y
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, n_blocks * m)
    use_pdl = bool(pdl) and _pdl_capable(x.device)
    if m and n:
        even = n % block_n == 0 and k % block_k == 0
        _gemv_kernel[(n_blocks, m, split_k)](
            x, res, nw, weight, bias if bias is not None else x, y, new_res, part, cnt, n, k,
            float(eps), x.stride(0), stride_rm, weight.stride(0), y.stride(0), stride_nrm,
            PRO=pro, HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=split_k, PREFETCH=bool(pdl), PDL=use_pdl, num_warps=num_warps,
            **({} if num_stages is None else {"num_stages": num_stages}),
            **({"launch_pdl": True} if use_pdl else {}))
    if pro == 2:
        return y, new_res
    if pro == 1:
        return y, x
    return y
