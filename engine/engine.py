"""LLMEngine: one scheduler, one block manager, one model runner, stepped by its owner.

Synchronous and single-threaded by design: an offline caller (``LLM``) loops over ``step()``;
a serving worker runs ``step()`` on one thread and talks to it through ``engine.async_engine``.

Roles: ``add_request(prefill_only=True)`` stops after the first token and HOLDS the blocks
until ``release`` (the KV transfer ended); ``preallocate`` + ``commit_transferred`` let a decode
worker receive a prompt's KV from elsewhere and continue from the first token.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
import logging
import time

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, check_runnable, resolve_engine_config
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarCompiler
from engine.model_runner import DTYPES, ModelRunner, StepHandle
from engine.request import FinishReason, PrefillProgress, RequestOutput, SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SeqStatus
from pdcore.block_hash import BlockHasher

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_awaiting_kv: int
    num_held: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    steps: int
    # model runs by path (cumulative): CUDA graphs for decode-only steps, CUDA graphs for
    # steps that mix decodes with short prompt chunks, eager (everything else, the CPU)
    graph_steps: int = 0
    mixed_graph_steps: int = 0
    eager_steps: int = 0
    chained_steps: int = 0  # steps launched before the one before was read (async_decode)
    # blocks with references that no request of the engine holds (a bookkeeping bug if > 0)
    kv_blocks_orphaned: int = 0
    # request id -> blocks it holds, for every request the engine knows (owners check it:
    # a request whose caller is gone holds stranded blocks)
    request_blocks: dict[str, int] = field(default_factory=dict)


def resolve_on_this_machine(config: EngineConfig) -> EngineConfig:
    """``config`` with its "auto" device, dtype and scheduler limits resolved for this machine
    (engine.config.resolve_engine_config); the KV cache size and max_model_len follow in the
    model runner."""
    cuda = torch.cuda.is_available()
    if config.device.startswith("cuda") and not cuda:
        raise ValueError(f"device {config.device!r}: no CUDA GPU is visible (device auto "
                         "runs on the CPU)")
    on_gpu = config.device.startswith("cuda") or (config.device == "auto" and cuda)
    checkpoint = None
    if config.dtype == "auto" and on_gpu:
        from engine.loader import checkpoint_dtype
        checkpoint = checkpoint_dtype(config.model)
    resolved = resolve_engine_config(config, cuda_available=cuda, checkpoint_dtype=checkpoint,
                                     bf16_supported=not on_gpu
                                     or torch.cuda.is_bf16_supported())
    from pdcore.config_tree import environ
    check_runnable(resolved, triton_interpreted=environ().get("TRITON_INTERPRET") == "1")
    return resolved


def check_tensor_parallel(config: EngineConfig) -> None:
    """ValueError when ``config`` (resolved) cannot run its tensor_parallel_size ranks here:
    too few GPUs from its device on, or a model whose heads do not split (read from the
    model's config, not its weights)."""
    from engine.loader import load_config
    from engine.parallel.plan import check_shardable

    n = config.tensor_parallel_size
    if config.device_kind == "cuda":
        first = int(config.device.split(":")[1]) if ":" in config.device else 0
        have = torch.cuda.device_count()
        if first + n > have:
            raise ValueError(f"tensor_parallel_size {n} from {config.device} needs GPUs "
                             f"cuda:{first}..{first + n - 1}; {have} visible")
    check_shardable(load_config(config.model), n)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None):
        """``config`` may hold "auto" values; ``self.config`` is the resolved tree (device,
        dtype, limits, KV cache size, max_model_len as this engine runs them)."""
        config = resolve_on_this_machine(config)
        tp = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("tensor_parallel_size > 1 loads the weights per rank: pass "
                                 "no preloaded model")
            check_tensor_parallel(config)  # before any rank starts
            from engine.parallel import TensorParallel  # starts the other ranks' processes
            tp = TensorParallel(config)
        if loaded is None:
            from engine.loader import load_model  # heavy: weights
            try:
                loaded = load_model(config.model, dtype=DTYPES[config.dtype],
                                    device=config.device, seed=config.seed,
                                    keep_packed=None if config.kernels.cpu_packed else False,
                                    shard=tp.plan if tp is not None else None)
            except BaseException:
                if tp is not None:
                    tp.close()
                raise
        self.model_id = loaded.model_id
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        torch.manual_seed(config.seed)
        try:
            self.runner = ModelRunner(config, loaded.config, loaded.weights,
                                      packed=getattr(loaded, "packed", None), tp=tp,
                                      prequantized=getattr(loaded, "prequantized", None),
                                      model_id=loaded.model_id)
        except BaseException:
            if tp is not None:
                tp.close()
            raise
        loaded.weights = None  # the runner owns the parameters now
        loaded.packed = None
        loaded.prequantized = None
        self.max_model_len = self.runner.max_model_len
        config = replace(config, cache=replace(config.cache, num_blocks=self.runner.num_blocks,
                                               kv_cache_memory_bytes=self.runner.kv_cache_bytes),
                         scheduler=replace(config.scheduler, max_model_len=self.max_model_len))
        self.config = self.runner.config = config
        bs = config.cache.block_size
        self.hasher = BlockHasher(config.cache.hash_seed, self.model_id, bs)
        self.block_manager = BlockManager(self.runner.num_blocks, bs, self.hasher,
                                          config.cache.enable_prefix_caching,
                                          block_runs=config.cache.kv_block_runs)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        eos = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.runner.eos_token_ids = self.eos_token_ids
        sc = config.structured  # structured output: grammars compiled on first use, cached
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.vocab_size,
                                        self.eos_token_ids, sc.grammar_cache_size,
                                        sc.grammar_max_size, sc.grammar_lexer_fuel)
        # sampling.n > 1: request id -> samples to fork once its prompt is computed, and
        # request id -> the ids of its forked samples still running (see _fork)
        self.forks: dict[str, int] = {}
        self.groups: dict[str, list[str]] = {}
        self.steps = 0
        self.stalled = False  # the last step found work but could run none (see step)
        self.num_preemptions = 0
        self.last_schedule: SchedulerOutput | None = None  # the last step's schedule
        # prefill role: chunks launched by requests added with report_progress, for the
        # owner to take after each step; with ``progress_sink`` set (AsyncEngine: hands them
        # to the request's caller at once) they go there instead, as soon as the chunk's
        # forward pass is queued, so its KV can move while it computes
        self.progress: list[PrefillProgress] = []
        self.progress_sink: Callable[[list[PrefillProgress]], None] | None = None
        # async_decode: a step launched before the previous one's tokens were read
        self._ahead: StepHandle | None = None
        self.chained_steps = 0  # steps launched ahead (their host work overlapped the device)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (idempotent)."""
        self.runner.close()

    @property
    def failure(self) -> str | None:
        """Why this engine cannot step any more (a tensor-parallel rank exited), else None."""
        return self.runner.tp.failure if self.runner.tp is not None else None

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The model's KV heads ``[start, end)`` that ``runner.kv_cache`` holds: all of them,
        except on GPUs under tensor parallelism (rank 0's own there)."""
        mc = self.model_config
        if self.runner.kv_cache.shape[4] == mc.num_kv_heads:
            return 0, mc.num_kv_heads
        return self.runner.tp.rank_plan.kv_heads

    # ------------------------------------------------------------ validation
    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams,
                 output_token_ids: list[int] = ()) -> None:
        """Raise ValueError with a readable message for a request this engine cannot serve.
        ``output_token_ids``: tokens a resumed request already generated (see Sequence)."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        for name, ids in (("prompt", prompt_token_ids), ("output", output_token_ids)):
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"{name} token id {bad[0]!r} is outside the vocabulary "
                                 f"[0, {vocab})")
        bad = next((t for t, _ in sampling.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        if len(output_token_ids) >= sampling.max_tokens:
            raise ValueError(f"{len(output_token_ids)} tokens were already generated; "
                             f"max_tokens is {sampling.max_tokens}")
        n = len(prompt_token_ids) + len(output_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the context limit is "
                             f"{self.max_model_len} (prompt + at least one new token)")
        need = -(-(n + 1) // self.block_manager.block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"prompt needs {need} KV blocks; this worker has "
                             f"{self.block_manager.num_blocks}")

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt)

    # ------------------------------------------------------------- requests
    def _new_seq(self, request_id, prompt_token_ids, sampling, prefill_only=False,
                 report_progress=False, output_token_ids=()) -> Sequence:
        self.validate(prompt_token_ids, sampling, output_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), sampling, prefill_only,
                       output_token_ids)
        seq.report_progress = report_progress and prefill_only
        seq.detok = IncrementalDetokenizer(self.tokenizer, sampling.stop)
        for tok in output_token_ids:  # a resumed request: the text so far was streamed
            seq.detok.add(tok)
        if sampling.constraint is not None:
            seq.matcher = self._matcher(sampling, output_token_ids)
        return seq

    def _matcher(self, sampling: SamplingParams, output_token_ids=()):
        """A matcher for ``sampling.constraint`` advanced over the tokens already generated
        (elsewhere: a resumed request), so generation continues inside the grammar.
        Compiling is cached (workers compile before adding, off their event loop);
        raises ValueError (engine.grammar.GrammarError) for a constraint that cannot be."""
        m = self.grammars.matcher(sampling.constraint)
        if not m.consume_all(output_token_ids):
            raise ValueError("the tokens already generated do not match the constraint")
        return m

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams, prefill_only: bool = False,
                    report_progress: bool = False, output_token_ids: list[int] = ()) -> None:
        """``report_progress`` (prefill role): for every prefill chunk, once its forward
        pass is queued, report a :class:`PrefillProgress` (see ``progress_sink``), so the KV
        of each chunk (layer by layer on a GPU) can be sent while the prompt computes.
        ``output_token_ids``: a request resumed on this worker after the one that served it
        failed; generation continues after them, as if uninterrupted."""
        seq = self._new_seq(request_id, prompt_token_ids, sampling, prefill_only,
                            report_progress, output_token_ids)
        self.scheduler.add(seq)
        if sampling.n > 1 and not prefill_only:  # a prefill worker samples sample 0 only
            self.forks[request_id] = sampling.n

    def preallocate(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams, output_token_ids: list[int] = ()
                    ) -> list[int] | None:
        """Decode role: reserve blocks for a prompt whose KV will arrive from a prefill worker.
        Returns the block ids (in order), or None when there are not enough free blocks."""
        seq = self._new_seq(request_id, prompt_token_ids, sampling,
                            output_token_ids=output_token_ids)
        n = -(-seq.num_tokens // self.block_manager.block_size)
        blocks = self.block_manager.allocate_blocks(n)
        if blocks is None:
            return None
        seq.block_table = blocks
        seq.status = SeqStatus.AWAITING_KV
        self.scheduler.add(seq)
        if sampling.n > 1:
            self.forks[request_id] = sampling.n
        return list(blocks)

    def commit_transferred(self, request_id: str, first_token: int,
                           first_logprob: float | None = None,
                           num_cached_tokens: int = 0, first_top_logprobs=None
                           ) -> RequestOutput:
        """Decode role: the prompt's KV has landed; continue from the prefill's first token
        (its logprob and top logprobs as the prefill worker computed them). With
        sampling.n > 1 the other samples fork over the landed prompt blocks here."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None or seq.status is not SeqStatus.AWAITING_KV:
            raise KeyError(f"request {request_id!r} is not awaiting KV")
        seq.num_computed_tokens = seq.num_tokens
        seq.num_cached_tokens = num_cached_tokens
        self.block_manager.cache_full_blocks(seq)
        self.scheduler.activate(seq)
        seq.token_ids.append(first_token)
        out = self._emit(seq, first_token, first_logprob, first_top_logprobs)
        return out

    def _fork(self, parent: Sequence, n: int) -> None:
        """Samples 1..n-1 of ``parent``'s request, once its prompt is computed: each shares
        the prompt's full blocks (one more reference each, through the block manager) up to
        the block holding the prompt's last token, computes the few tokens after them itself
        (its own blocks from there on) and samples its first token from its own stream. So a
        prompt is computed (or transferred) once for n samples."""
        ids = parent.prompt_token_ids
        keep = (len(ids) - 1) // self.block_manager.block_size
        children = self.groups.setdefault(parent.request_id, [])
        for i in range(1, n):
            child = Sequence(f"{parent.request_id}/{i}", ids, parent.sampling)
            child.group_id, child.sample_index = parent.request_id, i
            child.detok = IncrementalDetokenizer(self.tokenizer, parent.sampling.stop)
            if parent.sampling.constraint is not None:
                child.matcher = self._matcher(parent.sampling)
            child.order = parent.order  # the request's age, for scheduling and preemption
            self.block_manager.fork_prefix(parent, child, keep)
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.add(child, front=True)
            children.append(child.request_id)

    def abort(self, request_id: str) -> bool:
        """End a request (every sample of it) now and free its blocks."""
        self.forks.pop(request_id, None)
        for child in self.groups.pop(request_id, ()):
            self.scheduler.abort(child)
            self.runner.drop_request(child)
        seq = self.scheduler.abort(request_id)
        self.runner.drop_request(request_id)
        return seq is not None

    def release(self, request_id: str) -> bool:
        """Prefill role: the KV transfer of a HELD request ended; free its blocks."""
        self.runner.drop_request(request_id)
        return self.scheduler.release(request_id)

    def held_blocks(self, request_id: str) -> list[int]:
        seq = self.scheduler.requests[request_id]
        return list(seq.block_table)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._ahead is not None

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return this step's outputs (deltas).

        With ``async_decode``, when the next step cannot differ from this one (same running
        sequences, one token each, greedy, nothing waiting) it is launched before this one's
        tokens are read, so the device never waits for the host; the following call then
        returns the launched step's outputs without scheduling (see :meth:`_launch_ahead`).
        A launched step with logits processors (structured output's masks) is sampled at
        the start of that call, once the tokens its masks depend on were read."""
        if self._ahead is not None:
            handle, self._ahead = self._ahead, None
            self.runner.sample_pending(handle)  # its masks follow the tokens read last call
            self._ahead = self._launch_ahead(handle)
            return self._finish(handle)
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        resets = [PrefillProgress(rid, 0, [], reset=True) for rid in sched.preempted
                  if (seq := self.scheduler.requests.get(rid)) is not None
                  and seq.report_progress]
        if resets:
            self._report(resets)
        # work waits but nothing could run (blocks held for KV transfers, nothing running):
        # the caller waits for a command (a release, an abort) instead of stepping again
        self.stalled = not sched and not self.scheduler.running
        if not sched:
            return []
        reporting = [item for item in sched.scheduled if item.seq.report_progress]

        def queued(ready, layer_ready) -> None:  # the chunks' KV lands once these complete
            self._report([PrefillProgress(
                item.seq.request_id, item.seq.num_computed_tokens + item.num_new_tokens,
                list(item.seq.block_table), ready, layer_ready=layer_ready)
                for item in reporting])

        handle = self.runner.launch(sched, on_queued=queued if reporting else None)
        self._ahead = self._launch_ahead(handle)
        return self._finish(handle)

    def _report(self, items: list[PrefillProgress]) -> None:
        if self.progress_sink is not None:
            self.progress_sink(items)
        else:
            self.progress.extend(items)

    def _launch_ahead(self, prev: StepHandle) -> StepHandle | None:
        """Launch the step after ``prev`` now, before ``prev``'s tokens are read. Its rows:
        ``prev``'s sequences still running and below their length limit after ``prev``, each
        computing one token (its input is ``prev``'s token for it, still on the device; a
        row whose sequence ends in ``prev`` otherwise -- EOS, stop string, abort -- is
        computed and thrown away, and is left out of the step after); then the running
        sequences that joined since ``prev`` was scheduled with one token to compute (a
        decode worker's transferred prompts: their input token is on the host); then
        waiting requests whose whole prompt fits the step's token budget
        (Scheduler.admit_ahead). So neither a request ending nor one arriving costs the
        device a step's host time. ``prev``'s rows may be whole prompts (they sampled their
        first token): such a row continues past its prompt. Returns None (the next step is
        scheduled once ``prev`` is read) when a row of ``prev`` was a prompt chunk with more
        to come, a waiting request needs chunking, or blocks are short. Blocks freed
        meanwhile stay out of the free pool until the launched step is read, so no new
        owner's KV lands under its writes."""
        if not self.config.async_decode:
            return None
        items = prev.sched.scheduled
        sc = self.scheduler
        if not items or len(prev.sampled_ids) != len(items):
            return None
        keep: list[int] = []  # prev's rows that go on, by index in prev
        for j, item in enumerate(items):
            s = item.seq
            if s.status is not SeqStatus.RUNNING:
                continue  # ended when the step before prev was read
            if (not item.samples or s.prefill_only or s.report_progress
                    or s.num_tokens + 2 > self.max_model_len):
                return None  # a prompt chunk with more to come, or near the context
            if s.num_output_tokens + 1 >= s.sampling.max_tokens:
                continue  # prev computes its last token
            keep.append(j)
        on = [items[j] for j in keep]
        sc.seat_ready()  # landed KV takes the seats free now (seats of rows ending in prev
        # free once prev is read)
        joined: list = []  # running but not in prev (the rows kept are all running)
        if len(sc.running) != len(on):
            in_prev = {id(item.seq) for item in items}
            joined = [s for s in sc.running if id(s) not in in_prev]
        for s in joined:
            if (s.num_tokens - s.num_computed_tokens != 1 or s.prefill_only
                    or s.report_progress or s.num_tokens + 1 > self.max_model_len):
                return None
        if not self.runner.can_chain(prev, [item.seq for item in on] + joined):
            return None
        for item in on:  # the next position of each row (harmless if we stop here)
            if not self.block_manager.allocate_slots(item.seq, item.num_new_tokens + 1):
                return None
        for s in joined:
            if not self.block_manager.allocate_slots(s, 1):
                return None
        admitted: list[ScheduledSeq] = []
        if sc.waiting:
            budget = self.config.scheduler.max_num_batched_tokens - len(on) - len(joined)
            admitted, blocked = sc.admit_ahead(budget)
            if blocked and not admitted:
                return None
        if not on and not joined and not admitted:
            return None
        nxt = SchedulerOutput([ScheduledSeq(item.seq, 1, ahead=item.num_new_tokens)
                               for item in on]
                              + [ScheduledSeq(s, 1) for s in joined] + admitted)
        handle = self.runner.launch_next(nxt, prev, keep)
        self.block_manager.hold_frees()
        return handle

    def _finish(self, handle: StepHandle) -> list[RequestOutput]:
        """Read ``handle``'s tokens, advance the scheduler and build the outputs."""
        sched = handle.sched
        tokens, logprobs, tops = self.runner.collect(handle)
        if handle.chained:  # rows whose sequence ended since the launch are dropped
            self.chained_steps += 1
            sched.scheduled = [item for item in sched.scheduled
                               if item.seq.status is SeqStatus.RUNNING]
        self.last_schedule = sched  # what this step ran (tracing reads it; no copy made)
        self.scheduler.update(sched, tokens)
        self.steps += 1
        outs = []
        for item in sched.scheduled:
            seq = item.seq
            tok = tokens.get(seq.request_id)
            if tok is None:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            outs.append(self._emit(seq, tok, logprobs.get(seq.request_id),
                                   tops.get(seq.request_id)))
        # ``handle`` is read: what was freed while it was the latest step launched ahead is
        # safe now; what was freed since the step launched after it may still be written
        self.block_manager.release_held_frees(keep_latest=self._ahead is not None)
        return outs

    def _emit(self, seq: Sequence, tok: int, logprob: float | None,
              top: list | None = None) -> RequestOutput:
        """Record a newly appended token, check stop conditions, build the step output."""
        sp = seq.sampling
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        if seq.top_logprobs is not None and top is not None:
            seq.top_logprobs.append(top)
        n = self.forks.pop(seq.request_id, 0)
        if n:  # the prompt is computed: the other samples start from it
            self._fork(seq, n)
        delta, hit_stop = seq.detok.add(tok)
        reason = self._grammar_end(seq, tok)
        if hit_stop:
            reason = FinishReason.STOP
        elif reason is not None:
            pass
        elif tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None and not hit_stop:
            delta += seq.detok.flush()
        out = RequestOutput(
            request_id=seq.group_id, prompt_token_ids=[], token_ids=[tok], text=delta,
            logprobs=[logprob] if (sp.logprobs and logprob is not None) else None,
            top_logprobs=[top] if (sp.top_logprobs and top is not None) else None,
            index=seq.sample_index, num_cached_tokens=seq.num_cached_tokens)
        if reason is not None:
            out.finished = True
            out.finish_reason = reason
            self.scheduler.finish(seq, reason, hold=seq.prefill_only)
            if not seq.prefill_only:
                self.runner.drop_request(seq.request_id)
            if seq.group_id != seq.request_id:
                self._sample_done(seq)
        elif seq.prefill_only:
            # prefill role: one token, then hold the blocks for the KV transfer
            out.finished = True
            self.scheduler.finish(seq, FinishReason.LENGTH, hold=True)
        if seq.prefill_only:
            out.held_block_ids = list(seq.block_table)  # no extra engine round trip to ask
        return out

    @staticmethod
    def _grammar_end(seq: Sequence, tok: int) -> FinishReason | None:
        """Advance a constrained sequence's matcher over its new token: STOP once the grammar
        is complete (nothing but EOS may follow), ABORT if the token broke it (the mask
        should make that impossible; logged)."""
        m = seq.matcher
        if m is None:
            return None
        if not m.consume(tok):
            logger.error("request %s: token %d is outside its constraint's grammar: %s",
                         seq.request_id, tok, m.error[:200])
            return FinishReason.ABORT
        return FinishReason.STOP if m.done else None

    def _sample_done(self, seq: Sequence) -> None:
        children = self.groups.get(seq.group_id)
        if children is not None and seq.request_id in children:
            children.remove(seq.request_id)
            if not children:
                del self.groups[seq.group_id]

    # ----------------------------------------------------------------- stats
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced scoring (engine.evaluation): the log-probabilities [T, vocab]
        (float32, on the CPU) of the next token after each of ``token_ids``, computed by the
        engine's own model, KV cache and attention backend (prompt chunks of up to
        max_num_batched_tokens, each attending to the earlier ones through the cache). Runs
        between requests only; its blocks are freed (never prefix-cached) when it returns."""
        if self.has_work:
            raise RuntimeError("score() runs only while the engine has no requests")
        if not token_ids or len(token_ids) > self.max_model_len:
            raise ValueError(f"score() takes 1 to {self.max_model_len} tokens, "
                             f"got {len(token_ids)}")
        seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
        if not self.block_manager.allocate_slots(seq, len(token_ids)):
            raise ValueError("the KV cache cannot hold the scored text")
        chunk = self.config.scheduler.max_num_batched_tokens
        try:
            parts = []
            for start in range(0, len(token_ids), chunk):
                seq.num_computed_tokens = start
                n = min(chunk, len(token_ids) - start)
                parts.append(self.runner.score_logprobs(SchedulerOutput([ScheduledSeq(seq, n)])))
            return torch.cat(parts)
        finally:
            self.block_manager.free_seq(seq)

    def stats(self, detail: bool = False) -> EngineStats:
        """Counters (cheap: taken after every step by a serving worker); ``detail`` adds the
        block ownership audit (``kv_blocks_orphaned``, ``request_blocks``: a pass over every
        block)."""
        s = self.scheduler
        statuses = [q.status for q in s.requests.values()]
        bm = self.block_manager
        orphaned, per_request = 0, {}
        if detail:
            live = {b for q in s.requests.values() for b in q.block_table}
            orphaned = sum(1 for b in bm.blocks if b.ref_count > 0 and b.block_id not in live)
            for q in s.requests.values():  # a request's samples count under its id
                per_request[q.group_id] = per_request.get(q.group_id, 0) + len(q.block_table)
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(s.ready),
            num_awaiting_kv=statuses.count(SeqStatus.AWAITING_KV),
            num_held=statuses.count(SeqStatus.HELD),
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
            prefix_query_tokens=bm.prefix_queries_tokens, prefix_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=self.num_preemptions, steps=self.steps,
            graph_steps=self.runner.graph_steps, mixed_graph_steps=self.runner.mixed_graph_steps,
            eager_steps=self.runner.eager_steps, chained_steps=self.chained_steps,
            kv_blocks_orphaned=orphaned,
            request_blocks=per_request)
