"""Frozen configuration dataclasses. They only validate; reading env, flags and files happens
in one factory per service (services/config.py) and in engine/loader for model files."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2)."""

    arch: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict (only {"rope_type": "llama3", ...} is interpreted), as a tuple
    # of (key, value) pairs so the dataclass stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    sliding_window: int | None = None  # Mistral v0.1; recorded, not enforced (see README)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported architecture {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derive from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    hash_seed: str = "pdserve-v1"
    kv_dtype: str | None = None  # None: same as the model dtype

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # cap on running requests
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill splits above it)
    max_model_len: int = 4096
    # order of admission from the waiting queue: "fcfs" (arrival order) or "short_first" (the
    # fewest tokens left to compute first, so short prompts do not queue behind long ones;
    # a request waiting longer than max_wait_s goes before every newer one: no starvation)
    policy: str = "fcfs"
    max_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 1:
            raise ValueError("scheduler limits must be positive")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")


POLICIES = ("fcfs", "short_first")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "auto"  # auto | torch | triton
    enforce_eager: bool = False  # GPU: disable CUDA graphs
    # GPU with CUDA graphs: mixed steps (decode rows plus chunks of up to this many prompt
    # tokens in all, from at most 8 sequences) replay captured graphs (engine.cuda_graphs);
    # 0: such steps run eagerly
    mixed_graph_tokens: int = 512
    num_threads: int | None = None  # CPU: torch intra-op threads
    # Launch the next decode step before reading this one's tokens when the batch cannot
    # change (engine.engine.LLMEngine.step): hides host work behind the GPU's (the gain is in
    # docs/performance.md). None: on with
    # CUDA graphs (cuda, not enforce_eager), off otherwise; works without a speed-up on the CPU.
    async_decode: bool | None = None

    def __post_init__(self) -> None:
        if self.async_decode is None:
            object.__setattr__(self, "async_decode",  # frozen: resolved once, here
                               self.device.startswith("cuda") and not self.enforce_eager)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.mixed_graph_tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be >= 0, got {self.mixed_graph_tokens}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
