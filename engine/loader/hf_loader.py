"""Load a Hugging Face model folder: config.json (+ generation_config.json), *.safetensors
(single or sharded), tokenizer.json (+ tokenizer_config.json / chat_template.jinja).

Config parsing and the tokenizer are torch-free; torch is imported when weights are loaded.
Both the older (`rope_theta` + `rope_scaling`) and transformers-5 (`rope_parameters`) spellings
of the rotary settings are read.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from engine.config import ModelConfig
from engine.loader.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "MistralForCausalLM": "mistral"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _rope(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or {}) or params
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, _freeze(scaling)


def hf_config_from_dict(cfg: dict[str, Any], generation: dict[str, Any] | None = None
                        ) -> ModelConfig:
    arch = None
    for name in cfg.get("architectures") or ():
        arch = ARCHITECTURES.get(name) or arch
    arch = arch or MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch is None:
        raise ValueError(f"unsupported model: architectures={cfg.get('architectures')!r} "
                         f"model_type={cfg.get('model_type')!r} (supported: "
                         f"{sorted(ARCHITECTURES)})")
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    eos = list(_ids(cfg.get("eos_token_id")))
    for i in _ids((generation or {}).get("eos_token_id")):
        if i not in eos:
            eos.append(i)
    sliding = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos),
    )


def hf_config(path: str) -> ModelConfig:
    gen_path = os.path.join(path, "generation_config.json")
    generation = _read_json(gen_path) if os.path.isfile(gen_path) else None
    return hf_config_from_dict(_read_json(os.path.join(path, "config.json")), generation)


def hf_checkpoint_dtype(path: str) -> str | None:
    """The dtype config.json says the weights are stored in (``torch_dtype``, or ``dtype``
    in newer exports), as float32 / bfloat16 / float16; None when absent or other."""
    cfg = _read_json(os.path.join(path, "config.json"))
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "").replace("torch.", "")
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
            "half": "float16"}.get(name)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(path: str, tok_cfg: dict[str, Any]) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None:
        ct = os.path.join(path, "chat_template.json")
        if os.path.isfile(ct):
            template = _read_json(ct).get("chat_template")
    return template


def hf_tokenizer(path: str, config: ModelConfig | None = None) -> Tokenizer:
    tok_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_json):
        raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    cfg_path = os.path.join(path, "tokenizer_config.json")
    tok_cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    config = config or hf_config(path)
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(tok_json)
    bos_token = _token_content(tok_cfg.get("bos_token"))
    eos_token = _token_content(tok_cfg.get("eos_token"))
    bos_id = config.bos_token_id
    if bos_id is None and bos_token is not None:
        bos_id = backend.token_to_id(bos_token)
    eos_ids = list(config.eos_token_ids)
    eos_from_tok = backend.token_to_id(eos_token) if eos_token is not None else None
    if eos_from_tok is not None and eos_from_tok not in eos_ids:
        eos_ids.append(eos_from_tok)
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                     chat_template=_chat_template(path, tok_cfg), bos_token=bos_token,
                     eos_token=eos_token)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    return [os.path.join(path, f) for f in files]


def load_hf_weights(path: str, config: ModelConfig, dtype, device: str = "cpu",
                    shard=None) -> dict:
    """Weights from the folder's safetensors under HF names, in `dtype` on `device`.
    ``shard`` (engine.parallel.ShardPlan): read only a tensor-parallel rank's slices (a
    safetensors slice reads just those bytes from the file)."""
    from safetensors import safe_open

    weights = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if shard is not None:
                    sl = f.get_slice(name)
                    t = shard.take(name, tuple(sl.get_shape()),
                                   lambda ix, sl=sl, n=name: f.get_tensor(n) if ix is None
                                   else sl[ix])
                else:
                    t = f.get_tensor(name)
                weights[name] = t.to(device=device, dtype=dtype).contiguous()
    if not config.tie_word_embeddings and "lm_head.weight" not in weights:
        raise ValueError(f"{path}: lm_head.weight is missing and tie_word_embeddings is false")
    if "model.embed_tokens.weight" not in weights:
        raise ValueError(f"{path}: model.embed_tokens.weight is missing")
    return weights
