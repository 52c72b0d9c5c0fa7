"""Host side of the CUDA-graph steps (engine.cuda_graphs captures and replays them): the
static inputs of a decode-only step and of a mixed step, written into pinned numpy buffers.
Checked against the eager inputs on the CPU (tests/unit/test_graph_inputs.py).

Mixed steps: running sequences decoding plus a few short prefill chunks. An eager step
launches every layer's kernels from the host, which for an 8B model takes about as long as
the GPU work of a full batch of decode rows. A decode worker that prefills short prompts
itself, and a colocated worker whose short prompts join running decodes, run such steps all
the time; captured, they cost their GPU time only (bench/mixed_step_gpu.py times the paths;
docs/performance.md, "Kernels").

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


class BlockTableRows:
    """Each running request's block table as an int32 array, converted from its Python list
    a block at a time: a decode step copies whole rows (memcpy) instead of converting every
    entry of every table (256 requests of 4,000 tokens: 64,000 list items per step).

    Tables only grow while a request runs; a request whose table was replaced (preempted and
    rescheduled) is converted afresh. ``drop`` forgets a finished request."""

    def __init__(self, width: int):
        self.width = width
        self._rows: dict[str, tuple[list[int], np.ndarray, int]] = {}

    def get(self, request_id: str, table: list[int]) -> np.ndarray:
        if len(table) > self.width:
            raise ValueError(f"block table of {len(table)} blocks exceeds width {self.width}")
        ent = self._rows.get(request_id)
        if ent is None or ent[0] is not table or ent[2] > len(table):
            arr, n = np.zeros(self.width, np.int32), 0
        else:
            _, arr, n = ent
        if len(table) > n:
            arr[n:len(table)] = table[n:]
            n = len(table)
        self._rows[request_id] = (table, arr, n)
        return arr[:n]

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)


def fill_decode_inputs(out: SchedulerOutput, b: int, block_size: int, i64: np.ndarray,
                       seq_lens: np.ndarray, tables: np.ndarray, table_rows: BlockTableRows,
                       chained: int = 0) -> None:
    """Host side of a CUDA-graph decode step: write the first ``b`` rows of the static inputs
    for ``out`` (one token per sequence). ``i64`` is [3, >=b] (ids, positions, slots),
    ``seq_lens`` [>=b], ``tables`` [>=b, width]. Rows past ``len(out.scheduled)`` are padding:
    slot -1 (no KV write) and length 0 (no attention). Each row computes position
    num_computed_tokens + ahead (ScheduledSeq.ahead: what the step before, not read yet,
    computes); the first ``chained`` rows' ids are left for the device to fill (that step's
    tokens); the other rows take their last token."""
    n = len(out.scheduled)
    tables[:b] = 0
    i64[:, :b] = 0
    i64[2, :b] = -1
    seq_lens[:b] = 0
    pos, slots = [], []  # built as lists, then one numpy assignment each
    for i, item in enumerate(out.scheduled):
        s = item.seq
        p = s.num_computed_tokens + item.ahead
        bt = s.block_table
        pos.append(p)
        slots.append(bt[p // block_size] * block_size + p % block_size)
        tables[i, :len(bt)] = table_rows.get(s.request_id, bt)
    if chained < n:
        i64[0, chained:n] = [item.seq.token_ids[p] for item, p in
                             zip(out.scheduled[chained:], pos[chained:])]
    i64[1, :n] = pos
    i64[2, :n] = slots
    seq_lens[:n] = i64[1, :n] + 1


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
                      pre_tables: np.ndarray, table_rows: BlockTableRows) -> list[int]:
    """Host side of a mixed graph step. ``i64`` is [4, >= b + p] (ids, positions, slots, then
    in its first b + MAX_PREFILL_SEQS entries the rows whose logits are computed);
    ``dec_lens`` [>= b], ``dec_tables`` [>= b, width]; ``qsl`` [MAX_PREFILL_SEQS + 1],
    ``pre_lens`` [MAX_PREFILL_SEQS], ``pre_tables`` [MAX_PREFILL_SEQS, width]. Returns, in
    the order of ``out.scheduled``, the logit row of each item that samples."""
    items = out.scheduled
    k = MAX_PREFILL_SEQS
    t = b + p
    # decode rows [0, b): as in a decode-only graph step
    fill_decode_inputs(SchedulerOutput([items[i] for i in dec]), b, block_size, i64[:3],
                       dec_lens, dec_tables, table_rows)
    i64[:3, b:t] = 0
    i64[2, b:t] = -1
    i64[3, :b + k] = 0
    i64[3, :len(dec)] = np.arange(len(dec))
    pre_lens[:] = 0
    pre_tables[:] = 0
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
