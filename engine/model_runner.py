"""The only place that builds tensors: the model, the KV cache, step inputs, sampling.

Takes a ``SchedulerOutput`` (ids and counts), turns it into flat input tensors and attention
metadata, runs the model and samples one token for every sequence whose chunk reached its end.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import logging
import os

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from engine.layers.sampler import Sampler, SamplingBatch
from engine.mixed_graphs import MAX_PREFILL_SEQS, fill_mixed_inputs, plan_mixed, token_buckets
from engine.models.registry import model_class
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepHandle:
    """A launched step. Its tokens are known at launch (eager paths, sampling on the host) or
    still on the device (greedy CUDA-graph steps: ``greedy`` is the device argmax, copied to
    the pinned ``host`` buffer; ``event`` completes when that copy has landed)."""
    sched: SchedulerOutput
    sampled_ids: list[str]
    rows: list[int] | None = None  # graph paths: the rows of ``greedy`` that sampled (None: all)
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    greedy: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    chained: bool = False  # launched by launch_next, before the previous step's tokens were read


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
    slot -1 (no KV write) and length 0 (no attention). The first ``chained`` rows compute
    position num_computed_tokens + 1 and their ids are left for the device to fill (the
    previous step's tokens, not read yet); the other rows take their last token."""
    n = len(out.scheduled)
    tables[:b] = 0
    i64[:, :b] = 0
    i64[2, :b] = -1
    seq_lens[:b] = 0
    pos, slots = [], []  # built as lists, then one numpy assignment each
    for i, item in enumerate(out.scheduled):
        s = item.seq
        p = s.num_computed_tokens + (1 if i < chained else 0)
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


def kv_block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return mc.num_layers * 2 * block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize


