"""Engine-internal request state: token ids, progress counters and a block table (ids only).

Lifecycle (colocated): WAITING -> RUNNING -> FINISHED, with RUNNING -> PREEMPTED(waiting again,
KV dropped, recomputed later) when KV blocks run out. A request is "prefilling" while
``num_computed_tokens < num_tokens - 1`` and "decoding" after that: the scheduler does not
distinguish the two; it only brings ``num_computed_tokens`` up to ``num_tokens``.

Disaggregated roles add two states around that:
- prefill role: after its first token is sampled the request is HELD: finished for the
  scheduler, but its blocks stay allocated until the KV transfer ends (``release``).
- decode role: a request is AWAITING_KV with blocks pre-allocated for the prompt until the
  transfer lands; then its prompt tokens count as computed and it joins the running batch.
"""
from __future__ import annotations

from enum import Enum
import itertools
import time

import numpy as np

from engine.request import FinishReason, SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    AWAITING_KV = "awaiting_kv"
    READY = "ready"  # its KV landed (decode role); waiting for a seat (max_num_seqs)
    HELD = "held"
    FINISHED = "finished"


_counter = itertools.count()


class Sequence:
    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "sampling", "status",
        "num_computed_tokens", "block_table", "num_cached_tokens", "arrival_time",
        "order", "block_hashes", "finish_reason", "logprobs", "prefill_only",
        "detok", "stop_text_len", "num_preemptions", "first_token_time", "report_progress",
        "num_hashed_blocks", "group_id", "sample_index", "top_logprobs", "_ids_np", "_ids_have",
        "matcher",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 prefill_only: bool = False, output_token_ids: list[int] = ()):
        """``output_token_ids``: tokens already generated for this request elsewhere (a
        request resumed after its worker died): they count as output, not prompt."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids) + list(output_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.order = next(_counter)  # FIFO tie-breaker, also the preemption priority
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of token_ids, in order
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[float] | None = [] if sampling.logprobs else None
        self.prefill_only = prefill_only
        self.detok = None  # engine.detokenizer.IncrementalDetokenizer, set by the engine
        self.stop_text_len: int | None = None
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.report_progress = False  # prefill role, streamed KV: report each finished chunk
        self.num_hashed_blocks = 0  # leading blocks the prefix cache has already looked at
        # sampling.n > 1: every sample is a Sequence; its outputs go out under the request's
        # id (``group_id``) with its ``sample_index`` (sample 0 is the request's own)
        self.group_id = request_id
        self.sample_index = 0
        self.top_logprobs: list | None = [] if sampling.top_logprobs else None
        self._ids_np: np.ndarray | None = None  # token_ids as int64, grown (token_array)
        self._ids_have = 0
        # sampling.constraint: an engine.grammar.Matcher at the end of token_ids (the engine
        # sets it and advances it over every token appended)
        self.matcher = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def token_array(self) -> np.ndarray:
        """``token_ids`` as an int64 array (penalties read it every step): extended by the
        tokens appended since the last call, not rebuilt (token ids are only appended)."""
        buf, n = self._ids_np, len(self.token_ids)
        have = self._ids_have
        if buf is None or n > len(buf):
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = self._ids_np = grown
        if n > have:
            buf[have:n] = self.token_ids[have:n]
        self._ids_have = n
        return buf[:n]

    @property
    def is_finished(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.HELD)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
