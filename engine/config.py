"""Frozen configuration dataclasses of the engine. They only validate: reading flags, files and
the environment happens in one builder per entry point (services/config.py, which also holds
the service settings; docs/configuration.md is generated from both).

Every user-facing field is declared with :func:`setting` (a help line, a type from its
annotation, a range) or :func:`section` (a nested group). Names are flat and unique across the
tree, so one rule names a field everywhere: ``max_num_seqs`` is ``LLM(max_num_seqs=...)``,
``--max-num-seqs`` and ``PDSERVE_MAX_NUM_SEQS``. :func:`check_settings` applies the declared
types and ranges in each ``__post_init__``; cross-field rules follow it there.

"auto" values (device, dtype, per-device scheduler limits, the KV cache size, max_model_len)
stay "auto" here; :func:`resolve_engine_config` and the model runner turn them into the values
the engine runs with, and the engine's ``config`` holds the resolved tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
import re
from typing import Any

from pdcore.settings import (LABEL, SettingError, check_settings, check_value,  # noqa: F401
                             field_types, kind_of, section, setting, setting_fields)

DTYPE_NAMES = ("float32", "bfloat16", "float16")
POLICIES = ("fcfs", "short_first")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
GEMV_MODES = ("auto", "off", "force")
QUANTIZATIONS = ("none", "fp8", "int8", "int4")  # engine.quant
KV_QUANT_DTYPES = ("int8", "fp8")  # engine.quant.kv: 8-bit codes + a scale per token and head
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

# Per-device defaults of the "auto" limits. GPU: measured on an H200 with dummy:llama-3-8b
# bf16 (issue 22): 1000 x (200 + 200) gave 14,528 output tok/s at 512 / 8192 against 3,633 at
# the CPU's 64 / 2048. CPU: sized for the 2-core machines the suite runs on.
DEVICE_DEFAULTS = {"cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
                   "cuda": {"max_num_seqs": 512, "max_num_batched_tokens": 8192}}
CPU_KV_CACHE_BYTES = 1 << 30  # CPU: the KV cache when neither num_blocks nor a size is given


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


def _power_of_two(name: str, v: int) -> None:
    if v & (v - 1):
        raise SettingError(name, f"{name} must be a power of two, got {v}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache and its prefix cache."""

    block_size: int = setting(16, "KV block size in tokens (a power of two; the gateway's must "
                                  "match)", ge=1, le=1024)
    num_blocks: int = setting(0, "KV blocks; 0: derived from kv_cache_memory_bytes", ge=0)
    kv_cache_memory_bytes: int | None = setting(
        None, "KV cache size in bytes (16GiB-style suffixes work); auto: on a GPU what "
              "gpu_memory_utilization leaves after the weights and a profiling forward pass "
              "(at most what max_num_seqs sequences of max_model_len tokens use), on the CPU "
              "1 GiB", ge=1, unit="bytes")
    gpu_memory_utilization: float = setting(
        0.9, "GPU: the fraction of the device's memory this worker may use (weights, "
             "activations and KV cache); workers sharing a GPU split it, e.g. 0.45 each",
        gt=0.0, le=1.0)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of cached prompt prefixes")
    hash_seed: str = setting("pdserve-v1", "block-hash seed (the same on every process of a "
                                           "cluster, the gateway's included)", pattern=LABEL)
    kv_dtype: str | None = setting(
        None, "KV cache dtype; auto: the model dtype; int8 / fp8 (e4m3): 8-bit codes with a "
              "float32 scale per token and KV head stored in the block (both workers of a "
              "1P1D pair must use the same)",
        choices=DTYPE_NAMES + KV_QUANT_DTYPES)
    kv_scales: str = setting(
        "dynamic", "scales of an int8 / fp8 KV cache: dynamic (each token and head its own "
                   "max), checkpoint (the model folder's static k_scale / v_scale), or the "
                   "path of a file from `pdserve quantize --kv-scales` (static, calibrated)")
    kv_block_runs: bool = setting(True, "allocations of 16+ blocks take runs of consecutive "
                                        "block ids (KV transfers then move a few large pieces); "
                                        "off: strict eviction order")

    def __post_init__(self) -> None:
        check_settings(self)
        _power_of_two("block_size", self.block_size)
        if not self.kv_scales:
            raise SettingError("kv_scales", "kv_scales must be dynamic, checkpoint or a file")
        if self.kv_scales != "dynamic" and self.kv_dtype not in KV_QUANT_DTYPES:
            raise SettingError("kv_scales", f"kv_scales {self.kv_scales!r} scales an int8 / "
                                            "fp8 KV cache: set kv_dtype int8 or fp8")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: what runs in each step."""

    max_num_seqs: int | None = setting(
        None, "cap on running requests; auto: 512 on a GPU, 64 on the CPU", ge=1)
    max_num_batched_tokens: int | None = setting(
        None, "per-step token budget (chunked prefill splits prompts above it); auto: 8192 "
              "on a GPU, 2048 on the CPU", ge=1)
    max_model_len: int | None = setting(
        None, "max prompt + output tokens; auto: the model's maximum, capped by what the KV "
              "cache holds", ge=1)
    schedule_policy: str = setting(
        "fcfs", "admission order of waiting requests: fcfs (arrival order) or short_first "
                "(fewest prompt tokens left first; one waiting over schedule_max_wait_s goes "
                "first)", choices=POLICIES, aliases=("policy",))
    schedule_max_wait_s: float = setting(
        1.0, "short_first: a request waiting this long goes before newer ones (no starvation)",
        gt=0.0, aliases=("max_wait_s",))

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class KernelConfig:
    """GPU and CPU kernel choices (the defaults are the measured fastest; the switches exist
    for A/B measurements, bench/gpu_notes.md)."""

    gemv: str = setting("auto", "GPU batch-1 projections: auto (Triton GEMV where timing beats "
                                "cuBLAS, per shape, once per process), off (cuBLAS), force "
                                "(Triton GEMV always)", choices=GEMV_MODES)
    gemv_pdl: bool = setting(True, "GPU: launch the GEMVs with programmatic dependent launch")
    gemv_split_k: bool = setting(False, "GPU: let the GEMV tuner try split-K configs (measured: "
                                        "no gain on the H200)")
    fuse_rotary: bool = setting(True, "GPU: rotary embedding and the KV store in one kernel")
    split_mixed: bool = setting(True, "GPU: a mixed step's decode rows take the decode kernel "
                                      "(off: the prefill kernel with the rest)")
    cpu_packed: bool = setting(True, "CPU: batch-1 decode reads the GGUF's Q4_1/Q8_0 blocks "
                                     "(a C++ extension built on first use); off: dense fp32")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class StructuredConfig:
    """Structured output (engine.grammar, llguidance): bounds on what a constraint may cost."""

    grammar_cache_size: int = setting(256, "compiled grammars kept, by (kind, text); the "
                                           "least recently used goes first", ge=1)
    grammar_compile_timeout_s: float = setting(
        5.0, "a worker refuses (INVALID_ARGUMENT) a constraint whose grammar takes longer to "
             "compile; compiles run off the event loop", gt=0)
    grammar_max_size: int = setting(200_000, "largest grammar (symbols of its rules, a JSON "
                                             "schema's included) the grammar engine builds",
                                    ge=1)
    grammar_lexer_fuel: int = setting(
        1_000_000, "the grammar engine's budget for building a grammar's lexer (about 50,000 "
                   "per ms): bounds the compile time of a regex or schema", ge=1)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class EngineConfig:
    """The engine: model, numerics, device and execution (offline ``LLM`` and every worker)."""

    model: str = setting("smollm2-135m", "model spec: smollm2-135m, dummy:<name>, a Hugging "
                                         "Face folder or a .gguf file")
    dtype: str = setting("auto", "weights and activations: auto (the checkpoint's bf16/fp16 "
                                 "on a GPU, else bf16 there; float32 on the CPU), float32, "
                                 "bfloat16 or float16", choices=("auto",) + DTYPE_NAMES)
    device: str = setting("auto", "auto (cuda when a GPU is visible, else cpu), cpu, cuda or "
                                  "cuda:N")
    seed: int = setting(0, "engine seed (weights of dummy models, sampling without a seed)",
                        ge=0, le=2**63 - 1)
    attention_backend: str = setting(
        "auto", "auto (triton on a GPU, torch on the CPU), torch or triton",
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(False, "GPU: no CUDA graphs")
    mixed_graph_tokens: int = setting(
        512, "GPU: steps that mix decodes with prompt chunks of up to this many tokens in all "
             "replay CUDA graphs; 0: such steps run eagerly", ge=0)
    cuda_graph_max_len: int = setting(
        8192, "GPU: decode steps whose sequences all fit this many tokens replay CUDA graphs "
              "(their block tables are this wide, whatever max_model_len is); longer contexts "
              "step eagerly", ge=1)
    num_threads: int = setting(0, "CPU: torch intra-op threads; 0: torch's default", ge=0,
                               le=1024)
    tensor_parallel_size: int = setting(
        1, "tensor-parallel ranks (one process each, on this host: gloo on the CPU, NCCL on "
           "GPUs cuda:N..N+size-1); each loads only its slice of the weights", ge=1,
        le=64)
    tensor_parallel_timeout_s: float = setting(
        30.0, "a tensor-parallel collective that waits longer on a rank fails the engine (a "
              "rank that exits fails it at once)", gt=0)
    async_decode: bool | None = setting(
        None, "launch the next decode step before reading this one's tokens (hides host work "
              "behind the GPU); auto: on with CUDA graphs, off otherwise")
    quantization: str = setting(
        "none", "weights quantized at load: none, fp8 (e4m3 per-channel weights, per-token "
                "activation scales), int8 (weight-only, per channel) or int4 (weight-only, "
                "groups of 128); embeddings, norms and the LM head keep the model dtype",
        choices=QUANTIZATIONS)
    quantization_plan: str | None = setting(
        None, "a mixed-precision plan file (pdserve quantize --plan): the format of each "
              "projection of each layer; its default replaces quantization")
    quantized_weights: str | None = setting(
        None, "a file of calibrated quantized projections for this model (pdserve quantize "
              "--gptq): loaded over the checkpoint's float weights; quantization none")
    cache: CacheConfig = section(CacheConfig, "KV cache")
    scheduler: SchedulerConfig = section(SchedulerConfig, "scheduler")
    kernels: KernelConfig = section(KernelConfig, "kernels")
    structured: StructuredConfig = section(StructuredConfig, "structured output")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.model:
            raise SettingError("model", "model must not be empty")
        if not _DEVICE_RE.match(self.device):
            raise SettingError("device", f"device must be auto, cpu, cuda or cuda:N, "
                                         f"got {self.device!r}")
        for name, cls in (("cache", CacheConfig), ("scheduler", SchedulerConfig),
                          ("kernels", KernelConfig), ("structured", StructuredConfig)):
            if not isinstance(getattr(self, name), cls):
                raise SettingError(name, f"{name} must be a {cls.__name__}")
        if self.quantized_weights and (self.quantization != "none" or self.quantization_plan):
            raise SettingError("quantized_weights", "quantized_weights holds the projections' "
                               "formats already: leave quantization none and no plan")
        if self.tensor_parallel_size > 1 and (self.quantization != "none"
                                              or self.quantization_plan
                                              or self.quantized_weights
                                              or self.cache.kv_dtype in KV_QUANT_DTYPES):
            raise SettingError("quantization", "quantized weights or KV cache with "
                                               "tensor_parallel_size > 1 are not supported yet")

    @property
    def device_kind(self) -> str:
        """cpu or cuda (auto counts as unresolved: cpu until resolve_engine_config)."""
        return "cuda" if self.device.startswith("cuda") else "cpu"


def resolve_engine_config(c: EngineConfig, *, cuda_available: bool,
                          checkpoint_dtype: str | None = None,
                          bf16_supported: bool = True) -> EngineConfig:
    """``c`` with device, dtype, async_decode and the per-device scheduler limits resolved
    (the KV cache size and max_model_len are resolved by the model runner, which measures).
    ``checkpoint_dtype``: the dtype the weights are stored in, when the loader knows it."""
    device = c.device if c.device != "auto" else ("cuda" if cuda_available else "cpu")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    dtype = c.dtype
    if dtype == "auto":
        if kind == "cpu":
            dtype = "float32"
        elif checkpoint_dtype == "float16" or not bf16_supported:
            dtype = "float16"
        else:
            dtype = "bfloat16"
    sc = c.scheduler
    limits = {k: getattr(sc, k) or v for k, v in DEVICE_DEFAULTS[kind].items()}
    # tensor parallel on GPUs runs eagerly: all-reduces inside CUDA graphs need two GPUs to
    # build and test (issue 28)
    eager = c.enforce_eager or (kind == "cuda" and c.tensor_parallel_size > 1)
    async_decode = c.async_decode
    if async_decode is None:
        async_decode = kind == "cuda" and not eager
    return replace(c, device=device, dtype=dtype, async_decode=async_decode,
                   enforce_eager=eager, scheduler=replace(sc, **limits))


def check_runnable(c: EngineConfig, *, triton_interpreted: bool = False) -> None:
    """SettingError for choices of the resolved ``c`` that cannot run together here.
    ``triton_interpreted``: Triton kernels run on the CPU (TRITON_INTERPRET=1, tests)."""
    kv = c.cache.kv_dtype
    if kv in DTYPE_NAMES and kv != c.dtype:
        raise SettingError("kv_dtype", f"kv_dtype {kv} with the model in {c.dtype}: a float "
                           "KV cache holds the model's dtype (auto); int8 or fp8 compress it")
    if c.attention_backend == "triton" and c.device_kind == "cpu" and not triton_interpreted:
        raise SettingError("attention_backend", "attention_backend triton needs a GPU (on "
                           "the CPU only under Triton's interpreter, TRITON_INTERPRET=1, for "
                           "tests); use auto or torch")
