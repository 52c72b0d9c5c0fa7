"""On-device sampling: greedy, temperature, top-k, top-p, per-request seeds; no host sync.

One program per row. The top-k and top-p thresholds are found by bisection over
order-preserving int32 keys of the scaled logits (32 passes each, exact up to ties), so no
sort is needed. The draw is Gumbel-max with a counter-based hash RNG of (seed, step, token
id): a request's sample depends only on its own logits, seed and step, never on the batch.
reference.sample_ref implements the same definition in torch and reproduces it exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor

_NUM_BISECT = tl.constexpr(32)
_FAR = tl.constexpr(1 << 40)  # below / above every int32 key


@triton.jit
def _mix32(x):  # int64 in [0, 2**32) -> same; multipliers < 2**31 so nothing overflows
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _keys(z):
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64)


@triton.jit
def _scaled(row_ptr, j, vocab, inv_t):
    mask = j < vocab
    z = tl.load(row_ptr + j, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
    return z, mask


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, inv_t_ptr, topk_ptr, topp_ptr, seed_ptr, step_ptr, out_ptr,
                   vocab, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    t = tl.load(temp_ptr + row).to(tl.float32)
    inv_t = tl.load(inv_t_ptr + row)  # computed by torch so the reference matches bit for bit
    # pass 1: greedy argmax, max and min keys, max scaled logit
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int64)
    k_min = tl.full([], _FAR, tl.int64)
    k_max = tl.full([], -_FAR, tl.int64)
    for j0 in range(0, vocab, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        z, mask = _scaled(row_ptr, j, vocab, 1.0)
        c_max = tl.max(z, axis=0)
        c_arg = tl.argmax(z, axis=0).to(tl.int64) + j0
        best_i = tl.where(c_max > best, c_arg, best_i)
        best = tl.maximum(best, c_max)
        kz = _keys(z * inv_t)
        k_min = tl.minimum(k_min, tl.min(tl.where(mask, kz, _FAR), axis=0))
        k_max = tl.maximum(k_max, tl.max(tl.where(mask, kz, -_FAR), axis=0))
    z_max = best * inv_t
    top_k = tl.load(topk_ptr + row).to(tl.int64)
    top_p = tl.load(topp_ptr + row).to(tl.float32)
    k_cut = tl.full([], -_FAR, tl.int64)  # keep tokens whose key >= k_cut
    if (t > 0) & (top_k > 0) & (top_k < vocab):
        lo = k_min
        hi = k_max + 1
        for _ in range(_NUM_BISECT):
            mid = (lo + hi) >> 1
            cnt = tl.zeros([], tl.int64)
            for j0 in range(0, vocab, BLOCK):
                z, mask = _scaled(row_ptr, j0 + tl.arange(0, BLOCK), vocab, inv_t)
                cnt += tl.sum((mask & (_keys(z) >= mid)).to(tl.int64), axis=0)
            ok = cnt >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        k_cut = lo
    p_cut = tl.full([], -_FAR, tl.int64)
    if (t > 0) & (top_p < 1.0):
        total = tl.zeros([], tl.float32)
        lo = tl.full([], _FAR, tl.int64)
        for j0 in range(0, vocab, BLOCK):
            z, mask = _scaled(row_ptr, j0 + tl.arange(0, BLOCK), vocab, inv_t)
            kz = _keys(z)
            keep = mask & (kz >= k_cut)
            total += tl.sum(tl.where(keep, tl.exp(z - z_max), 0.0), axis=0)
            lo = tl.minimum(lo, tl.min(tl.where(keep, kz, _FAR), axis=0))
        target = top_p * total
        hi = k_max + 1
        for _ in range(_NUM_BISECT):
            mid = (lo + hi) >> 1
            mass = tl.zeros([], tl.float32)
            for j0 in range(0, vocab, BLOCK):
                z, mask = _scaled(row_ptr, j0 + tl.arange(0, BLOCK), vocab, inv_t)
                kz = _keys(z)
                sel = mask & (kz >= k_cut) & (kz >= mid)
                mass += tl.sum(tl.where(sel, tl.exp(z - z_max), 0.0), axis=0)
            ok = mass >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        p_cut = lo
    if t > 0:
        seed = tl.load(seed_ptr + row).to(tl.int64)
        step = tl.load(step_ptr + row).to(tl.int64)
        key = _mix32((seed & 0xFFFFFFFF) ^ 0x5BD1E995)
        key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF))
        key = _mix32(key ^ (step & 0xFFFFFFFF))
        g_best = tl.full([], float("-inf"), tl.float32)
        g_i = tl.zeros([], tl.int64)
        for j0 in range(0, vocab, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            z, mask = _scaled(row_ptr, j, vocab, inv_t)
            kz = _keys(z)
            h = _mix32((_mix32(key ^ j.to(tl.int64)) + key) & 0xFFFFFFFF)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            score = z - tl.log(-tl.log(u))
            score = tl.where(mask & (kz >= k_cut) & (kz >= p_cut), score, float("-inf"))
            c_max = tl.max(score, axis=0)
            c_arg = tl.argmax(score, axis=0).to(tl.int64) + j0
            g_i = tl.where(c_max > g_best, c_arg, g_i)
            g_best = tl.maximum(g_best, c_max)
        best_i = g_i
    tl.store(out_ptr + row, best_i)


def inverse_temperatures(temperatures: torch.Tensor) -> torch.Tensor:
    t = temperatures.float()
    return torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 1.0)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
           top_ps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] -> int64 token ids [n]. Per row: temperatures float (0 = greedy),
    top_ks int (<= 0 or >= vocab: off), top_ps float (>= 1: off), seeds int64 (the request's
    seed), steps int64 (e.g. tokens generated so far; a new draw needs a new step)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    n, vocab = logits.shape
    for name, t, dts in (("temperatures", temperatures, FLOAT_DTYPES),
                         ("top_ks", top_ks, (torch.int32, torch.int64)),
                         ("top_ps", top_ps, FLOAT_DTYPES),
                         ("seeds", seeds, (torch.int64,)),
                         ("steps", steps, (torch.int32, torch.int64))):
        check_tensor(name, t, ndim=1, dtypes=dts, device=logits.device)
        check_shape(name, t, (n,))
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        block = 4096 if logits.is_cuda else 64
        _sample_kernel[(n,)](logits, temperatures, inverse_temperatures(temperatures), top_ks,
                             top_ps, seeds, steps, out, vocab, logits.stride(0), BLOCK=block,
                             num_warps=8 if logits.is_cuda else 4)
    return out


@triton.jit
def _allowed(mask_ptr, r, stride_m, j, inside):
    """Bit ``j`` of bitmask row ``r`` (token 32 w + b is bit b of word w), False outside."""
    words = tl.load(mask_ptr + r * stride_m + (j >> 5), mask=inside, other=0)
    return inside & (((words >> (j & 31)) & 1) != 0)


@triton.jit
def _token_bitmask_kernel(x_ptr, mask_ptr, rows_ptr, vocab, stride_x, stride_m,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    else:
        row = r
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = j < vocab
    allowed = _allowed(mask_ptr, r, stride_m, j, inside)
    tl.store(x_ptr + row * stride_x + j, float("-inf"), mask=inside & ~allowed)


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> None:
    """Structured output's mask, in place and in one launch: ``x`` [B, V] float gets -inf
    at every token whose bit is 0 in its row of ``bitmask`` [R, ceil(V / 32)] int32 (token
    ``32 w + b`` is bit ``b`` of word ``w``, the grammar engine's layout). ``rows`` [R]
    (int32 / int64, on the device): the rows of ``x`` the mask rows belong to; None: R == B,
    in order. Allowed tokens are not read or written."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, V = x.shape
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=x.device)
    R = bitmask.shape[0]
    check_shape("bitmask", bitmask, (R, (V + 31) // 32))
    if rows is None:
        if R != B:
            raise ValueError(f"bitmask has {R} rows for x's {B}: pass rows")
    else:
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64), device=x.device)
        check_shape("rows", rows, (R,))
    if R == 0 or V == 0:
        return
    block = 1024
    _token_bitmask_kernel[(R, triton.cdiv(V, block))](
        x, bitmask, bitmask if rows is None else rows, V, x.stride(0), bitmask.stride(0),
        HAS_ROWS=rows is not None, BLOCK=block, num_warps=4)


