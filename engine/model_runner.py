"""The only place that builds tensors: the model, the KV cache, step inputs, sampling
(with engine.cuda_graphs, the static inputs and replay of its CUDA graphs).

Takes a ``SchedulerOutput`` (ids and counts), turns it into flat input tensors and attention
metadata, runs the model and samples one token for every sequence whose chunk reached its end.
"""
from __future__ import annotations

from collections.abc import Callable
import logging

import numpy as np
import torch

from engine.config import CPU_KV_CACHE_BYTES, KV_QUANT_DTYPES, EngineConfig, ModelConfig
from engine.cuda_graphs import CudaGraphsMixin
from engine.kernels import triton_available as kernels_available
from engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from engine.layers.sampler import Sampler, SamplingBatch, masked_greedy, sample_seed
from engine.models.registry import model_class
from engine.scheduler import SchedulerOutput
from engine.sequence import SeqStatus
from engine.step_handle import StepHandle

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype,
                   row: int | None = None) -> int:
    """Bytes of one KV block; ``row``: elements per (token, head), head_dim unless the cache
    is quantized (engine.quant.kv: head_dim + 4)."""
    return mc.num_layers * 2 * block_size * mc.num_kv_heads * (row or mc.head_dim) * dtype.itemsize


def kv_layout_of(config: EngineConfig, mc: ModelConfig, model_dtype: torch.dtype
                 ) -> tuple[torch.dtype, int]:
    """(cache tensor dtype, elements per token and head) of the configured KV cache."""
    kd = config.cache.kv_dtype
    if kd in KV_QUANT_DTYPES:
        from engine.quant.kv import CODE_DTYPES, SCALE_BYTES
        return CODE_DTYPES[kd], mc.head_dim + SCALE_BYTES
    return (DTYPES[kd] if kd else model_dtype), mc.head_dim


def make_attention_backend(config: EngineConfig, mc: ModelConfig,
                           static_scales: torch.Tensor | None = None) -> AttentionBackend:
    """``static_scales``: a quantized cache's static scales (engine.quant.kv_scales), on the
    cache's device; None: dynamic."""
    scale = mc.head_dim ** -0.5
    want = config.attention_backend
    quantized = config.cache.kv_dtype in KV_QUANT_DTYPES  # int8 / fp8 codes + scales
    if want == "auto":  # a quantized cache too: its Triton kernels were measured on the
        # H200 (docs/quantization.md: 13x the torch path's batch-1 decode)
        want = "triton" if config.device.startswith("cuda") else "torch"
    if want == "triton":
        from engine.kernels.backend import TritonAttention  # GPU path
        # A/B measurements: kernels.fuse_rotary off: separate rotary and store_kv kernels;
        # kernels.split_mixed off: a mixed step's decode rows through the prefill kernel
        return TritonAttention(scale, fuse_rotary=config.kernels.fuse_rotary,
                               split_mixed=config.kernels.split_mixed, kv_quantized=quantized,
                               static_scales=static_scales)
    if quantized:
        from engine.quant.kv import CODE_DTYPES, QuantKVAttention
        return QuantKVAttention(scale, CODE_DTYPES[config.cache.kv_dtype], static_scales)
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


