"""Torch reference implementations of every kernel in this package (same signatures).

They are the specification the Triton kernels are tested against, and the CPU path of the
engine. Math is done in fp32 and rounded to the input dtype once, as the kernels do.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL1 = 0x2C1B3C6D  # odd, < 2**31 so int64 products never overflow
_MUL2 = 0x297A2D39
_NUM_BISECT = 32  # order-preserving int32 keys: 32 halvings find an exact threshold


def store_kv_ref(key, value, kv_cache, layer, slot_mapping) -> None:
    block_size = kv_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blk, off = slots // block_size, slots % block_size
    kv_cache[blk, layer, 0, off] = key[valid].to(kv_cache.dtype)
    kv_cache[blk, layer, 1, off] = value[valid].to(kv_cache.dtype)


def _gather_kv(kv_cache, layer, block_table, length):
    block_size = kv_cache.shape[3]
    pos = torch.arange(length, device=kv_cache.device)
    blk = block_table[pos // block_size].long()
    k = kv_cache[blk, layer, 0, pos % block_size].float()  # [length, kv_heads, head_dim]
    v = kv_cache[blk, layer, 1, pos % block_size].float()
    return k, v


def _attend(q, k, v, scale, q_pos):
    """q [nq, H, D] fp32 at absolute positions q_pos; k, v [nk, Hkv, D]; causal."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def paged_decode_attention_ref(q, kv_cache, layer, block_tables, context_lens, scale,
                               num_splits=None):
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        n = int(context_lens[i])
        if n == 0:
            continue
        k, v = _gather_kv(kv_cache, layer, block_tables[i], n)
        pos = torch.tensor([n - 1], device=q.device)
        out[i] = _attend(q[i : i + 1].float(), k, v, scale, pos)[0].to(q.dtype)
    return out


def paged_prefill_attention_ref(q, kv_cache, layer, block_tables, query_start_loc, seq_lens,
                                scale, max_query_len=None):
    out = torch.zeros_like(q)
    for i in range(block_tables.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        n = int(seq_lens[i])
        if end == start:
            continue
        k, v = _gather_kv(kv_cache, layer, block_tables[i], n)
        pos = torch.arange(n - (end - start), n, device=q.device)
        out[start:end] = _attend(q[start:end].float(), k, v, scale, pos).to(q.dtype)
    return out


def rmsnorm_ref(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rmsnorm_ref(x, residual, weight, eps):
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def silu_and_mul_ref(gate_up):
    d = gate_up.shape[-1] // 2
    g, u = gate_up[..., :d].float(), gate_up[..., d:].float()
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)


def rotary_embedding_ref(positions, q, k, cos_sin_cache) -> None:
    """In place. cos_sin_cache [max_pos, rot_dim]: cos in [:rot_dim/2], sin in [rot_dim/2:];
    rotates the first rot_dim dims of each head with the NeoX rotate_half convention."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        x1, x2 = t[..., :half].float(), t[..., half : 2 * half].float()
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        t[..., :half] = o1.to(t.dtype)
        t[..., half : 2 * half] = o2.to(t.dtype)


def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 12)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 15)


def random_uniform_ref(seeds, steps, vocab_size):
    """The sampler's counter-based RNG: u[i, j] in (0, 1), a pure function of
    (seeds[i], steps[i], j), so a request's draws never depend on the batch it is in."""
    seeds, steps = seeds.long()[:, None], steps.long()[:, None]
    key = _mix32((seeds & _M32) ^ 0x5BD1E995)
    key = _mix32(key ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (steps & _M32))
    idx = torch.arange(vocab_size, device=seeds.device)[None, :]
    h = _mix32((_mix32(key ^ idx) + key) & _M32)
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def seeded_exponentials_ref(seeds, steps, vocab):
    """See sampling.seeded_exponentials: -log of random_uniform_ref."""
    return -torch.log(random_uniform_ref(seeds, steps, vocab))


def _order_keys(z):
    """int64 keys whose order is the order of the fp32 values z."""
    b = z.contiguous().view(torch.int32)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b).long()


def _bisect(keys, ok_fn, lo, hi):
    """Largest threshold t in [lo, hi) with ok_fn(keys >= t) true; ok(lo) must hold."""
    for _ in range(_NUM_BISECT):
        mid = (lo + hi) >> 1
        ok = ok_fn(keys >= mid[:, None])
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return lo


def sample_ref(logits, temperatures, top_ks, top_ps, seeds, steps):
    """Greedy where temperature == 0, else Gumbel-max over the top-k then top-p set of
    softmax(logits / temperature). top_k <= 0 or >= vocab and top_p >= 1 disable them."""
    n, vocab = logits.shape
    t = temperatures.float()
    inv_t = torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 1.0)
    z = logits.float() * inv_t[:, None]
    keys = _order_keys(z)
    kmax = keys.max(dim=1).values + 1
    k = top_ks.long()
    use_k = (k > 0) & (k < vocab)
    lo = _bisect(keys, lambda m: m.sum(1) >= k, keys.min(dim=1).values, kmax)
    keep = keys >= torch.where(use_k, lo, torch.full_like(lo, -(2**40)))[:, None]
    e = torch.where(keep, torch.exp(z - z.max(dim=1, keepdim=True).values), 0.0)
    target = top_ps.float() * e.sum(1)
    kmin = torch.where(keep, keys, 2**40).min(dim=1).values
    lo = _bisect(keys, lambda m: (e * m).sum(1) >= target, kmin, kmax)
    use_p = top_ps < 1.0
    keep &= keys >= torch.where(use_p, lo, torch.full_like(lo, -(2**40)))[:, None]
    u = random_uniform_ref(seeds, steps, vocab)
    g = -torch.log(-torch.log(u))
    sampled = torch.where(keep, z + g, float("-inf")).argmax(dim=1)
    return torch.where(t > 0, sampled, logits.float().argmax(dim=1))


def apply_token_bitmask_ref(x, bitmask, rows=None) -> None:
    """See sampling.apply_token_bitmask: -inf in ``x`` [B, V] wherever the row's bit is 0."""
    V = x.shape[1]
    words = bitmask.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    bits = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).view(-1, words * 32)
    forbid = bits[:, :V] == 0
    if rows is None:
        x.masked_fill_(forbid, float("-inf"))
        return
    idx = rows.to(torch.int64)
    x.index_copy_(0, idx, x.index_select(0, idx).masked_fill_(forbid, float("-inf")))


def masked_argmax_ref(logits, bitmask, rows, out) -> None:
    """See sampling.masked_argmax."""
    x = logits.index_select(0, rows.to(torch.int64)).float()
    apply_token_bitmask_ref(x, bitmask)
    out.index_copy_(0, rows.to(torch.int64), x.argmax(dim=-1))


def gemv_ref(x, weight, bias=None, *, prologue="none", residual=None, norm_weight=None,
             eps=1e-6, **_config):
    """Reference of engine.kernels.matvec.gemv (config keywords ignored): the prologue's rounded
    input, then an fp32 product rounded once to x.dtype."""
    extra = None
    if prologue == "silu_mul":
        x = silu_and_mul_ref(x)
    elif prologue == "rmsnorm":
        extra, x = x, rmsnorm_ref(x, norm_weight, eps)
    elif prologue == "add_rmsnorm":
        x, extra = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if extra is None else (y, extra)


def rotary_store_kv_ref(positions, q, k, v, cos_sin_cache, kv_cache, layer, slot_mapping):
    """Reference of engine.kernels.cache.rotary_store_kv: rotate q and k in place, then
    store k and v into the cache."""
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    store_kv_ref(k, v, kv_cache, layer, slot_mapping)
