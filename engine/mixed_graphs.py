"""CUDA graphs for mixed steps: running sequences decoding plus a few short prefill chunks.

An eager step of Llama-3-8B costs ~13 ms of host time on an H200 (launches of 32 layers),
as long as the GPU work of ~128 decode rows. A decode worker that prefills short prompts
itself, and a colocated worker whose short prompts join running decodes, run such steps all
the time; captured, they cost their GPU time only (bench/mixed_step_gpu.py).

One graph per (decode bucket ``b``, prefill-token bucket ``p``). Static layout of a step:

* token rows ``[0, b)``: one per decode row (a sequence with one new token), padded like the
  decode graphs (slot -1: no KV write; length 0: zero attention row);
* token rows ``[b, b + p)``: the chunks of up to ``MAX_PREFILL_SEQS`` sequences packed in
  order, then padding (slot -1; no sequence covers them, their output is never read);
* logits for ``b + MAX_PREFILL_SEQS`` rows: every decode row, then each chunk's last token.

Decode rows take the decode kernel over a block table of the decode graphs' fixed width, the
chunks one prefill-kernel launch over the static query offsets (programs of an absent chunk
exit at once): both read only device values, so a replay serves any lengths that fit.
"""
from __future__ import annotations

import numpy as np

from engine.scheduler import SchedulerOutput

MAX_PREFILL_SEQS = 8


def token_buckets(max_tokens: int) -> list[int]:
    """Prefill-token buckets: 128, 256, ... below ``max_tokens``, then ``max_tokens``."""
    out: list[int] = []
    b = 128
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens] if max_tokens > 0 else []


def plan_mixed(out: SchedulerOutput, decode_buckets: list[int], tokens: list[int], width: int):
    """``(decode item indices, prefill item indices, b, p)`` when ``out`` fits a mixed graph
    (at least one chunk of more than one token, at most MAX_PREFILL_SEQS of them, their
    tokens within the largest bucket, every block table within ``width``); None otherwise."""
    if not tokens:
        return None
    dec, pre, n_pre = [], [], 0
    for i, item in enumerate(out.scheduled):
        if len(item.seq.block_table) > width:
            return None
        if item.num_new_tokens == 1:
            dec.append(i)
        else:
            pre.append(i)
            n_pre += item.num_new_tokens
    if not pre or len(pre) > MAX_PREFILL_SEQS or n_pre > tokens[-1] \
            or len(dec) > decode_buckets[-1]:
        return None
    b = next(x for x in decode_buckets if x >= max(1, len(dec)))
    p = next(x for x in tokens if x >= n_pre)
    return dec, pre, b, p


def fill_mixed_inputs(out: SchedulerOutput, dec: list[int], pre: list[int], b: int, p: int,
                      block_size: int, i64: np.ndarray, dec_lens: np.ndarray,
                      dec_tables: np.ndarray, qsl: np.ndarray, pre_lens: np.ndarray,
                      pre_tables: np.ndarray, table_rows) -> list[int]:
    """Host side of a mixed graph step. ``i64`` is [4, >= b + p] (ids, positions, slots, then
    in its first b + MAX_PREFILL_SEQS entries the rows whose logits are computed);
    ``dec_lens`` [>= b], ``dec_tables`` [>= b, width]; ``qsl`` [MAX_PREFILL_SEQS + 1],
    ``pre_lens`` [MAX_PREFILL_SEQS], ``pre_tables`` [MAX_PREFILL_SEQS, width]. Returns, in
    the order of ``out.scheduled``, the logit row of each item that samples."""
    items = out.scheduled
    k = MAX_PREFILL_SEQS
    t = b + p
    i64[:3, :t] = 0
    i64[2, :t] = -1
    i64[3, :b + k] = 0
    dec_lens[:b] = 0
    dec_tables[:b] = 0
    pre_lens[:] = 0
    pre_tables[:] = 0
    ids, pos, slots = [], [], []
    for r, i in enumerate(dec):
        s = items[i].seq
        q = s.num_computed_tokens
        bt = s.block_table
        ids.append(s.token_ids[q])
        pos.append(q)
        slots.append(bt[q // block_size] * block_size + q % block_size)
        dec_tables[r, :len(bt)] = table_rows.get(s.request_id, bt)
    nd = len(dec)
    if nd:
        i64[0, :nd] = ids
        i64[1, :nd] = pos
        i64[2, :nd] = slots
        dec_lens[:nd] = i64[1, :nd] + 1
        i64[3, :nd] = np.arange(nd)
    ids, pos, slots = [], [], []
    qsl[0] = 0
    for j, i in enumerate(pre):
        item = items[i]
        s = item.seq
        start, end = s.num_computed_tokens, s.num_computed_tokens + item.num_new_tokens
        bt = s.block_table
        ids.extend(s.token_ids[start:end])
        pos.extend(range(start, end))
        slots.extend(bt[x // block_size] * block_size + x % block_size for x in range(start, end))
        qsl[j + 1] = len(ids)
        pre_lens[j] = end
        pre_tables[j, :len(bt)] = table_rows.get(s.request_id, bt)
        i64[3, b + j] = b + len(ids) - 1
    qsl[len(pre) + 1:] = len(ids)
    i64[0, b:b + len(ids)] = ids
    i64[1, b:b + len(ids)] = pos
    i64[2, b:b + len(ids)] = slots
    row = {i: r for r, i in enumerate(dec)}
    row.update({i: b + j for j, i in enumerate(pre)})
    return [row[i] for i, item in enumerate(items) if item.samples]
