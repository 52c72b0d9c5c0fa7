"""Plain data about requests: what a caller asks for and what it gets back. No tensors here."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
import math
from typing import Any


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or transferred)
    held_block_ids: list[int] | None = None  # prefill role: the HELD blocks, in prompt order


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
