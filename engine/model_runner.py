"""The only place that builds tensors: the model, the KV cache, step inputs, sampling.

Takes a ``SchedulerOutput`` (ids and counts), turns it into flat input tensors and attention
metadata, runs the model and samples one token for every sequence whose chunk reached its end.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from engine.layers.sampler import Sampler, SamplingBatch
from engine.models.registry import model_class
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return mc.num_layers * 2 * block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize


def make_attention_backend(config: EngineConfig, mc: ModelConfig) -> AttentionBackend:
    scale = mc.head_dim ** -0.5
    want = config.attention_backend
    if want == "auto":
        want = "triton" if config.device.startswith("cuda") else "torch"
    if want == "triton":
        from engine.kernels.backend import TritonAttention  # GPU path
        # PDSERVE_FUSE_ROTARY=0: separate rotary and store_kv kernels (A/B measurements)
        return TritonAttention(scale, fuse_rotary=os.environ.get("PDSERVE_FUSE_ROTARY") != "0")
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


class ModelRunner:
    def __init__(self, config: EngineConfig, mc: ModelConfig, weights: dict[str, torch.Tensor],
                 packed: dict[str, tuple] | None = None):
        self.config = config
        self.mc = mc
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            # streams, CUDA graphs, Triton launches and syncs use the CURRENT device: make it
            # ours (a worker on cuda:1 still sees cuda:0, e.g. for CUDA IPC peers)
            torch.cuda.set_device(self.device)
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
        self.h_i64 = torch.zeros(3, mb, dtype=torch.int64).pin_memory()
        self.h_i32 = torch.zeros(mb + mb * width, dtype=torch.int32).pin_memory()
        self.h_i64_np = self.h_i64.numpy()
        self.h_i32_np = self.h_i32.numpy()
        self.g_i64[2].fill_(-1)
        qsl = torch.arange(mb + 1, dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
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

            with torch.inference_mode():
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run()  # compile kernels, create handles
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    logits, greedy = run()
            self.graphs[b] = (g, logits, greedy)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %s, table width %d)",
                    len(self.graphs), self.graph_buckets, width)

    def _graph_step(self, out: SchedulerOutput):
        """Fill the static buffers for a decode-only step and replay its bucket's graph.
        Returns (logits [n, V], greedy [n]) views for the n scheduled rows."""
        n = len(out.scheduled)
        b = next(x for x in self.graph_buckets if x >= n)
        mb = self.graph_buckets[-1]
        bs = self.block_size
        h64, h32 = self.h_i64_np, self.h_i32_np
        tables = h32[mb:].reshape(mb, self.graph_width)
        tables[:b] = 0
        h64[2, :b] = -1
        h32[:b] = 0
        for i, item in enumerate(out.scheduled):
            s = item.seq
            p = s.num_computed_tokens
            bt = s.block_table
            h64[0, i] = s.token_ids[p]
            h64[1, i] = p
            h64[2, i] = bt[p // bs] * bs + p % bs
            h32[i] = p + 1
            tables[i, :len(bt)] = bt
        self.g_i64[:, :b].copy_(self.h_i64[:, :b], non_blocking=True)
        self.g_i32[:b].copy_(self.h_i32[:b], non_blocking=True)
        w = self.graph_width
        self.g_i32[mb:mb + b * w].copy_(self.h_i32[mb:mb + b * w], non_blocking=True)
        g, logits, greedy = self.graphs[b]
        g.replay()
        return logits[:n], greedy[:n]

    def _can_graph(self, out: SchedulerOutput) -> bool:
        if not self.graphs or len(out.scheduled) > self.graph_buckets[-1]:
            return False
        return all(item.num_new_tokens == 1 and len(item.seq.block_table) <= self.graph_width
                   for item in out.scheduled)

    # ---------------------------------------------------------------- inputs
    def prepare(self, out: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        qlens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for item in out.scheduled:
            s = item.seq
            start = s.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(s.token_ids[start:end])
            positions.extend(range(start, end))
            bt = s.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + item.num_new_tokens)
            seq_lens.append(end)
            qlens.append(item.num_new_tokens)
            tables.append(bt)
            if item.samples:
                sample_rows.append(qsl[-1] - 1)
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
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, sample_rows

    def _sampling_batch(self, out: SchedulerOutput) -> SamplingBatch:
        temps, ks, ps, gens = [], [], [], []
        want_lp = False
        for item in out.scheduled:
            if not item.samples:
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
    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, float]]:
        """Run one step; returns ``{request_id: token}`` and ``{request_id: logprob}``."""
        if self._can_graph(out):
            logits, greedy = self._graph_step(out)
            rows = [i for i, item in enumerate(out.scheduled) if item.samples]
            if not rows:
                torch.cuda.current_stream().synchronize()  # the pinned inputs get reused
                return {}, {}
            batch = self._sampling_batch(out)
            if len(rows) < len(out.scheduled):
                logits, greedy = logits[rows], greedy[rows]
            if batch.all_greedy and not batch.want_logprobs:
                tokens, logprobs = greedy.tolist(), None  # the step's one host sync
            else:
                tokens, logprobs = self.sampler(logits, batch)
        else:
            ids, pos, meta, rows = self.prepare(out)
            hidden = self.model(ids, pos, self.kv_cache, meta, self.backend)
            if not rows:
                return {}, {}
            logits = self.model.compute_logits(hidden[rows])
            tokens, logprobs = self.sampler(logits, self._sampling_batch(out))
        sampled_ids = [item.seq.request_id for item in out.scheduled if item.samples]
        toks = dict(zip(sampled_ids, tokens))
        lps = dict(zip(sampled_ids, logprobs)) if logprobs is not None else {}
        return toks, lps

    def record_event(self):
        """An event that completes when the work queued so far (this step's KV writes) is
        done; None on the CPU, where a step has finished when ``execute`` returns."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)  # a waiter sleeps instead of spinning
        event.record()
        return event

    def drop_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
