"""Long prefill chunks through torch SDPA's fused causal kernel (GPU, fp16 / bf16).

The Triton paged kernel (prefill_attention.py) runs any ragged batch but reaches about half
the FLOP rate of the kernel torch's SDPA picks on an H200 (cuDNN). This module sends every
chunk of at least ``min_query`` new tokens of a step to SDPA, one sequence at a time, and
leaves the others (decode rows of a mixed step, short prompts, chunks after a long prefix)
to one paged-kernel launch over just those sequences.

SDPA's causal mask is aligned upper left, right only for as many queries as keys. So a
chunk of n tokens after a cached prefix of p tokens runs as a square causal attention over
all p + n positions: the prefix's K/V copied out of the paged cache in front of the chunk's
own, and p zero queries in front of the chunk's (their rows are computed and dropped). That
costs (p + n)^2 / 2 instead of p * n + n^2 / 2 query-key pairs, so it is taken only while
p <= n (at most 4/3 of the work, at about twice the rate).

cuDNN builds an execution plan for each new shape, which takes milliseconds: with the
lengths of real traffic every call would be a new shape. Every call is therefore padded at
the end to a bucket length (a multiple of 256 up to 4096 tokens, then 16 buckets per
doubling): a causal query never sees a key after it, so padding rows at the end changes
nothing for the real rows, and the plans are built once per bucket.

Measured on an H200 at Llama-3-8B shapes: bench/results/attention_prefill_gpu_h200.json
(``long_prefill`` rows against ``triton_paged``), bench/results/prefill_capacity_gpu_h200.json
(prompt tokens/s of a prefill engine on the disaggregated benchmark's mix).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.prefill_attention import paged_prefill_attention
from engine.layers.attention import AttentionMetadata

# A chunk of at least this many new tokens goes to SDPA (one call per sequence: shorter
# chunks cost more in launches than they win; bench/results/attention_prefill_gpu_h200.json)
LONG_MIN_QUERY = 512
# ... and a cached prefix of at most this many times its length (the square call's extra work)
MAX_PREFIX_RATIO = 1.0
_DTYPES = (torch.float16, torch.bfloat16)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [n, Hk, D], causal with no prefix -> [n, Hq, D]."""
    # 4-D [1, H, n, D]: torch's fused kernels take 4-D inputs only; 3-D falls back to the
    # math kernel (measured: 4096-token TTFT 506 ms with 3-D). K/V heads are shared by the
    # kernel (enable_gqa), not expanded by a copy first: on an H200 a 4096-token layer takes
    # 0.283 instead of 0.345 ms, with the same output bits
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def bucket(length: int) -> int:
    """The padded length of a call over ``length`` positions: a multiple of 256 up to 4096,
    above that of 1/16 of the next power of two (at most ~6% padding there)."""
    step = max(256, (1 << (length - 1).bit_length()) // 16)
    return -(-length // step) * step


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device, max_len: int) -> int:
    """Run SDPA once at every bucket length up to ``max_len``, in both layouts the path
    passes (q/k/v views of one packed qkv tensor, and separate buffers), so that cuDNN builds
    its plans at start-up rather than inside a request's prefill. Returns the buckets."""
    count, length = 0, bucket(1)
    while length <= bucket(max_len):
        qkv = torch.zeros(length, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                          device=device)
        q, k, v = (x.view(length, -1, head_dim) for x in qkv.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
        sdpa_causal(q, k, v, 1.0)
        sdpa_causal(q.contiguous(), k.contiguous(), v.contiguous(), 1.0)
        count += 1
        length = bucket(length + 1)
    return count


def long_prefill_available(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether these tensors take this path: CUDA, and a fp16 / bf16 cache of q's dtype (the
    fused SDPA kernels need half precision)."""
    return q.is_cuda and q.dtype in _DTYPES and kv_cache.dtype == q.dtype


@dataclass
class LongChunk:
    start: int  # first q row
    n: int  # new tokens
    prefix: int  # cached tokens before them
    length: int  # bucket(prefix + n): rows of each buffer below
    # with a prefix or padding: [length, H, D] buffers, zero outside the rows each layer
    # writes (q: the chunk's rows; k / v: the prefix's and the chunk's rows)
    bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    prefix_blocks: torch.Tensor | None  # int64 cache blocks holding the prefix


@dataclass
class LongPlan:
    """The step's long chunks and the other sequences (built once per step, reused by every
    layer)."""
    chunks: list[LongChunk]
    paged_seqs: torch.Tensor | None  # int32 indices of the other sequences (None: none)
    paged_max_query: int


def plan_for(meta: AttentionMetadata, kv_cache: torch.Tensor, q: torch.Tensor,
             min_query: int, max_prefix_ratio: float = MAX_PREFIX_RATIO) -> LongPlan | None:
    """The step's plan (cached in ``meta.cache``), or None when no chunk qualifies."""
    if "long_plan" in meta.cache:
        return meta.cache["long_plan"]
    qlens, slens = meta.query_lens_list, meta.seq_lens_list
    block_size, hk, d = kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[5]
    chunks, other, start = [], [], 0
    for i, (n, s) in enumerate(zip(qlens, slens)):
        p = s - n
        if n >= min_query and p <= max_prefix_ratio * n:
            length = bucket(s)
            bufs = blocks = None
            if p or length != n:
                z = dict(dtype=q.dtype, device=q.device)
                bufs = (torch.zeros(length, q.shape[1], d, **z), torch.zeros(length, hk, d, **z),
                        torch.zeros(length, hk, d, **z))
            if p:
                blocks = meta.block_tables[i, :-(-p // block_size)].long()
            chunks.append(LongChunk(start, n, p, length, bufs, blocks))
        else:
            other.append(i)
        start += n
    plan = None
    if chunks:
        plan = LongPlan(chunks, torch.tensor(other, dtype=torch.int32).to(kv_cache.device)
                        if other else None, max((qlens[i] for i in other), default=0))
    meta.cache["long_plan"] = plan
    return plan


def long_prefill_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           plan: LongPlan) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D] (the step's new rows, already stored in the cache) ->
    [T, Hq, D]: the plan's long chunks through SDPA, the rest through the paged kernel."""
    if plan.paged_seqs is not None:
        out = paged_prefill_attention(q, kv_cache, layer, meta.block_tables,
                                      meta.query_start_loc, meta.seq_lens, scale,
                                      max_query_len=plan.paged_max_query, seqs=plan.paged_seqs)
    else:
        out = torch.empty_like(q)
    block_size, hk, d = kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[5]
    for c in plan.chunks:
        rows = slice(c.start, c.start + c.n)
        if c.bufs is None:  # no prefix, a bucket length already
            out[rows] = sdpa_causal(q[rows], k[rows], v[rows], scale)
            continue
        qb, kb, vb = c.bufs
        p, end = c.prefix, c.prefix + c.n
        if p:  # whole blocks; the chunk's rows below overwrite the last block's tail
            nb = c.prefix_blocks.shape[0]
            for buf, which in ((kb, 0), (vb, 1)):
                torch.index_select(kv_cache[:, layer, which], 0, c.prefix_blocks,
                                   out=buf[:nb * block_size].view(nb, block_size, hk, d))
        qb[p:end], kb[p:end], vb[p:end] = q[rows], k[rows], v[rows]
        out[rows] = sdpa_causal(qb, kb, vb, scale)[p:end]
    return out
