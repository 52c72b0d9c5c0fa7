"""Plain data about requests: what a caller asks for and what it gets back. No tensors here."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
import math
from typing import Any


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class Constraint:
    """Structured output (engine.grammar): the answer must match ``text`` read as ``kind``:
    a JSON Schema (as JSON text), any JSON object (no text), a regular expression, or a
    grammar (Lark, or llama.cpp's GBNF)."""
    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.text, str) or (not self.text and self.kind != "json_object"):
            raise ValueError(f"a {self.kind} constraint needs its text")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the logprob of each chosen token
    # Controls applied to the logits in this order (engine.layers.sampler): logit_bias,
    # min_tokens (EOS and stop_token_ids masked), repetition penalty, frequency and presence
    # penalties, the constraint's token mask; logprobs are those of the distribution after
    # them, before temperature; then temperature, top_k, top_p, min_p and the draw.
    presence_penalty: float = 0.0  # OpenAI: -= presence * (count > 0), over the output tokens
    frequency_penalty: float = 0.0  # OpenAI: -= frequency * count, over the output tokens
    repetition_penalty: float = 1.0  # Keskar et al. over prompt + output tokens; 1 = off
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    top_logprobs: int = 0  # also return the N most likely tokens (and logprobs) per step
    n: int = 1  # parallel samples of the prompt (sharing its KV blocks)
    # structured output: tokens the constraint's grammar does not allow next are masked,
    # and the answer stops ("stop") once the grammar is complete
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted(
            (t, float(v)) for t, v in items)))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disables), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise ValueError("repetition_penalty must be in (0, 10] (1 disables), got "
                             f"{self.repetition_penalty!r}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for t, v in self.logit_bias:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
            if not (math.isfinite(v) and -100.0 <= v <= 100.0):
                raise ValueError(f"logit_bias of token {t} must be in [-100, 100], got {v!r}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        for name in ("min_tokens", "top_logprobs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is larger than max_tokens "
                             f"({self.max_tokens})")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError("constraint must be an engine.request.Constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Its token is an argmax (of the logits as processed) and nothing else is asked for
        (engine.layers.sampler.SamplingBatch.argmax_only, for one request)."""
        return self.greedy and not self.logprobs and not self.top_logprobs

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """Nothing but temperature / top-k / top-p: a greedy plain request is an argmax of
        the raw logits (the CUDA-graph fast path)."""
        return not (self.penalized or self.logit_bias or self.min_tokens or self.min_p
                    or self.top_logprobs or self.constraint is not None)


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, stop string or stop token id
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller or the server


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a caller gets for one request (final) or one step (incremental)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids (all so far, or this step's)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    # sampling.top_logprobs > 0: per token, the N most likely (token id, logprob), best first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    index: int = 0  # which of the request's sampling.n samples this output continues
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or transferred)
    held_block_ids: list[int] | None = None  # prefill role: the HELD blocks, in prompt order
    # LLM.generate with sampling.n > 1: every sample (index order); the fields above are
    # sample 0's
    samples: list["RequestOutput"] | None = None


@dataclass
class PrefillProgress:
    """Prefill role with streamed KV: a prefill chunk was launched (the last one too; it is
    reported before the request's RequestOutput). The prompt's first ``num_computed_tokens``
    tokens have their KV in ``block_ids`` (the block table so far) once ``ready`` completes:
    a device event recorded right after the chunk's forward pass was queued (``query()``),
    None when the step already finished (CPU). ``layer_ready`` (GPU): one event per model
    layer, completing once that layer's KV of the chunk is written, so a sender can move a
    layer while later layers still compute. ``reset``: the request was preempted, its blocks
    were freed and earlier progress is void (whoever reads them must give up)."""

    request_id: str
    num_computed_tokens: int
    block_ids: list[int]
    ready: Any = None
    reset: bool = False
    layer_ready: list[Any] | None = None
