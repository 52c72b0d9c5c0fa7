"""CUDA graphs of the model runner: capture and replay of decode-only steps (one graph per
batch bucket) and of mixed steps (decode rows plus short prompt chunks; their layout is in
engine.graph_inputs, which fills the static inputs on the host). ``ModelRunner`` takes these
methods from ``CudaGraphsMixin``; they read and write the runner's state (model, KV cache,
backend, the static buffers made at capture)."""
from __future__ import annotations

from collections.abc import Callable
import logging

import torch

from engine.layers.attention import AttentionMetadata
from engine.graph_inputs import (MAX_PREFILL_SEQS, BlockTableRows, fill_decode_inputs,
                                 fill_mixed_inputs, plan_mixed, token_buckets)
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def _capture(run: Callable[[], tuple], pool, stream) -> tuple:
    """(graph, *outputs) of ``run`` captured on ``stream`` into the shared memory ``pool``,
    after one eager run on a side stream (compiles kernels, creates library handles)."""
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            outputs = run()
    return (g, *outputs)


class CudaGraphsMixin:
    """Graph capture and replay for ModelRunner (see the module docstring)."""

    def _capture_graphs(self) -> None:
        """Capture one graph per batch-size bucket for decode-only steps (every sequence adds
        one token): model forward, logits and greedy argmax. Inputs live in static buffers;
        a step fills the first ``n`` rows and pads the bucket with slot -1 (store_kv skips
        it) and context 0 (decode writes a zero row). The block-table width is fixed at
        cuda_graph_max_len (at most max_model_len) / block_size, so the decode kernel's split
        count (a function of shapes only) is the same at capture and at replay; a step with
        a longer sequence runs eagerly (``_can_graph``). Neither the tables copied each step
        nor the split count grow with a model's 131072-token maximum."""
        sc = self.config.scheduler
        bs = self.block_size
        span = min(self.config.cuda_graph_max_len, self.max_model_len)
        self.graph_width = width = -(-span // bs)
        buckets = [1, 2, 4, 8]
        while buckets[-1] < sc.max_num_seqs:
            buckets.append(buckets[-1] * 2 if buckets[-1] < 256 else buckets[-1] + 128)
        self.graph_buckets = [b for b in buckets if b < sc.max_num_seqs] + [
            next(b for b in buckets if b >= sc.max_num_seqs)]
        mb = self.graph_buckets[-1]
        dev = self.device
        # packed static inputs: int64 [3, mb] (ids, positions, slots); int32 seq_lens [mb]
        # then block tables [mb, width]; pinned host twins for one copy each per step
        self.g_i64 = torch.zeros(3, mb, dtype=torch.int64, device=dev)
        self.g_i32 = torch.zeros(mb + mb * width, dtype=torch.int32, device=dev)
        # two sets of pinned staging buffers, used in turn: a chained launch fills one while
        # the other's copy may still be queued; each set's event says its copy has run
        self.h_i64 = [torch.zeros(3, mb, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.h_i32 = [torch.zeros(mb + mb * width, dtype=torch.int32).pin_memory()
                      for _ in range(2)]
        self.h_tok = [torch.zeros(mb, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.h_i64_np = [t.numpy() for t in self.h_i64]
        self.h_i32_np = [t.numpy() for t in self.h_i32]
        self._stage = 0
        self._stage_done: list[torch.cuda.Event | None] = [None, None]
        self.table_rows = BlockTableRows(width)
        self.g_i64[2].fill_(-1)
        qsl = torch.arange(mb + 1, dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph's default capture stream is made once per process, on the device
        # current at its first use: a second runner on another GPU (tests; one process, two
        # engines) would capture on a stream of the first GPU. Each runner brings its own.
        capture_stream = torch.cuda.Stream(device=dev)
        for b in reversed(self.graph_buckets):
            meta = AttentionMetadata(
                slot_mapping=self.g_i64[2, :b], seq_lens=self.g_i32[:b],
                block_tables=self.g_i32[mb:].view(mb, width)[:b], query_start_loc=qsl[:b + 1],
                seq_lens_list=[1] * b, query_lens_list=[1] * b, max_seq_len=1, max_query_len=1)

            def run(b=b, meta=meta):
                hidden = self.model(self.g_i64[0, :b], self.g_i64[1, :b], self.kv_cache, meta,
                                    self.backend)
                logits = self.model.compute_logits(hidden)
                return logits, logits.argmax(dim=-1)

            self.graphs[b] = _capture(run, pool, capture_stream)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %s, table width %d)",
                    len(self.graphs), self.graph_buckets, width)
        if self.config.mixed_graph_tokens and getattr(self.backend, "split_mixed", False):
            self._capture_mixed_graphs(pool, capture_stream)

    def _capture_mixed_graphs(self, pool, capture_stream) -> None:
        """One graph per (decode bucket, prefill-token bucket) for mixed steps; layout and
        padding in engine.graph_inputs."""
        self.mixed_tokens = token_buckets(self.config.mixed_graph_tokens)
        k = MAX_PREFILL_SEQS
        mb, w, dev = self.graph_buckets[-1], self.graph_width, self.device
        t = mb + self.mixed_tokens[-1]
        # int64 [4, t]: ids, positions, slots, logit rows; int32: decode lengths [mb], decode
        # tables [mb, w], chunk offsets [k + 1], chunk lengths [k], chunk tables [k, w]
        self.m_i64 = torch.zeros(4, t, dtype=torch.int64, device=dev)
        n32 = mb + mb * w + (k + 1) + k + k * w
        self.m_i32 = torch.zeros(n32, dtype=torch.int32, device=dev)
        self.hm_i64 = torch.zeros(4, t, dtype=torch.int64).pin_memory()
        self.hm_i32 = torch.zeros(n32, dtype=torch.int32).pin_memory()
        self.hm_tok = torch.zeros(mb + k, dtype=torch.int64).pin_memory()
        self._mixed_done: torch.cuda.Event | None = None
        self.m_i64[2].fill_(-1)
        o = mb + mb * w
        dec_tables = self.m_i32[mb:o].view(mb, w)
        qsl = self.m_i32[o:o + k + 1]
        pre_lens = self.m_i32[o + k + 1:o + 2 * k + 1]
        pre_tables = self.m_i32[o + 2 * k + 1:].view(k, w)
        qsl.copy_(torch.arange(k + 1, dtype=torch.int32))  # capture: one token per chunk
        for p in self.mixed_tokens:
            for b in reversed(self.graph_buckets):
                rest = AttentionMetadata(
                    slot_mapping=self.m_i64[2, b:b + p], block_tables=pre_tables,
                    seq_lens=pre_lens, query_start_loc=qsl,
                    # host lists only steer the backend: p < p + 1 keeps SDPA out
                    seq_lens_list=[p + 1] * k, query_lens_list=[p] * k,
                    max_seq_len=p + 1, max_query_len=p)
                meta = AttentionMetadata(
                    slot_mapping=self.m_i64[2, :b + p], block_tables=dec_tables[:b],
                    seq_lens=self.m_i32[:b], query_start_loc=qsl,
                    seq_lens_list=[1] * b + [p + 1] * k, query_lens_list=[1] * b + [p] * k,
                    max_seq_len=p + 1, max_query_len=p, num_decode=b, rest=rest)

                def run(b=b, p=p, meta=meta):
                    hidden = self.model(self.m_i64[0, :b + p], self.m_i64[1, :b + p],
                                        self.kv_cache, meta, self.backend)
                    logits = self.model.compute_logits(
                        hidden.index_select(0, self.m_i64[3, :b + k]))
                    return logits, logits.argmax(dim=-1)

                self.mixed_graphs[(b, p)] = _capture(run, pool, capture_stream)
        torch.cuda.synchronize()
        logger.info("captured %d mixed-step CUDA graphs (prefill tokens %s, up to %d chunks)",
                    len(self.mixed_graphs), self.mixed_tokens, k)

    def _mixed_step(self, out: SchedulerOutput, plan):
        """Fill the mixed graphs' static inputs for ``out`` and replay the (b, p) graph.
        Returns (logits, greedy, pinned host copy of greedy, its event, logit rows of the
        items that sample in scheduled order)."""
        dec, pre, b, p = plan
        k = MAX_PREFILL_SEQS
        mb, w = self.graph_buckets[-1], self.graph_width
        if self._mixed_done is not None:
            self._mixed_done.synchronize()  # the previous mixed step's copies have run
        h64, h32 = self.hm_i64.numpy(), self.hm_i32.numpy()
        o = mb + mb * w
        rows = fill_mixed_inputs(
            out, dec, pre, b, p, self.block_size, h64, h32[:mb], h32[mb:o].reshape(mb, w),
            h32[o:o + k + 1], h32[o + k + 1:o + 2 * k + 1], h32[o + 2 * k + 1:].reshape(k, w),
            self.table_rows)
        self.m_i64[:, :b + p].copy_(self.hm_i64[:, :b + p], non_blocking=True)
        self.m_i32[:b].copy_(self.hm_i32[:b], non_blocking=True)
        self.m_i32[mb:mb + b * w].copy_(self.hm_i32[mb:mb + b * w], non_blocking=True)
        self.m_i32[o:].copy_(self.hm_i32[o:], non_blocking=True)
        g, logits, greedy = self.mixed_graphs[(b, p)]
        g.replay()
        self.mixed_graph_steps += 1
        n = b + k
        self.hm_tok[:n].copy_(greedy[:n], non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self._mixed_done = landed
        return logits, greedy, self.hm_tok, landed, rows

    def _graph_step(self, out: SchedulerOutput, src: torch.Tensor | None = None):
        """Fill the static buffers for a decode-only step and replay its bucket's graph.
        ``src`` (a chained launch): the input tokens of the first len(src) rows, on the
        device (the step before's tokens, not read yet); those rows compute position
        num_computed_tokens + ahead; later rows take their last token from the host.
        Returns (logits [n, V], greedy [n] views for the n scheduled rows, pinned host copy
        of greedy, its event)."""
        n = len(out.scheduled)
        b = next(x for x in self.graph_buckets if x >= n)
        mb = self.graph_buckets[-1]
        bs = self.block_size
        k = self._stage
        self._stage ^= 1
        if self._stage_done[k] is not None:
            self._stage_done[k].synchronize()  # its previous copy has run (in practice: long ago)
        h64, h32 = self.h_i64_np[k], self.h_i32_np[k]
        chained = 0 if src is None else len(src)
        fill_decode_inputs(out, b, bs, h64, h32[:mb], h32[mb:].reshape(mb, self.graph_width),
                           self.table_rows, chained=chained)
        self.g_i64[:, :b].copy_(self.h_i64[k][:, :b], non_blocking=True)
        self.g_i32[:b].copy_(self.h_i32[k][:b], non_blocking=True)
        w = self.graph_width
        self.g_i32[mb:mb + b * w].copy_(self.h_i32[k][mb:mb + b * w], non_blocking=True)
        if chained:  # src is read before any replay rewrites the graph output it may view
            self.g_i64[0, :chained].copy_(src)
        g, logits, greedy = self.graphs[b]
        g.replay()
        self.graph_steps += 1
        host = self.h_tok[k]
        host[:n].copy_(greedy[:n], non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self._stage_done[k] = landed  # after this set's copies too (one stream, in order)
        return logits[:n], greedy[:n], host, landed

    def _mixed_plan(self, out: SchedulerOutput):
        if not self.mixed_graphs:
            return None
        return plan_mixed(out, self.graph_buckets, self.mixed_tokens, self.graph_width)

    def _can_graph(self, out: SchedulerOutput) -> bool:
        if not self.graphs or len(out.scheduled) > self.graph_buckets[-1]:
            return False
        return all(item.num_new_tokens == 1 and len(item.seq.block_table) <= self.graph_width
                   for item in out.scheduled)