class ModelRunner(CudaGraphsMixin):
    """Model, KV cache and step execution (eager here; CUDA graphs in CudaGraphsMixin)."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, weights: dict[str, torch.Tensor],
                 packed: dict[str, tuple] | None = None, tp=None,
                 prequantized: dict[str, dict] | None = None, model_id: str = ""):
        """``config`` has its device, dtype and scheduler limits resolved
        (engine.config.resolve_engine_config); the KV cache size and ``max_model_len`` are
        resolved here (``num_blocks``, ``kv_cache_bytes``, ``max_model_len``). ``weights`` is
        consumed: the model's parameters take its values and the dict is emptied.
        ``tp`` (engine.parallel.TensorParallel): ``weights`` are rank 0's slices; the model
        is rank 0's shard behind a stand-in that drives the other ranks."""
        self.tp = tp
        self.model_id = model_id or config.model
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
        if tp is not None:  # takes the tensors out of ``weights`` as parameters
            self.model = tp.build(mc, weights, self.device, self.dtype)
        else:
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with torch.device(self.device):
                    self.model = model_class(mc)(mc)
            finally:
                torch.set_default_dtype(prev)
            self.model.load_weights(weights)
        # the parameters hold copies: drop the loaded tensors now, before the KV cache is
        # sized from free memory (on a GPU they would otherwise stay reserved, a second copy
        # of the weights that neither the profile nor the KV budget sees)
        weights.clear()
        self.model.eval()
        self.quantization = self._quantize_weights(weights, prequantized)
        self.packed_projections = 0
        if (packed and tp is None and config.kernels.cpu_packed and not self.quantization
                and self.device.type == "cpu"
                and self.dtype == torch.float32 and hasattr(self.model, "load_packed")):
            # decode (<= 8 tokens per step) reads GGUF Q4_1 / Q8_0 blocks instead of fp32
            # (kernels.cpu_packed); builds the C++ extension on first use
            from engine.kernels import cpu_quant
            if cpu_quant.available():
                self.packed_projections = self.model.load_packed(packed)
                logger.info("CPU packed GEMV: %d projections read GGUF blocks",
                            self.packed_projections)
        self.kv_static_scales = self._static_kv_scales()
        self.backend = make_attention_backend(config, mc, self.kv_static_scales)
        self.shared_gen = torch.Generator(device=self.device)
        self.shared_gen.manual_seed(config.seed)
        self.sampler = Sampler(self.shared_gen)
        # masked greedy graph steps take their constrained rows' tokens in one kernel
        self._triton = self.device.type == "cuda" and kernels_available()
        self.generators: dict[str, torch.Generator] = {}
        self.eos_token_ids: frozenset[int] = frozenset(mc.eos_token_ids)  # min_tokens masks
        self.graphs: dict[int, tuple] = {}
        self.mixed_graphs: dict[tuple[int, int], tuple] = {}
        self.mixed_tokens: list[int] = []
        # steps by path (engine stats, pdserve_engine_steps_total{path})
        self.graph_steps = 0  # decode-only CUDA graphs
        self.mixed_graph_steps = 0  # mixed-step CUDA graphs
        self.eager_steps = 0
        self.gemv_tuning: dict = {}
        gpu_kernels = self.device.type == "cuda" and self.backend.name == "triton"
        if gpu_kernels:
            self.model.enable_fused_ops(True)
        self._make_kv_cache()
        if gpu_kernels:
            kc = config.kernels
            if hasattr(self.model, "set_gemv_plan"):
                # one-token projections: Triton GEMV (float or quantized weights) or the
                # module's own path, timed per shape once per process (kernels.gemv:
                # off|auto|force)
                from engine.kernels.gemv_tune import tune_gemv_plan
                plan, self.gemv_tuning = tune_gemv_plan(self.model, kc.gemv, pdl=kc.gemv_pdl,
                                                        split_k=kc.gemv_split_k)
                self.model.set_gemv_plan(plan)
            if not config.enforce_eager:
                self._capture_graphs()

    def _quantize_weights(self, weights: dict, prequantized: dict | None) -> dict | None:
        """quantization / quantization_plan, or a pre-quantized checkpoint's projections:
        swap them for QuantLinear modules (engine.quant); the summary (projections per
        format, weight bytes), or None."""
        from engine.quant.plan import plan_for
        plan = plan_for(self.config.quantization, self.config.quantization_plan)
        if self.config.quantized_weights:
            if prequantized:
                raise ValueError("the checkpoint is already quantized (quantization_config "
                                 "in its config.json): leave quantized_weights unset")
            from engine.quant.calibrated import apply_file
            weights.clear()
            return apply_file(self.model, self.config.quantized_weights, self.model_id)
        if self.tp is not None and (plan is not None or prequantized
                                    or self.config.cache.kv_dtype in KV_QUANT_DTYPES):
            raise ValueError("quantized weights or KV cache with tensor parallelism are not "
                             "supported yet (issue 26): use tensor_parallel_size 1")
        if prequantized:
            if plan is not None:
                raise ValueError("the checkpoint is already quantized (quantization_config "
                                 "in its config.json): leave quantization none")
            from engine.quant import quantize_loaded
            weights.clear()
            return quantize_loaded(self.model, prequantized)
        if plan is None:
            return None
        from engine.quant import quantize_model
        plan.check_model(self.mc.num_layers)
        weights.clear()  # the float copies the loader handed over: free them first
        return quantize_model(self.model, plan)

    def _static_kv_scales(self) -> torch.Tensor | None:
        """kv_scales checkpoint / FILE: the quantized cache's static scales on this device
        (engine.quant.kv_scales); None for dynamic scales or a float cache."""
        cc = self.config.cache
        if cc.kv_scales == "dynamic" or cc.kv_dtype not in KV_QUANT_DTYPES:
            return None
        from engine.quant.kv import CODE_DTYPES
        from engine.quant.kv_scales import load_static_scales
        scales = load_static_scales(cc.kv_scales, self.config.model, self.mc, self.model_id,
                                    CODE_DTYPES[cc.kv_dtype])
        return scales.to(self.device)

    def _make_kv_cache(self) -> None:
        """Size (see :meth:`_num_kv_blocks`) and allocate the KV cache; cap max_model_len by
        what it holds."""
        mc, cc, sc = self.mc, self.config.cache, self.config.scheduler
        self.kv_dtype, self.kv_row = kv_layout_of(self.config, mc, self.dtype)
        bb = kv_block_bytes(mc, self.block_size, self.kv_dtype, self.kv_row)
        if self.tp is not None:  # GPU: each rank stores its heads' share of a block
            bb = max(1, int(bb * self.tp.cache_fraction(self.device)))
        self.num_blocks = self._num_kv_blocks(bb)
        self.kv_cache_bytes = self.num_blocks * bb
        limit = min(sc.max_model_len or mc.max_position, mc.max_position)
        held = self.num_blocks * self.block_size
        if limit > held:
            if sc.max_model_len:
                logger.warning("max_model_len %d capped to %d: the KV cache holds %d tokens",
                               sc.max_model_len, held, held)
            limit = held
        self.max_model_len = limit
        shape = (self.num_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads, self.kv_row)
        if self.tp is not None:  # shared with the other ranks (engine.parallel.driver)
            self.kv_cache = self.tp.kv_cache(shape, self.kv_dtype, self.device)
        else:
            self.kv_cache = _zeros(shape, self.kv_dtype, self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); max_model_len %d",
                    self.num_blocks, self.block_size, self.kv_cache_bytes / 2**20, limit)

    def _num_kv_blocks(self, block_bytes: int) -> int:
        """cache.num_blocks, else cache.kv_cache_memory_bytes, else on a GPU what
        gpu_memory_utilization leaves after a profiling step (engine.kv_memory), but no more
        than max_num_seqs sequences of max_model_len tokens can use (a small model on a large
        GPU), else (CPU) engine.config.CPU_KV_CACHE_BYTES."""
        cc, sc, mc = self.config.cache, self.config.scheduler, self.mc
        if cc.num_blocks:
            return cc.num_blocks
        if cc.kv_cache_memory_bytes:
            return max(1, cc.kv_cache_memory_bytes // block_bytes)
        if self.device.type != "cuda":
            return max(1, CPU_KV_CACHE_BYTES // block_bytes)
        from engine.kv_memory import gpu_kv_cache_bytes
        budget = gpu_kv_cache_bytes(self, sc.max_num_batched_tokens, sc.max_num_seqs,
                                    mc.max_position, cc.gpu_memory_utilization)
        if budget < block_bytes:
            raise ValueError(
                f"gpu_memory_utilization {cc.gpu_memory_utilization:g} leaves no room for a KV "
                f"cache on {self.device} after the weights and activations: raise it, or set "
                "kv_cache_memory_bytes")
        max_len = min(sc.max_model_len or mc.max_position, mc.max_position)
        usable = sc.max_num_seqs * -(-max_len // self.block_size)
        if budget // block_bytes > usable:
            logger.info("KV cache: %d blocks would fit; %d sequences of %d tokens use %d",
                        budget // block_bytes, sc.max_num_seqs, max_len, usable)
        return min(budget // block_bytes, usable)

    # ---------------------------------------------------------------- inputs
    def prepare(self, out: SchedulerOutput, next_ids: list[int] | None = None):
        """Flat inputs for ``out``. Each row starts at num_computed_tokens + ahead
        (ScheduledSeq.ahead). With ``next_ids`` (a chained launch) row i < len(next_ids)
        (one token) has input token next_ids[i]; later rows take their tokens from the
        sequence (joined since, or admitted).

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
            start = s.num_computed_tokens + item.ahead
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
        dev = self._to_device
        meta = AttentionMetadata(
            slot_mapping=dev(slots, torch.int64),
            block_tables=dev([t + [0] * (width - len(t)) for t in tables], torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            query_start_loc=dev(qsl, torch.int32),
            seq_lens_list=seq_lens, query_lens_list=qlens,
            max_seq_len=max(seq_lens), max_query_len=max(qlens))
        if num_decode:
            nd, t0 = num_decode, qsl[num_decode]
            rest_qsl = [x - t0 for x in qsl[nd:]]
            meta.num_decode = nd
            meta.rest = AttentionMetadata(
                slot_mapping=meta.slot_mapping[t0:], block_tables=meta.block_tables[nd:],
                seq_lens=meta.seq_lens[nd:],
                query_start_loc=dev(rest_qsl, torch.int32),
                seq_lens_list=seq_lens[nd:], query_lens_list=qlens[nd:],
                max_seq_len=max(seq_lens[nd:]), max_query_len=max(qlens[nd:]))
        ids = dev(input_ids, torch.int64)
        pos = dev(positions, torch.int64)
        return ids, pos, meta, sample_rows

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on the runner's device. On a GPU through pinned memory
        and a non-blocking copy: a plain ``torch.tensor(..., device=cuda)`` waits for the
        stream, so a step launched ahead would wait for the one before it to finish (the
        caching host allocator keeps the pinned block until its copy has run)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _sampling_batch(self, out: SchedulerOutput, every_row: bool = False) -> SamplingBatch:
        seqs, gens, counters = [], [], []
        for item in out.scheduled:
            if not (every_row or item.samples):
                continue
            s = item.seq
            sp = s.sampling
            g = c = None
            if sp.seed is not None and sp.temperature > 0:
                if self._triton:  # a GPU: the counter-based RNG, all seeded rows at once
                    c = (sample_seed(sp.seed, s.sample_index), s.num_output_tokens)
                else:
                    g = self.generators.get(s.request_id)
                    if g is None:
                        g = self._seeded_generator(sample_seed(sp.seed, s.sample_index),
                                                   s.num_output_tokens)
                        self.generators[s.request_id] = g
            seqs.append(s)
            gens.append(g)
            counters.append(c)
        return SamplingBatch.from_seqs(seqs, gens, self.eos_token_ids,
                                       counters if self._triton else None)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, out: SchedulerOutput,
                sampled: list[str]) -> StepHandle:
        """Sample a step's rows. A plain batch (argmax, nothing else asked) is read at once,
        as before; any other on a GPU stays queued: its results reach pinned host memory
        behind an event that :meth:`collect` waits for (no host sync at launch)."""
        res = self.sampler(logits, batch)
        if batch.plain or self.device.type != "cuda":
            tokens, lps, tops = res.to_host()
            return StepHandle(out, sampled, tokens=tokens, logprobs=lps, top_logprobs=tops)
        return self._queue_copy(StepHandle(out, sampled), res)

    @staticmethod
    def _queue_copy(h: StepHandle, res) -> StepHandle:
        """``h`` reads ``res`` through pinned host copies (a GPU's; on the CPU at once); with
        every row of its step sampled, the tokens also stay on the device (``h.greedy``) for
        a step launched after it (launch_next) to take as input, without waiting for them."""
        if len(h.sampled_ids) == len(h.sched.scheduled):
            h.greedy = res.tokens
        res.start_copy()
        h.sample = res
        return h

    def sample_pending(self, h: StepHandle) -> None:
        """Sample a chained step launched with its sampling left for later (``h.pending``),
        once the engine has read the step before it: each row's processors then see its
        state after that step's token (its grammar matcher has consumed it, penalties and
        min_tokens count it), as in lockstep. Rows whose request ended meanwhile are thrown
        away by the engine; they are not masked (their matcher may be done or broken)."""
        logits, h.pending = h.pending, None
        greedy, h.pending_greedy = h.pending_greedy, None
        if logits is None:
            return
        batch = self._sampling_batch(h.sched, every_row=True)
        items = h.sched.scheduled
        batch.masks = [(i, m) for i, m in batch.masks
                       if items[i].seq.status is SeqStatus.RUNNING]
        if greedy is not None and batch.masks_only and self._triton:
            # (a graph step: its argmax is there, the free rows keep it; the next replay,
            # which rewrites it, is launched after this)
            res = masked_greedy(logits, greedy, batch)
        else:
            res = self.sampler(logits, batch)
        if self.device.type != "cuda":
            h.tokens, h.logprobs, h.top_logprobs = res.to_host()
        else:
            self._queue_copy(h, res)

    def _seeded_generator(self, seed: int, drawn: int) -> torch.Generator:
        """A request's generator, as it is after its first ``drawn`` samples: a request whose
        earlier tokens were sampled elsewhere (the prefill worker sampled the first one; a
        resumed request, more) continues the same random stream, so a seed gives the same
        tokens colocated, disaggregated and after a migration. Each sample draws one
        exponential per vocabulary entry (layers.sampler), so they are drawn again here."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        if drawn:
            scratch = torch.empty(self.mc.vocab_size, device=self.device)
            for _ in range(drawn):
                scratch.exponential_(generator=g)
        return g

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
        launched = None  # a graph step: (logits, greedy, host copy, its event, rows)
        if self._can_graph(out):
            rows = None  # graph row i is scheduled item i; None: every item samples
            if len(sampled) < len(out.scheduled):
                rows = [i for i, item in enumerate(out.scheduled) if item.samples]
            launched = (*self._graph_step(out), rows)
        elif (plan := self._mixed_plan(out)) is not None:
            launched = self._mixed_step(out, plan)
        if launched is not None:
            logits, greedy, host, landed, rows = launched
            if on_queued is not None:
                on_queued(self.record_event(), None)
            if not sampled:
                return StepHandle(out, [], tokens=[])
            batch = self._sampling_batch(out)
            if batch.plain:
                return StepHandle(out, sampled, rows=rows, greedy=greedy, host=host,
                                  event=landed)
            return self._sample(logits if rows is None else logits[rows], batch, out, sampled)
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
        return self._sample(logits, self._sampling_batch(out), out, sampled)

    def can_chain(self, prev: StepHandle, seqs) -> bool:
        """Whether a step can be launched after ``prev`` before prev's tokens are read
        (``async_decode``), with ``seqs`` (prev's rows that go on, and those joined since)
        among its rows: every row of prev sampled (its tokens are known on the device or
        the host, no sampling left to do). The next step's rows may ask for anything: a
        step that is not a plain argmax is sampled once prev is read (``pending``). Not
        after a mixed-graph step (``rows`` set): see :meth:`launch_next`."""
        return (bool(self.config.async_decode) and prev.pending is None and prev.rows is None
                and (prev.greedy is not None or prev.tokens is not None)
                and len(prev.sampled_ids) == len(prev.sched.scheduled))

    @torch.inference_mode()
    def launch_next(self, out: SchedulerOutput, prev: StepHandle,
                    keep: list[int]) -> StepHandle:
        """Launch the step after ``prev`` before prev's tokens are read (``async_decode``;
        the engine checked :meth:`can_chain` and built ``out``, Engine._launch_ahead).

        ``out``'s first rows continue prev's rows ``keep`` (by index in prev), one token each
        from position num_computed_tokens + ahead; row i's input is the token prev sampled
        for its row keep[i]. Then sequences that joined since (one token, their input on the
        host), then admitted prompts (whole). A decode-only step replays a decode graph,
        any other runs eagerly; on a GPU prev's tokens stay on the device throughout. A
        step that is not a plain argmax (a grammar's mask, penalties, logit_bias,
        min_tokens, a sampled row, logprobs) is left unsampled (``pending``): the engine
        samples it with :meth:`sample_pending` once prev is read, while its forward pass
        runs, so each row's processors and random stream are where lockstep has them.
        Plainness is decided from the settings alone: a sampling batch built now would
        create a seeded request's generator before its draw in prev."""
        plain = all(item.seq.sampling.argmax_only and item.seq.sampling.plain
                    for item in out.scheduled)
        ids = [item.seq.request_id for item in out.scheduled]
        src = None  # the chained rows' input tokens, on the device (a GPU's stay there)
        if keep and prev.greedy is not None:
            src = prev.greedy
            if keep != list(range(len(src))):  # rows that ended are left out: gather
                src = self._rows_of(src, keep)  # on the device, no sync
        elif keep:  # read already (an eager step sampled on the host): copy them over
            src = self._to_device([prev.tokens[j] for j in keep], torch.int64)
        if self._can_graph(out):
            logits, greedy, host, landed = self._graph_step(out, src)
            if not plain:
                return StepHandle(out, ids, chained=True, pending=logits,
                                  pending_greedy=greedy)
            return StepHandle(out, ids, greedy=greedy, host=host, event=landed, chained=True)
        # prompts, a long context, or no graphs: eagerly. Not through the mixed graphs:
        # chained into them, a served 8B model at 512 rows hit a device-side index assert
        # (2026-12-04, not found yet); a lockstep mixed step still uses them
        x, pos, meta, sample_rows = self.prepare(
            out, next_ids=None if src is None else [0] * len(src))
        if src is not None:  # the chained rows are the first tokens (prepare)
            x[:len(src)].copy_(src)
        self.eager_steps += 1
        hidden = self.model(x, pos, self.kv_cache, meta, self.backend)
        logits = self.model.compute_logits(self._rows_of(hidden, sample_rows))
        if not plain:
            return StepHandle(out, ids, chained=True, pending=logits)
        return self._queue_copy(StepHandle(out, ids, chained=True), self.sampler(
            logits, self._sampling_batch(out, every_row=True)))

    def _rows_of(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``t[rows]`` without a host sync on a GPU (the index goes through pinned memory)."""
        return t.index_select(0, self._to_device(rows, torch.int64))

    @torch.inference_mode()
    def score_logprobs(self, out: SchedulerOutput) -> torch.Tensor:
        """One eager step of ``out`` returning the log-softmax of every row's next-token
        logits (float32, CPU) instead of sampling (LLMEngine.score)."""
        ids, pos, meta, _ = self.prepare(out)
        self.eager_steps += 1
        hidden = self.model(ids, pos, self.kv_cache, meta, self.backend)
        return self.model.compute_logits(hidden).float().log_softmax(-1).cpu()

    def collect(self, h: StepHandle) -> tuple[dict[str, int], dict[str, float], dict]:
        """``{request_id: token}``, ``{request_id: logprob}`` and ``{request_id: top
        logprobs}`` of a launched step (waits for a device-side step to finish)."""
        self.sample_pending(h)  # (the engine samples a chained step before it reads it)
        if h.sample is not None:
            h.tokens, h.logprobs, h.top_logprobs = h.sample.to_host()
            h.sample = None
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
        tops = {rid: t for rid, t in zip(h.sampled_ids, h.top_logprobs) if t is not None} \
            if h.top_logprobs is not None else {}
        return toks, lps, tops

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

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        if self.tp is not None:
            self.tp.close()

    def drop_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.graphs:
            self.table_rows.drop(request_id)
