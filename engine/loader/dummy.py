"""`dummy:<name>` models: real shapes, random weights, a byte-level tokenizer.

Every tensor is drawn from its own generator, seeded from (seed, tensor name), directly on the
target device in the target dtype, so a dummy Llama-3-8B (16 GB in bf16) never stages on the
CPU, and a tensor's values do not depend on which other tensors exist. (CPU and CUDA generators
produce different streams: the same seed gives different weights on different device types.)

Scales keep activations and logits non-degenerate, so greedy decoding gives varied tokens:
linear weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2), and
embedding rows Gaussian rescaled to norm std * sqrt(hidden) (equal norms: no token is favoured
by the size of its row), std 1. With tied embeddings a random model tends to repeat its input
token (the residual stream carries e_x, and e_x . e_x dominates the logits), so tied models use
std 0.005 (found by trying: larger repeats, smaller falls into other fixed points) and a
final norm weight 200x larger (logits of order 1 again; only lm_head sees it).
"""
from __future__ import annotations

import hashlib
import logging

from engine.config import ModelConfig

logger = logging.getLogger(__name__)

# Dummy models use ByteTokenizer's ids: bos 1, eos 2.
_TIED_EMBED_STD = 0.005
_TOK = dict(bos_token_id=1, eos_token_ids=(2,))
_LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))

DUMMY_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        max_position=2048, **_TOK),
    "tiny-qwen2": ModelConfig(arch="qwen2", vocab_size=512, hidden_size=64,
                              intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, max_position=2048,
                              tie_word_embeddings=True, attention_bias=True, **_TOK),
    # head_dim * num_heads != hidden_size, as in Mistral-Nemo: exercises o_proj's shape.
    "tiny-mistral": ModelConfig(arch="mistral", vocab_size=512, hidden_size=64,
                                intermediate_size=128, num_layers=3, num_heads=4,
                                num_kv_heads=1, head_dim=32, rope_theta=1e6, max_position=2048,
                                **_TOK),
    "tiny-llama3": ModelConfig(arch="llama", vocab_size=512, hidden_size=64,
                               intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=16, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                               max_position=16384, **_TOK),
    "smollm2-135m": ModelConfig(arch="llama", vocab_size=49152, hidden_size=576,
                                intermediate_size=1536, num_layers=30, num_heads=9,
                                num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                max_position=8192, tie_word_embeddings=True, **_TOK),
    "llama-3-8b": ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096,
                              intermediate_size=14336, num_layers=32, num_heads=32,
                              num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                              rope_scaling=_LLAMA3_ROPE, max_position=131072, **_TOK),
    # Llama-3-70B's shapes (141 GB in bf16): 64 query / 8 KV heads, for tensor parallelism
    "llama-3-70b": ModelConfig(arch="llama", vocab_size=128256, hidden_size=8192,
                               intermediate_size=28672, num_layers=80, num_heads=64,
                               num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                               rope_scaling=_LLAMA3_ROPE, max_position=131072, **_TOK),
    # JackFram/llama-160m's shapes: a modest model for CPU measurements (bench/tp_memory_cpu)
    "llama-160m": ModelConfig(arch="llama", vocab_size=32000, hidden_size=768,
                              intermediate_size=3072, num_layers=12, num_heads=12,
                              num_kv_heads=12, head_dim=64, max_position=2048, **_TOK),
    "qwen2.5-7b": ModelConfig(arch="qwen2", vocab_size=152064, hidden_size=3584,
                              intermediate_size=18944, num_layers=28, num_heads=28,
                              num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                              rope_theta=1e6, max_position=32768, attention_bias=True, **_TOK),
    "mistral-7b": ModelConfig(arch="mistral", vocab_size=32768, hidden_size=4096,
                              intermediate_size=14336, num_layers=32, num_heads=32,
                              num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position=32768,
                              **_TOK),
}


def dummy_config(name: str) -> ModelConfig:
    try:
        return DUMMY_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown dummy model {name!r}; known: "
                         f"{', '.join('dummy:' + n for n in DUMMY_CONFIGS)}") from None


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's HF name and [out, in] shape for `config` (lm_head omitted when tied)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size,
                                                                         c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_weights(config: ModelConfig, dtype, device: str = "cpu", seed: int = 0,
                   shard=None) -> dict:
    """``shard`` (engine.parallel.ShardPlan): keep only a tensor-parallel rank's slices; each
    tensor is drawn whole (its values must not depend on the rank count), sliced and freed
    before the next, so a rank holds its shards plus at most one whole tensor."""
    weights = {}
    for name, shape in weight_shapes(config).items():
        if shard is None:
            weights[name] = _random_tensor(config, name, shape, dtype, device, seed)
            continue
        full = _random_tensor(config, name, shape, dtype, device, seed)
        weights[name] = shard.take(name, shape, lambda ix: full if ix is None else full[ix])
        del full
    return weights


def _random_tensor(config: ModelConfig, name: str, shape, dtype, device: str, seed: int):
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(_tensor_seed(seed, name))
    w = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    if name == "model.embed_tokens.weight":
        std = _TIED_EMBED_STD if config.tie_word_embeddings else 1.0
        row_norm = torch.linalg.vector_norm(w, dim=1, keepdim=True, dtype=torch.float32)
        w.mul_((std * shape[1] ** 0.5 / row_norm).to(dtype))
    elif name.endswith("norm.weight"):
        w.mul_(0.1).add_(1.0)
        if name == "model.norm.weight" and config.tie_word_embeddings:
            w.mul_(1.0 / _TIED_EMBED_STD)
    elif name.endswith(".bias"):
        w.mul_(0.1)
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        w.mul_((shape[1] * 2 * config.num_layers) ** -0.5)
    else:
        w.mul_(shape[1] ** -0.5)
    return w
