"""Model family registry: one class per architecture string in ModelConfig.arch."""
from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

_REGISTRY = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "mistral": LlamaForCausalLM}


def model_class(cfg: ModelConfig):
    try:
        return _REGISTRY[cfg.arch]
    except KeyError:
        raise ValueError(f"no model implementation for architecture {cfg.arch!r}") from None