def make_attention_backend(config: EngineConfig, mc: ModelConfig) -> AttentionBackend:
    scale = mc.head_dim ** -0.5
    want = config.attention_backend
    if want == "auto":
        want = "triton" if config.device.startswith("cuda") else "torch"
    if want == "triton":
        from engine.kernels.backend import TritonAttention  # GPU path
        # A/B measurements: PDSERVE_FUSE_ROTARY=0 separate rotary and store_kv kernels;
        # PDSERVE_SPLIT_MIXED=0 a mixed step's decode rows through the prefill kernel
        return TritonAttention(scale, fuse_rotary=os.environ.get("PDSERVE_FUSE_ROTARY") != "0",
                               split_mixed=os.environ.get("PDSERVE_SPLIT_MIXED") != "0")
    return TorchAttention(scale)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU the pages come from calloc'd memory and are only backed
    once written, so a large KV cache costs resident memory only as blocks are used (zeros
    matter: masked attention positions multiply stale values by 0, which must not be NaN)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = 1
    for d in shape:
        n *= d
    raw = torch.from_numpy(np.zeros(n * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


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


class ModelRunner:
    def __init__(self, config: EngineConfig, mc: ModelConfig, weights: dict[str, torch.Tensor],
                 packed: dict[str, tuple] | None = None):
        self.config = config
        self.mc = mc
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.bind_thread()
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(mc)(mc)
        finally:
            torch.set_default_dtype(prev)
        self.model.load_weights(weights)
        self.model.eval()
        self.packed_projections = 0
        if (packed and self.device.type == "cpu" and self.dtype == torch.float32
                and hasattr(self.model, "load_packed")):
            # decode (<= 8 tokens per step) reads GGUF Q4_1 / Q8_0 blocks instead of fp32
            # (PDSERVE_CPU_PACKED=auto|off); builds the C++ extension on first use
            from engine.kernels import cpu_quant
            if cpu_quant.available():
                self.packed_projections = self.model.load_packed(packed)
                logger.info("CPU packed GEMV: %d projections read GGUF blocks",
                            self.packed_projections)
        self.backend = make_attention_backend(config, mc)

        kv_dtype = DTYPES[config.cache.kv_dtype] if config.cache.kv_dtype else self.dtype
        bb = kv_block_bytes(mc, self.block_size, kv_dtype)
        n = config.cache.num_blocks or max(1, config.cache.kv_cache_memory_bytes // bb)
        self.num_blocks = int(n)
        shape = (self.num_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = _zeros(shape, kv_dtype, self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks,
                    self.block_size, self.kv_cache.numel() * kv_dtype.itemsize / 2**20)
        self.shared_gen = torch.Generator(device=self.device)
        self.shared_gen.manual_seed(config.seed)
        self.sampler = Sampler(self.shared_gen)
        self.generators: dict[str, torch.Generator] = {}
        self.graphs: dict[int, tuple] = {}
        self.mixed_graphs: dict[tuple[int, int], tuple] = {}
        self.mixed_tokens: list[int] = []
        # steps by path (engine stats, pdserve_engine_steps_total{path})
        self.graph_steps = 0  # decode-only CUDA graphs
        self.mixed_graph_steps = 0  # mixed-step CUDA graphs
        self.eager_steps = 0
        self.gemv_tuning: dict = {}
        if self.device.type == "cuda" and self.backend.name == "triton":
            self.model.enable_fused_ops(True)
            if hasattr(self.model, "set_gemv_plan"):
                # one-token projections: Triton GEMV or cuBLAS, timed per shape once per
                # process (PDSERVE_GEMV=off|auto|force)
                from engine.kernels.gemv_tune import tune_gemv_plan
                plan, self.gemv_tuning = tune_gemv_plan(self.model)
                self.model.set_gemv_plan(plan)
            if not config.enforce_eager:
                self._capture_graphs()

    # ------------------------------------------------------------ CUDA graphs
    def _capture_graphs(self) -> None:
        """Capture one graph per batch-size bucket for decode-only steps (every sequence adds
        one token): model forward, logits and greedy argmax. Inputs live in static buffers;
        a step fills the first ``n`` rows and pads the bucket with slot -1 (store_kv skips
        it) and context 0 (decode writes a zero row). The block-table width is fixed at
        max_model_len / block_size, so the decode kernel's split count (a function of shapes
        only) is the same at capture and at replay."""
        sc = self.config.scheduler
        bs = self.block_size
        self.graph_width = width = -(-min(sc.max_model_len, self.mc.max_position) // bs)
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
        padding in engine.mixed_graphs."""
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

    def _graph_step(self, out: SchedulerOutput, prev: StepHandle | None = None,
                    keep: list[int] = ()):
        """Fill the static buffers for a decode-only step and replay its bucket's graph.
        With ``prev`` (a chained launch) row i < len(keep) computes position
        num_computed_tokens + 1 and its input token is prev's device argmax of row keep[i],
        copied on the GPU; later rows (joined since) take their last token from the host.
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
        chained = len(keep) if prev is not None else 0
        fill_decode_inputs(out, b, bs, h64, h32[:mb], h32[mb:].reshape(mb, self.graph_width),
                           self.table_rows, chained=chained)
        self.g_i64[:, :b].copy_(self.h_i64[k][:, :b], non_blocking=True)
        self.g_i32[:b].copy_(self.h_i32[k][:b], non_blocking=True)
        w = self.graph_width
        self.g_i32[mb:mb + b * w].copy_(self.h_i32[k][mb:mb + b * w], non_blocking=True)
        if prev is not None:  # prev's rows come first; prev.greedy (its graph's output) is
            src = prev.greedy  # read before any replay rewrites it
            if keep != list(range(len(src))):  # rows that ended are left out: gather on the
                idx = torch.tensor(keep, dtype=torch.int64).pin_memory()  # device, no sync
                src = src.index_select(0, idx.to(src.device, non_blocking=True))
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

    # ---------------------------------------------------------------- inputs
    def prepare(self, out: SchedulerOutput, next_ids: list[int] | None = None):
        """Flat inputs for ``out``. With ``next_ids`` (a chained launch, one token per row)
        row i < len(next_ids) computes position num_computed_tokens + 1 with input token
        next_ids[i]; later rows (joined since) take their last token.

        A mixed step lays out its one-token sequences first (``meta.num_decode`` of them,
        ``meta.rest`` the others): the GPU backend runs the decode kernel on them instead of
        the prefill kernel, which reads the context once per query head, not once per K/V
        head. ``sample_rows`` stays in the order of ``out.scheduled``."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        qlens: list[int] = []
        tables: list[list[int]] = []
        chained = 0 if next_ids is None else len(next_ids)
        items = out.scheduled
        order = range(len(items))
        num_decode = sum(1 for item in items if item.num_new_tokens == 1)
        if 0 < num_decode < len(items):
            order = ([i for i, item in enumerate(items) if item.num_new_tokens == 1]
                     + [i for i, item in enumerate(items) if item.num_new_tokens != 1])
        else:
            num_decode = 0
        last_row = [0] * len(items)
        for i in order:
            item = items[i]
            s = item.seq
            start = s.num_computed_tokens + (1 if i < chained else 0)
            end = start + item.num_new_tokens
            if i < chained:
                input_ids.append(next_ids[i])
            else:
                input_ids.extend(s.token_ids[start:end])
            positions.extend(range(start, end))
            bt = s.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + item.num_new_tokens)
            seq_lens.append(end)
            qlens.append(item.num_new_tokens)
            tables.append(bt)
            last_row[i] = qsl[-1] - 1
        sample_rows = [last_row[i] for i, item in enumerate(items)
                       if next_ids is not None or item.samples]
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens_list=seq_lens, query_lens_list=qlens,
            max_seq_len=max(seq_lens), max_query_len=max(qlens))
        if num_decode:
            nd, t0 = num_decode, qsl[num_decode]
            rest_qsl = [x - t0 for x in qsl[nd:]]
            meta.num_decode = nd
            meta.rest = AttentionMetadata(
                slot_mapping=meta.slot_mapping[t0:], block_tables=meta.block_tables[nd:],
                seq_lens=meta.seq_lens[nd:],
                query_start_loc=torch.tensor(rest_qsl, dtype=torch.int32, device=dev),
                seq_lens_list=seq_lens[nd:], query_lens_list=qlens[nd:],
                max_seq_len=max(seq_lens[nd:]), max_query_len=max(qlens[nd:]))
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, sample_rows

    def _sampling_batch(self, out: SchedulerOutput, every_row: bool = False) -> SamplingBatch:
        temps, ks, ps, gens = [], [], [], []
        want_lp = False
        for item in out.scheduled:
            if not (every_row or item.samples):
                continue
            sp = item.seq.sampling
            temps.append(sp.temperature)
            ks.append(sp.top_k)
            ps.append(sp.top_p)
            want_lp |= sp.logprobs
            g = None
            if sp.seed is not None and sp.temperature > 0:
                g = self.generators.get(item.seq.request_id)
                if g is None:
                    g = torch.Generator(device=self.device)
                    g.manual_seed(sp.seed)
                    self.generators[item.seq.request_id] = g
            gens.append(g)
        return SamplingBatch(temps, ks, ps, gens, want_lp)

    # ------------------------------------------------------------------- run
    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, on_queued: Callable | None = None) -> StepHandle:
        """Run one step. Greedy CUDA-graph steps return with the tokens still on the device
        (read them with :meth:`collect`); every other path samples on the host at once.

        ``on_queued(ready, layer_ready)`` is called once the step's forward pass is queued,
        before sampling waits for it: ``ready`` completes when the step's KV writes are done
        and ``layer_ready`` holds one event per layer (eager GPU path; None elsewhere), so a
        KV sender can start on a chunk while it computes."""
        sampled = [item.seq.request_id for item in out.scheduled if item.samples]
        if self._can_graph(out):
            logits, greedy, host, landed = self._graph_step(out)
            if on_queued is not None:
                on_queued(self.record_event(), None)
            if not sampled:
                return StepHandle(out, [], tokens=[])
            batch = self._sampling_batch(out)
            rows = None
            if len(sampled) < len(out.scheduled):
                rows = [i for i, item in enumerate(out.scheduled) if item.samples]
            if batch.all_greedy and not batch.want_logprobs:
                return StepHandle(out, sampled, rows=rows, greedy=greedy, host=host,
                                  event=landed)
            if rows is not None:
                logits = logits[rows]
            tokens, logprobs = self.sampler(logits, batch)
            return StepHandle(out, sampled, tokens=tokens, logprobs=logprobs)
        plan = self._mixed_plan(out)
        if plan is not None:
            logits, greedy, host, landed, rows = self._mixed_step(out, plan)
            if on_queued is not None:
                on_queued(self.record_event(), None)
            if not sampled:
                return StepHandle(out, [], tokens=[])
            batch = self._sampling_batch(out)
            if batch.all_greedy and not batch.want_logprobs:
                return StepHandle(out, sampled, rows=rows, greedy=greedy, host=host,
                                  event=landed)
            tokens, logprobs = self.sampler(logits[rows], batch)
            return StepHandle(out, sampled, tokens=tokens, logprobs=logprobs)
        ids, pos, meta, rows = self.prepare(out)
        self.eager_steps += 1
        layers: list | None = None
        after_layer = None
        if on_queued is not None and self.device.type == "cuda":
            layers = []

            def after_layer(_i: int) -> None:
                layers.append(self.record_event(blocking=False))
        hidden = self.model(ids, pos, self.kv_cache, meta, self.backend, after_layer)
        if on_queued is not None:
            on_queued(self.record_event(), layers)
        if not rows:
            return StepHandle(out, [], tokens=[])
        logits = self.model.compute_logits(hidden[rows])
        tokens, logprobs = self.sampler(logits, self._sampling_batch(out))
        return StepHandle(out, sampled, tokens=tokens, logprobs=logprobs)

    @torch.inference_mode()
    def launch_next(self, out: SchedulerOutput, prev: StepHandle,
                    keep: list[int] | None = None) -> StepHandle | None:
        """Launch the step after ``prev`` before prev's tokens are read (``async_decode``).

        ``out``'s first rows continue prev's rows ``keep`` (default: all, in order), one
        token each; their block tables already cover position num_computed_tokens + 1.
        Row i's input is the token prev sampled for its row keep[i]. Later rows are
        sequences that joined since (one token to compute, their input the last token they
        hold). Only greedy, logprob-free steps where every row of prev sampled chain;
        returns None (nothing launched) otherwise."""
        if keep is None:
            keep = list(range(len(prev.sampled_ids)))
        if not self.config.async_decode or prev.rows is not None or not keep \
                or len(keep) > len(out.scheduled) \
                or any(prev.sampled_ids[j] != item.seq.request_id
                       for j, item in zip(keep, out.scheduled)):
            return None
        batch = self._sampling_batch(out, every_row=True)
        if not batch.all_greedy or batch.want_logprobs:
            return None
        ids = [item.seq.request_id for item in out.scheduled]
        if prev.greedy is not None:
            if not self._can_graph(out):
                return None
            _, greedy, host, landed = self._graph_step(out, prev, keep)
            return StepHandle(out, ids, greedy=greedy, host=host, event=landed, chained=True)
        if prev.tokens is None:
            return None
        x, pos, meta, rows = self.prepare(out, next_ids=[prev.tokens[j] for j in keep])
        self.eager_steps += 1
        hidden = self.model(x, pos, self.kv_cache, meta, self.backend)
        tokens, _ = self.sampler(self.model.compute_logits(hidden[rows]), batch)
        return StepHandle(out, ids, tokens=tokens, chained=True)

    def collect(self, h: StepHandle) -> tuple[dict[str, int], dict[str, float]]:
        """``{request_id: token}`` and ``{request_id: logprob}`` of a launched step (waits
        for a device-side step to finish)."""
        tokens = h.tokens
        if tokens is None:
            h.event.synchronize()
            if h.rows is not None:
                every = h.host[:max(h.rows) + 1].tolist()
                tokens = [every[i] for i in h.rows]
            else:
                tokens = h.host[:len(h.sched.scheduled)].tolist()
        toks = dict(zip(h.sampled_ids, tokens))
        lps = dict(zip(h.sampled_ids, h.logprobs)) if h.logprobs is not None else {}
        return toks, lps

    def record_event(self, blocking: bool = True):
        """An event that completes when the work queued so far (this step's KV writes) is
        done; None on the CPU, where a step has finished when ``execute`` returns.
        ``blocking``: a host thread waiting on it sleeps instead of spinning (events only
        device streams wait on need not be)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=blocking)
        event.record()
        return event

    def bind_thread(self) -> None:
        """Make this runner's GPU the calling thread's current device. Streams, CUDA graphs,
        Triton launches and syncs use the current device, which is per thread: the engine
        thread of a worker on cuda:1 would otherwise launch on cuda:0."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def drop_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.graphs:
            self.table_rows.drop(request_id)