@triton.jit
def _masked_argmax_kernel(logits_ptr, mask_ptr, rows_ptr, out_ptr, vocab, stride_l, stride_m,
                          BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + r).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int64)
    for j0 in range(0, vocab, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        allowed = _allowed(mask_ptr, r, stride_m, j, j < vocab)
        z = tl.load(logits_ptr + row * stride_l + j, mask=allowed,
                    other=float("-inf")).to(tl.float32)
        c_max = tl.max(z, axis=0)
        c_arg = tl.argmax(z, axis=0).to(tl.int64) + j0
        best_i = tl.where(c_max > best, c_arg, best_i)  # strictly: the first maximum wins
        best = tl.maximum(best, c_max)
    tl.store(out_ptr + row, best_i)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Greedy tokens of structured output's constrained rows in one launch: ``out[rows[r]]``
    = the index of the largest of ``logits[rows[r]]`` [V] among the tokens row ``r`` of
    ``bitmask`` [R, ceil(V / 32)] int32 allows (the first such index on ties, as
    torch.argmax; 0 when none is allowed), exactly the argmax of apply_token_bitmask's
    output. ``logits`` [B, V] any float dtype (read as float32, not copied), ``rows`` [R]
    int32 / int64, ``out`` [B] int64; rows not listed keep their value."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    B, V = logits.shape
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=logits.device)
    R = bitmask.shape[0]
    check_shape("bitmask", bitmask, (R, (V + 31) // 32))
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64), device=logits.device)
    check_shape("rows", rows, (R,))
    check_tensor("out", out, ndim=1, dtypes=(torch.int64,), device=logits.device)
    check_shape("out", out, (B,))
    if R == 0 or V == 0:
        return
    _masked_argmax_kernel[(R,)](logits, bitmask, rows, out, V, logits.stride(0),
                                bitmask.stride(0), BLOCK=4096 if logits.is_cuda else 256,
                                num_warps=8 if logits.is_cuda else 4)


