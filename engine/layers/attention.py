"""Attention over the paged KV cache, behind a small backend interface.

The KV cache is one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
("block-major": one block holds every layer's K and V contiguously, so a KV transfer moves a
run of blocks as one region). Token ``t`` of a sequence lives at slot
``block_table[t // block_size] * block_size + t % block_size``.

A backend stores the step's new K/V into the cache, then attends each query token to its
sequence's tokens up to and including its own position. The model runner builds the metadata;
the scheduler never sees any of this.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0)
    seq_lens: torch.Tensor  # [B] int32: tokens in the sequence after this step
    query_start_loc: torch.Tensor  # [B+1] int32: offsets of each sequence's new tokens
    # host-side copies (the torch path loops over them; kernels read the tensors)
    seq_lens_list: list[int]
    query_lens_list: list[int]
    max_seq_len: int
    max_query_len: int
    # a mixed step (one-token rows and longer chunks) orders its one-token sequences first:
    # the first ``num_decode`` sequences have one new token each, and ``rest`` describes the
    # others on their own (offsets from the first of their tokens), so a backend can give the
    # two parts different kernels; 0 / None otherwise
    num_decode: int = 0
    rest: AttentionMetadata | None = None
    # derived once per step by the torch backend and reused by every layer
    cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    """Interface: ``forward(layer, q, k, v, kv_cache, meta) -> out`` with q ``[T, Hq, D]``,
    k/v ``[T, Hk, D]``; returns ``[T, Hq, D]``. Must store k/v into the cache first."""

    name = "abstract"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                   slot_mapping: torch.Tensor, memo: dict | None = None) -> None:
    bs = kv_cache.shape[3]
    if memo is not None and "blk_off" in memo:
        blk, off = memo["blk_off"]
    else:
        blk = slot_mapping // bs
        off = slot_mapping % bs
        if memo is not None:
            memo["blk_off"] = (blk, off)
    # view first, then index: mixing int scalars into advanced indexing is ~300x slower
    kv_cache[:, layer, 0][blk, off] = k
    kv_cache[:, layer, 1][blk, off] = v


class TorchAttention(AttentionBackend):
    """Reference path in plain torch (the CPU backend)."""

    name = "torch"

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, layer, q, k, v, kv_cache, meta):
        store_kv_torch(k, v, kv_cache, layer, meta.slot_mapping, meta.cache)
        if meta.decode_only:
            return self._decode(layer, q, kv_cache, meta)
        out = torch.empty_like(q)
        start = 0
        bs = kv_cache.shape[3]
        decode_rows: list[int] = []
        for i, (qlen, slen) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            end = start + qlen
            if qlen == 1 and slen > 1:
                decode_rows.append(i)
            elif qlen == slen:  # no cached context: attend to the fresh k/v
                out[start:end] = _sdpa(q[start:end], k[start:end], v[start:end], self.scale,
                                       causal=True)
            else:
                nb = -(-slen // bs)
                blocks = meta.block_tables[i, :nb].long()
                kk = kv_cache[:, layer, 0].index_select(0, blocks).reshape(-1, *k.shape[1:])[:slen]
                vv = kv_cache[:, layer, 1].index_select(0, blocks).reshape(-1, *v.shape[1:])[:slen]
                out[start:end] = _sdpa(q[start:end], kk, vv, self.scale, causal=True,
                                       offset=slen - qlen)
            start = end
        if decode_rows:
            memo = meta.cache.get("mixed")
            if memo is None:  # the decode rows of a mixed step, as their own metadata
                rows = torch.tensor(decode_rows, dtype=torch.long, device=q.device)
                loc = meta.query_start_loc.long()[rows]
                sub = AttentionMetadata(
                    slot_mapping=meta.slot_mapping, block_tables=meta.block_tables[rows],
                    seq_lens=meta.seq_lens[rows], query_start_loc=meta.query_start_loc,
                    seq_lens_list=[meta.seq_lens_list[r] for r in decode_rows],
                    query_lens_list=[1] * len(decode_rows),
                    max_seq_len=max(meta.seq_lens_list[r] for r in decode_rows), max_query_len=1)
                memo = meta.cache["mixed"] = (loc, sub)
            loc, sub = memo
            out[loc] = self._decode(layer, q[loc], kv_cache, sub)
        return out

    def _decode(self, layer, q, kv_cache, meta):
        """One query per sequence: gather each sequence's blocks (one row copy per block),
        then attend with the query heads of each KV head as that head's queries, masked past
        the sequence's length."""
        bs = kv_cache.shape[3]
        b, hq, d = q.shape
        hk = kv_cache.shape[4]
        nb = -(-meta.max_seq_len // bs)
        memo = meta.cache.get("decode")
        if memo is None:
            idx = meta.block_tables[:, :nb].reshape(-1).long()
            pos = torch.arange(nb * bs, device=q.device)
            mask = (pos[None, :] < meta.seq_lens.long()[:, None])[:, None, None, :]  # [B,1,1,S]
            memo = meta.cache["decode"] = (idx, mask)
        idx, mask = memo
        k = kv_cache[:, layer, 0].index_select(0, idx).view(b, nb * bs, hk, d).transpose(1, 2)
        v = kv_cache[:, layer, 1].index_select(0, idx).view(b, nb * bs, hk, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.view(b, hk, hq // hk, d), k, v, attn_mask=mask,
                                             scale=self.scale)
        return out.reshape(b, hq, d)


def _sdpa(q, k, v, scale, causal: bool, offset: int = 0):
    """q [n, Hq, D], k/v [s, Hk, D]; query j sits at position offset + j."""
    gqa = q.shape[1] != k.shape[1]
    # 4-D [1, H, n, D] views: SDPA's fused CPU/GPU kernels only take 4-D inputs
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if not causal or (offset == 0 and q.shape[0] == k.shape[0]):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                           enable_gqa=gqa)
    else:
        n, s = q.shape[0], k.shape[0]
        dev = q.device
        mask = (torch.arange(s, device=dev)[None, :]
                <= (torch.arange(n, device=dev)[:, None] + offset))
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)
