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

Quantized weights (``w_format``): "fp8" / "int8" (e4m3 / int8 codes [N, K], one float32
scale per output channel, applied to the row sums) and "int4" (two codes a byte [N, Kp/2], low nibble the even
feature; float32 scale and minimum per group of ``group`` features [N, Kp/group]: each group's
code dot product is scaled and its minimum times the group's sum of x added, so the codes are
never expanded to weights). The bytes stream the same way, the prologues and split-K apply
unchanged (engine.quant.reference defines the formats; tests compare with it).

What the kernels load (the prologue's x, the passes over x before the weight stream, the
weight tiles) lives in engine.kernels.gemv_loads.

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
from engine.kernels.act_fp8 import prologue_act_fp8
from engine.kernels.gemv_loads import _load_x, _rms_inv, _row_stats, _w_tile, _x_rows

PROLOGUES = {"none": 0, "rmsnorm": 1, "add_rmsnorm": 2, "silu_mul": 3}
W_FORMATS = {"float": 0, "fp8": 1, "int4": 2, "int8": 3}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
# f8mma: K features the FP8 tensor cores sum in their own (reduced) precision before the
# partial sum is added to the fp32 accumulator (tl.dot's max_num_imprecise_acc)
F8_PROMOTE_K = 32
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
def _nibble(c, BITS: tl.constexpr):
    """int32 codes 0..15 (or, BITS, 0..255) as fp32: a conversion instruction, or (BITS) the
    code as the mantissa of 2^23 and 2^23 subtracted (integer and add units, exact)."""
    if BITS:
        return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return c.to(tl.float32)