@triton.jit
def _exponentials_kernel(seed_ptr, step_ptr, out_ptr, vocab, stride_o, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + r).to(tl.int64)
    step = tl.load(step_ptr + r).to(tl.int64)
    key = _mix32((seed & 0xFFFFFFFF) ^ 0x5BD1E995)
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF))
    key = _mix32(key ^ (step & 0xFFFFFFFF))
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _mix32((_mix32(key ^ j.to(tl.int64)) + key) & 0xFFFFFFFF)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    tl.store(out_ptr + r * stride_o + j, -tl.log(u), mask=j < vocab)


def seeded_exponentials(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws [R, vocab] float32 for seeded rows in one launch: row ``r`` is
    ``-log(u)`` with ``u`` the counter-based uniform of (seeds[r], steps[r], token) that
    ``sample`` uses (reference.random_uniform_ref), so a request's draws are a pure function
    of its seed and its step: never of the batch, nothing to carry when it moves. ``seeds``
    int64 [R] (the sample's seed), ``steps`` int64 [R] (tokens it generated before)."""
    check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,))
    R = seeds.shape[0]
    check_tensor("steps", steps, ndim=1, dtypes=(torch.int64,), device=seeds.device)
    check_shape("steps", steps, (R,))
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    out = torch.empty((R, vocab), dtype=torch.float32, device=seeds.device)
    if R:
        block = 1024
        _exponentials_kernel[(R, triton.cdiv(vocab, block))](seeds, steps, out, vocab,
                                                             out.stride(0), BLOCK=block,
                                                             num_warps=4)
    return out
