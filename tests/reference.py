"""Test-only helpers: a transformers model holding the exact weights of a LoadedModel, so any
engine output can be checked against transformers, and an HF-folder writer for loader tests.

Imports transformers (tests only; the engine never does).
"""
from __future__ import annotations

import json
import os

import torch

from engine.config import ModelConfig
from engine.loader import LoadedModel


def hf_config_from_model_config(config: ModelConfig):
    """The transformers config (LlamaConfig / Qwen2Config / MistralConfig) matching `config`."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope = {**config.rope_scaling_dict, "rope_theta": config.rope_theta}
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=config.max_position,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids) or None, hidden_act="silu",
    )
    if config.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if config.arch == "mistral":
        return MistralConfig(**common, sliding_window=config.sliding_window)
    return LlamaConfig(**common, attention_bias=config.attention_bias)


def hf_model_from_loaded(loaded: LoadedModel):
    """A transformers causal LM in float32 eval mode with `loaded`'s weights (exactly)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config_from_model_config(loaded.config)
    cfg._attn_implementation = "eager"
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every parameter is overwritten below: skip random init
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in loaded.weights.items()}
    result = model.load_state_dict(state, strict=False)  # copies: independent of `loaded`
    missing = set(result.missing_keys)
    if loaded.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing or result.unexpected_keys:
        raise ValueError(f"weights do not match the transformers model: missing "
                         f"{sorted(missing)}, unexpected {sorted(result.unexpected_keys)}")
    if loaded.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def greedy_reference(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache."""
    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([list(prompt_ids)]), use_cache=True)
        for _ in range(max_tokens):
            out.append(int(result.logits[0, -1].argmax()))
            if len(out) == max_tokens:
                break
            result = model(torch.tensor([[out[-1]]]), past_key_values=result.past_key_values,
                           use_cache=True)
    return out


def wordlevel_tokenizer_json(vocab: int = 512) -> str:
    """A fast tokenizer (tokenizer.json text) of words ``w0`` .. ``w{vocab-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def save_hf_folder(loaded: LoadedModel, path: str, *, tokenizer_json: str | None = None,
                   tokenizer_config: dict | None = None, shards: int = 1,
                   config_overrides: dict | None = None) -> None:
    """Write `loaded` as an HF folder: config.json (via transformers), safetensors (optionally
    sharded, with an index), and optionally tokenizer.json / tokenizer_config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = hf_config_from_model_config(loaded.config).to_dict()
    cfg["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "mistral": "MistralForCausalLM"}[loaded.config.arch]]
    cfg.update(config_overrides or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    names = sorted(loaded.weights)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        file = "model.safetensors" if shards == 1 else \
            f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: loaded.weights[n].contiguous() for n in group}, os.path.join(path, file))
        weight_map.update({n: file for n in group})
    if shards > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if tokenizer_json is not None:
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write(tokenizer_json)
    if tokenizer_config is not None:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f)


def assert_fp8_codes(got: torch.Tensor, want: torch.Tensor, exact: bool,
                     ties: bool = False) -> None:
    """e4m3 codes from a Triton kernel (``got``) against torch's (``want``). ``exact`` (a
    GPU, which rounds to nearest even as torch does): every code equal. The CPU
    interpreter's float8 cast loses the carry when rounding up to a power of two (it gives
    half of it), rounds subnormals its own way and, with ``ties``, breaks ties away from
    zero (a neighbouring code: inputs of few mantissa bits, bf16, meet ties often); every
    other code must be identical."""
    bits_g, bits_w = got.view(torch.uint8), want.view(torch.uint8)
    got, want = got.view(torch.float8_e4m3fn).float(), want.view(torch.float8_e4m3fn).float()
    if exact:
        assert torch.equal(got, want)
        return
    diff = (got != want) & (want.abs() > 2 ** -6)
    pow2 = torch.frexp(want)[0].abs() == 0.5
    ok = pow2 & (got == want / 2)
    if ties:  # the next code away from zero (same sign bit, magnitude one code up)
        ok |= (bits_g.int() - bits_w.int() == 1) & ((bits_g ^ bits_w) < 0x80)
    assert ok[diff].all()