@triton.jit
def _tile_acc(w, xv, s_ptr, z_ptr, rows, n_mask, k0, stride_s, NG_ROW, WFMT: tl.constexpr,
              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BITS: tl.constexpr, A8: tl.constexpr, sx):
    """A tile's contribution to the accumulator: w * x ([BLOCK_N, BLOCK_K]) for float and
    fp8 / int8 weights; for int4 per group (scale * codes . x + minimum * sum x: [BLOCK_N,
    BLOCK_K // GROUP]; NG_ROW groups a row). BITS: codes become fp32 by integer operations
    instead of conversion instructions (fp8: the e4m3 fields moved into an fp32's, which
    is the value times 2^-120; the epilogue multiplies 2^120 back). A8: x is first
    quantized to e4m3 with the row's scale sx (reference.quant_act_fp8's rounding)."""
    if A8:
        xv = tl.clamp(tl.math.div_rn(xv, sx), -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
    if WFMT == 2:
        xe, xo = tl.split(tl.reshape(xv, [BLOCK_K // 2, 2]))
        wi = w.to(tl.int32)
        part = (_nibble(wi & 0xF, BITS) * xe[None, :] + _nibble(wi >> 4, BITS) * xo[None, :])
        NG: tl.constexpr = BLOCK_K // GROUP
        part = tl.sum(tl.reshape(part, [BLOCK_N, NG, GROUP // 2]), axis=2)
        xs = tl.sum(tl.reshape(xe + xo, [NG, GROUP // 2]), axis=1)
        g = k0 // GROUP + tl.arange(0, NG)
        gm = n_mask[:, None] & (g < NG_ROW)[None, :]
        sz = rows[:, None] * stride_s + g[None, :]
        s = tl.load(s_ptr + sz, mask=gm, other=0.0)
        z = tl.load(z_ptr + sz, mask=gm, other=0.0)
        return part * s + z * xs[None, :]
    elif BITS and WFMT == 1:
        wi = w.to(tl.int32)
        f = (((wi & 0x80) << 24) | ((wi & 0x7F) << 20)).to(tl.float32, bitcast=True)
        return f * xv[None, :]
    elif BITS and WFMT == 3:
        return (_nibble(w.to(tl.int32) + 128, BITS) - 128.0) * xv[None, :]
    else:
        if WFMT == 1:
            w = w.to(tl.float8e4nv, bitcast=True)
        return w.to(tl.float32) * xv[None, :]


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, new_res_ptr,
                 part_ptr, cnt_ptr, xs_ptr, N, K, KW, NG_ROW, eps, stride_xm, stride_rm, stride_w,
                 stride_s, stride_ym, stride_nrm,
                 PRO: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 PREFETCH: tl.constexpr, PDL: tl.constexpr, WFMT: tl.constexpr,
                 GROUP: tl.constexpr, ACC_W: tl.constexpr, BITS: tl.constexpr,
                 A8: tl.constexpr, XC: tl.constexpr, KC: tl.constexpr, XQ: tl.constexpr):
    """XQ: x holds e4m3 codes (bytes) already, with its row scales at xs_ptr (the prologue's
    quantizing kernel ran before, once for the call: gemv xq); no prologue, no a8 pass."""
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
        w_first = _w_tile(w_rows, k_lo, n_mask, K, KW, EVEN, WFMT, BLOCK_K)
        if PDL:
            gdc_wait()
    if XQ:
        inv = 1.0
        sx = tl.load(xs_ptr + m)
    elif XC:  # the row passes unrolled over a constant K (_row_stats)
        r0 = tl.zeros([1], tl.int32)
        inv1, sx1 = _row_stats(x_ptr, res_ptr, nw_ptr, new_res_ptr, r0, r0 == 0, KC, eps,
                               (pid == 0) & (sk == 0), 0, 0, 0, PRO, XC, A8)
        inv = tl.sum(inv1, axis=0)
        sx = tl.sum(sx1, axis=0)
    else:
        inv = _rms_inv(x_ptr, res_ptr, new_res_ptr, ks, K, eps, (pid == 0) & (sk == 0), PRO,
                       BLOCK_K)
        sx = 1.0
        if A8:  # the row's activation scale, over the whole prologue output (every split)
            am = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                am = tl.maximum(am, tl.abs(_load_x(x_ptr, res_ptr, nw_ptr, kk, kk < K, K, inv,
                                                   PRO)))
            sx = tl.maximum(tl.max(am, axis=0), 1e-12) / 448.0
    acc = tl.zeros([BLOCK_N, ACC_W], tl.float32)
    k_start = k_lo
    if PREFETCH:
        if XQ:
            xv0 = tl.load(x_ptr + kk0, mask=kk0 < K, other=0).to(tl.float8e4nv, bitcast=True)
            xv0 = xv0.to(tl.float32)
        else:
            xv0 = _load_x(x_ptr, res_ptr, nw_ptr, kk0, kk0 < K, K, inv, PRO)
        acc += _tile_acc(w_first, xv0, s_ptr, z_ptr, rows, n_mask, k_lo, stride_s, NG_ROW,
                         WFMT, GROUP, BLOCK_N, BLOCK_K, BITS, A8, sx)
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_lo + k_len, BLOCK_K):
        kk = k0 + ks
        if XQ:
            xv = tl.load(x_ptr + kk, mask=kk < K, other=0).to(tl.float8e4nv, bitcast=True)
            xv = xv.to(tl.float32)
        else:
            xv = _load_x(x_ptr, res_ptr, nw_ptr, kk, kk < K, K, inv, PRO)
        w = _w_tile(w_rows, k0, n_mask, K, KW, EVEN, WFMT, BLOCK_K)
        acc += _tile_acc(w, xv, s_ptr, z_ptr, rows, n_mask, k0, stride_s, NG_ROW, WFMT, GROUP,
                         BLOCK_N, BLOCK_K, BITS, A8, sx)
    y = tl.sum(acc, axis=1)
    if WFMT == 1 or WFMT == 3:  # fp8 / int8: the channel scale on the row sums
        y *= tl.load(s_ptr + rows, mask=n_mask, other=0.0)
        if BITS and WFMT == 1:
            y *= 1.329227995784916e36  # 2^120
        if A8 or XQ:
            y *= sx
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


@triton.jit
def _half_tile(w, s_ptr, z_ptr, rows, n_mask, k0, stride_s, NG_ROW, WFMT: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A quantized tile as fp16 [BLOCK_N, BLOCK_K]: fp8 / int8 codes as they are (the channel
    scale comes after the sum), int4 codes times their group's scale plus its minimum."""
    if WFMT == 2:
        wi = w.to(tl.int32)
        codes = tl.reshape(tl.join((wi & 0xF).to(tl.float16), (wi >> 4).to(tl.float16)),
                           [BLOCK_N, BLOCK_K])
        NG: tl.constexpr = BLOCK_K // GROUP
        g = k0 // GROUP + tl.arange(0, NG)
        gm = n_mask[:, None] & (g < NG_ROW)[None, :]
        sz = rows[:, None] * stride_s + g[None, :]
        sc = tl.load(s_ptr + sz, mask=gm, other=0.0).to(tl.float16)
        zc = tl.load(z_ptr + sz, mask=gm, other=0.0).to(tl.float16)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, NG, GROUP]), [BLOCK_N, BLOCK_K])
        zc = tl.reshape(tl.broadcast_to(zc[:, :, None], [BLOCK_N, NG, GROUP]), [BLOCK_N, BLOCK_K])
        return codes * sc + zc
    elif WFMT == 1:
        return w.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        return w.to(tl.float16)


@triton.jit
def _gemv_mma_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, new_res_ptr,
                     N, K, KW, NG_ROW, eps, stride_xm, stride_rm, stride_w, stride_s,
                     stride_ym, stride_nrm, PRO: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, WFMT: tl.constexpr, GROUP: tl.constexpr):
    """Quantized weights on the tensor cores: each tile is expanded to fp16 and multiplied
    by x as row 0 of a 16-row operand (the other rows zero), so registers hold fp16 tiles
    and a [16, BLOCK_N] accumulator instead of a [BLOCK_N, BLOCK_K] fp32 one."""
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    x_ptr += m * stride_xm
    res_ptr += m * stride_rm
    new_res_ptr += m * stride_nrm
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    inv = _rms_inv(x_ptr, res_ptr, new_res_ptr, ks, K, eps, pid == 0, PRO, BLOCK_K)
    r16 = tl.arange(0, 16)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        xv = _load_x(x_ptr, res_ptr, nw_ptr, kk, kk < K, K, inv, PRO)
        w = _w_tile(w_rows, k0, n_mask, K, KW, EVEN, WFMT, BLOCK_K)
        wh = _half_tile(w, s_ptr, z_ptr, rows, n_mask, k0, stride_s, NG_ROW, WFMT, GROUP,
                        BLOCK_N, BLOCK_K)
        xt = tl.where(r16[:, None] == 0, xv[None, :], 0.0).to(tl.float16)
        acc = tl.dot(xt, tl.trans(wh), acc)
    y = tl.sum(tl.where(r16[:, None] == 0, acc, 0.0), axis=0)
    if WFMT == 1 or WFMT == 3:
        y *= tl.load(s_ptr + rows, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _f8_tile(acc, w, x_ptr, res_ptr, nw_ptr, ms, m_mask, r16, k0, K: tl.constexpr, inv, sx,
             stride_xm, stride_rm, PRO: tl.constexpr, BLOCK_K: tl.constexpr,
             PROMOTE: tl.constexpr):
    """acc [BLOCK_N, 16] += codes of W's tile (w: e4m3 bytes) x codes of x's tile (rows
    ``ms`` quantized with their scales sx; one row is broadcast into row 0 of 16)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    xv = _x_rows(x_ptr, res_ptr, nw_ptr, ms, m_mask, kk, kk < K, K, inv, stride_xm, stride_rm,
                 PRO)
    xs = tl.clamp(tl.math.div_rn(xv, sx[:, None]), -448.0, 448.0)
    if ms.shape[0] == 1:
        xs = tl.where(r16[:, None] == 0, xs, 0.0)
    xq = xs.to(tl.float8e4nv)
    return tl.dot(w.to(tl.float8e4nv, bitcast=True), tl.trans(xq), acc,
                  max_num_imprecise_acc=PROMOTE)


@triton.jit
def _gemv_f8_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, new_res_ptr,
                    part_ptr, cnt_ptr, M, N, K: tl.constexpr, eps, stride_xm, stride_rm,
                    stride_w, stride_ym, stride_nrm, PRO: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ROWS: tl.constexpr,
                    PDL: tl.constexpr, XC: tl.constexpr, PROMOTE: tl.constexpr):
    """W8A8 on the FP8 tensor cores for up to 16 rows of x. Each row of the prologue's
    output is quantized to e4m3 per token (the a8 GEMV's codes and scale), and a program
    multiplies its [BLOCK_N, BLOCK_K] tiles of weight codes by the [BLOCK_K, 16] codes of
    x (rows past M zero): the weights are the MMA's wide operand, so every row shares one
    pass over W, and no weight code is converted (the tensor cores take e4m3 as stored).
    ROWS 1 computes the prologue on row 0 only (batch-1 decode), ROWS 16 on all sixteen.
    Split-K and PDL as in _gemv_kernel (the first tile is fetched before the wait)."""
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    r16 = tl.arange(0, 16)
    ms = tl.arange(0, ROWS)
    m_mask = ms < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    k_len: tl.constexpr = K // SPLIT_K  # SPLIT_K > 1 only when BLOCK_K * SPLIT_K divides K
    k_lo = sk * k_len
    if PDL:
        gdc_launch_dependents()
    w = _w_tile(w_rows, k_lo, n_mask, K, K, EVEN, 1, BLOCK_K)
    if PDL:
        gdc_wait()
    inv, sx = _row_stats(x_ptr, res_ptr, nw_ptr, new_res_ptr, ms, m_mask, K, eps,
                         (pid == 0) & (sk == 0), stride_xm, stride_rm, stride_nrm, PRO, XC,
                         True)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    acc = _f8_tile(acc, w, x_ptr, res_ptr, nw_ptr, ms, m_mask, r16, k_lo, K, inv, sx,
                   stride_xm, stride_rm, PRO, BLOCK_K, PROMOTE)
    for k0 in range(k_lo + BLOCK_K, k_lo + k_len, BLOCK_K):
        w = _w_tile(w_rows, k0, n_mask, K, K, EVEN, 1, BLOCK_K)
        acc = _f8_tile(acc, w, x_ptr, res_ptr, nw_ptr, ms, m_mask, r16, k0, K, inv, sx,
                       stride_xm, stride_rm, PRO, BLOCK_K, PROMOTE)
    if ROWS == 1:
        sx16 = tl.where(r16 == 0, tl.sum(sx, axis=0), 1.0)
    else:
        sx16 = sx
    y = acc * tl.load(s_ptr + rows, mask=n_mask, other=0.0)[:, None] * sx16[None, :]
    out = y_ptr + r16[None, :] * stride_ym + rows[:, None]
    omask = n_mask[:, None] & (r16 < M)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=omask)
    else:
        pp = part_ptr + r16[None, :] * N + rows[:, None]
        tl.store(pp + sk * 16 * N, y, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        ctr = cnt_ptr + pid
        arrived = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # last of the row block: the others' partials are visible
            tot = tl.zeros([BLOCK_N, 16], tl.float32)
            for s in tl.static_range(SPLIT_K):
                tot += tl.load(pp + s * 16 * N, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out, tot.to(y_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(ctr, 0, sem="relaxed", scope="gpu")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         prologue: str = "none", residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         block_n: int = 8, block_k: int = 1024, num_warps: int = 4, split_k: int = 1,
         num_stages: int | None = None, pdl: bool = False, w_format: str = "float",
         w_scale: torch.Tensor | None = None, w_zero: torch.Tensor | None = None,
         group: int = 0, mma: bool = False, bits: bool = False, a8: bool = False,
         f8mma: bool = False, unroll: bool = True, xq: bool = False):
    """x [M, K] (or [M, 2K] for silu_mul), weight [N, K] -> y [M, N] in x.dtype.

    With prologue "add_rmsnorm" returns (y, x + residual); with "rmsnorm" returns (y, x);
    otherwise y. The last dims must be contiguous. ``split_k`` > 1 needs
    ``block_k * split_k`` to divide K. ``pdl`` launches with programmatic dependent launch
    (Hopper and later, CUDA only): the kernel prefetches its first weight tile and lets the
    next kernel be scheduled while it runs; a no-op request elsewhere. ``w_format`` "fp8" /
    "int8" (weight float8_e4m3fn / int8 [N, K], w_scale [N]) or "int4" (weight uint8 [N, Kp/2], w_scale
    and w_zero [N, Kp/group], ``block_k`` a multiple of ``group``): module docstring.
    ``mma`` (quantized weights, no split-K, block_n and block_k >= 16): the tensor-core
    variant (_gemv_mma_kernel); x is rounded to fp16 for it. ``bits`` (quantized weights):
    codes become fp32 through integer operations (_tile_acc), not conversions. ``a8``
    (fp8 weights): W8A8, each row of x (after the prologue) quantized to e4m3 per token
    in the kernel, as engine.quant.reference.quant_act_fp8 does. ``f8mma`` (fp8 weights with
    a8, at most 16 rows, block_n >= 16, block_k >= 32): the same codes multiplied on the FP8
    tensor cores, every row in one pass over W (_gemv_f8_kernel). ``unroll`` (the default):
    the norm / a8 passes over x run as unrolled 4096-column chunks of a constant K
    (_row_stats); off, as a loop of block_k chunks (one L2 round trip each). ``xq`` (fp8
    weights with a8, not f8mma / mma / bits): the prologue and the quantization of x run
    once for the call, in the row-wise kernel the fp8 prefill uses (engine.kernels.act_fp8:
    norm_act_fp8, silu_mul_act_fp8, act_fp8), and the GEMV reads the codes, instead of every
    program redoing both for each tile (measured on the H100: 7-14% of the GEMV's time)."""
    pro = PROLOGUES[prologue]
    fmt = W_FORMATS[w_format]
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    k = x.shape[1] // 2 if pro == 3 else x.shape[1]
    n, kw, ng = _check_weight(fmt, weight, w_scale, w_zero, group, k, block_k, x)
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
    w = weight.view(torch.uint8) if fmt == 1 else weight
    s = w_scale if fmt else x
    z = w_zero if fmt == 2 else s
    if mma and (fmt == 0 or split_k != 1 or block_n < 16 or block_k < 16 or a8):
        raise ValueError("mma: quantized weights, no a8, split_k 1, block_n and block_k >= 16")
    if a8 and fmt != 1:
        raise ValueError("a8 (activations in fp8) needs fp8 weights")
    even = n % block_n == 0 and k % block_k == 0 and (fmt != 2 or 2 * kw == k)
    xs = y
    if xq:
        if fmt != 1 or not a8 or f8mma or mma or bits:
            raise ValueError("xq: fp8 weights with a8 (not f8mma, mma or bits)")
        codes, xs, fused_res = prologue_act_fp8(x, prologue, nw, eps,
                                                residual if pro == 2 else None)
        if pro == 2:
            new_res = fused_res
        x_in, pro_in, a8_in = codes.view(torch.uint8), 0, False
    else:
        x_in, pro_in, a8_in = x, pro, a8
    if f8mma:
        if fmt != 1 or not a8 or mma or bits or m > 16 or block_n < 16 or block_k < 32:
            raise ValueError("f8mma: fp8 weights with a8, at most 16 rows, block_n >= 16 and "
                             "block_k >= 32")
        if split_k > 1:
            part = torch.empty((split_k, 16, n), dtype=torch.float32, device=x.device)
            cnt = _counters(x.device, n_blocks)
        if m and n:
            _gemv_f8_kernel[(n_blocks, split_k)](
                x, res, nw, w, s, bias if bias is not None else x, y, new_res, part, cnt, m,
                n, k, float(eps), x.stride(0), stride_rm, w.stride(0), y.stride(0),
                stride_nrm, PRO=pro, HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=block_n,
                BLOCK_K=block_k, SPLIT_K=split_k, ROWS=1 if m == 1 else 16, PDL=use_pdl,
                XC=4096 if m == 1 else 256, PROMOTE=F8_PROMOTE_K, num_warps=num_warps,
                **({} if num_stages is None else {"num_stages": num_stages}),
                **({"launch_pdl": True} if use_pdl else {}))
    elif mma and m and n:
        _gemv_mma_kernel[(n_blocks, m)](
            x, res, nw, w, s, z, bias if bias is not None else x, y, new_res, n, k, kw, ng,
            float(eps), x.stride(0), stride_rm, w.stride(0), s.stride(0) if fmt == 2 else 1,
            y.stride(0), stride_nrm, PRO=pro, HAS_BIAS=bias is not None, EVEN=even,
            BLOCK_N=block_n, BLOCK_K=block_k, PDL=use_pdl, WFMT=fmt, GROUP=max(group, 1),
            num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
            **({"launch_pdl": True} if use_pdl else {}))
    elif m and n:
        stats = unroll and (a8_in or pro_in in (1, 2))
        _gemv_kernel[(n_blocks, m, split_k)](
            x_in, res, nw, w, s, z, bias if bias is not None else x, y, new_res, part, cnt, xs,
            n, k, kw, ng, float(eps), x_in.stride(0), stride_rm, w.stride(0),
            s.stride(0) if fmt == 2 else 1, y.stride(0), stride_nrm,
            PRO=pro_in, HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=block_n,
            BLOCK_K=block_k, SPLIT_K=split_k, PREFETCH=bool(pdl), PDL=use_pdl, WFMT=fmt,
            GROUP=max(group, 1), ACC_W=block_k // group if fmt == 2 else block_k,
            BITS=bool(bits) and fmt != 0, A8=bool(a8_in), XC=4096 if stats else 0,
            KC=k if stats else 0, XQ=bool(xq),
            num_warps=num_warps,
            **({} if num_stages is None else {"num_stages": num_stages}),
            **({"launch_pdl": True} if use_pdl else {}))
    if pro == 2:
        return y, new_res
    if pro == 1:
        return y, x
    return y


def _check_weight(fmt: int, weight, scale, zero, group: int, k: int, block_k: int, x):
    """-> (N, bytes or values a row, groups a row) after checking the weight's format."""
    if fmt == 0:
        check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
        if weight.shape[1] != k:
            raise ValueError(f"weight has {weight.shape[1]} features, x {k}")
        return weight.shape[0], k, 0
    dtype = {1: torch.float8_e4m3fn, 2: torch.uint8, 3: torch.int8}[fmt]
    check_tensor("weight", weight, ndim=2, dtypes=(dtype,), device=x.device)
    n, kw = weight.shape
    if scale is None:
        raise ValueError("quantized weights need w_scale")
    check_tensor("w_scale", scale, dtypes=(torch.float32,), device=x.device)
    if fmt != 2:
        if kw != k or tuple(scale.shape) != (n,):
            raise ValueError(f"fp8 / int8 weight [N, K] = {tuple(weight.shape)} with w_scale [N]: "
                             f"x has {k} features, w_scale {tuple(scale.shape)}")
        return n, kw, 0
    if group < 2 or group & (group - 1) or block_k % group:
        raise ValueError(f"int4: group {group} must be a power of two >= 2 dividing block_k "
                         f"({block_k})")
    ng = scale.shape[1] if scale.dim() == 2 else 0
    if (2 * kw < k or scale.dim() != 2 or scale.shape[0] != n or ng * group < k
            or zero is None or zero.shape != scale.shape or zero.dtype != torch.float32
            or scale.stride(1) != 1 or zero.stride() != scale.stride()):
        raise ValueError("int4 weight: uint8 [N, Kp/2] with float32 w_scale and w_zero "
                         f"[N, Kp/group], Kp >= K = {k}")
    return n, kw, ng


def gemv_weight(linear) -> tuple[torch.Tensor, dict]:
    """(weight, the gemv keywords of its format) of an nn.Linear or a quantized projection
    (engine.quant.linear.QuantLinear.gemv_args)."""
    args = getattr(linear, "gemv_args", None)
    return args() if args is not None else (linear.weight, {})
