"""Quantized weights (``quantization = fp8 | int8 | int4``, or a mixed-precision plan file)
and the quantized KV cache (``kv_dtype = int8 | fp8``).

Weights are quantized at load from the checkpoint's float weights: after ``load_weights`` the
model runner calls :func:`quantize_model`, which swaps each projection of each decoder layer
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) for an
:class:`engine.quant.linear.QuantLinear` of the format its plan names. Embeddings, norms and
the LM head stay in the model dtype. Formats and kernels: engine/quant/reference.py (torch,
every device), engine/quant/kernels.py (Triton, GPU). Plans: engine/quant/plan.py.
"""
from __future__ import annotations

import logging

from engine.quant.plan import PROJECTIONS, QuantPlan, linear_names  # noqa: F401
from engine.quant.reference import FORMATS  # noqa: F401

logger = logging.getLogger(__name__)

METHODS = ("none",) + FORMATS


def quantize_model(model, plan: QuantPlan) -> dict:
    """Swap the model's projections per ``plan`` (in place). Returns a summary: projections
    per format and the bytes of every weight the model holds (embeddings and head counted)."""
    import torch
    from engine.quant.linear import QuantLinear

    counts: dict[str, int] = {}
    for name, parent, attr in projections(model):
        fmt = plan.format_of(name)
        counts[fmt] = counts.get(fmt, 0) + 1
        if fmt == "none":
            continue
        setattr(parent, attr, QuantLinear.from_linear(getattr(parent, attr), fmt))
    if model.parameters().__next__().is_cuda:
        torch.cuda.empty_cache()
    summary = {"projections": counts, "weight_bytes": model_weight_bytes(model)}
    logger.info("quantized weights: %s; %.1f MiB of weights", counts,
                summary["weight_bytes"] / 2**20)
    return summary


_PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
          "down": ("mlp.down_proj",)}


def quantize_loaded(model, quantized: dict[str, dict]) -> dict:
    """Swap in a pre-quantized checkpoint's projections (engine.quant.checkpoint: HF weight
    name -> quantized dict); q/k/v and gate/up are concatenated along the output rows like
    the dense weights. Returns the summary of :func:`quantize_model`."""
    import torch
    from engine.quant.linear import QuantLinear

    counts: dict[str, int] = {}
    for name, parent, attr in projections(model):
        i, proj = name.split(".")[1], name.split(".")[2]
        parts = [quantized.get(f"model.layers.{i}.{p}.weight") for p in _PARTS[proj]]
        if all(p is None for p in parts):
            counts["none"] = counts.get("none", 0) + 1
            continue
        if any(p is None for p in parts) or len({p["format"] for p in parts}) != 1 or len(
                {p.get("group") for p in parts}) != 1:
            raise ValueError(f"{name}: its parts {_PARTS[proj]} are not quantized alike")
        qw = dict(parts[0])
        for key in ("q", "scale", "zero"):
            if qw.get(key) is not None:
                qw[key] = torch.cat([p[key] for p in parts]).contiguous()
        lin = getattr(parent, attr)
        bias = None if lin.bias is None else lin.bias.detach().clone()
        setattr(parent, attr, QuantLinear(qw, bias, lin.out_features))
        counts[qw["format"]] = counts.get(qw["format"], 0) + 1
    summary = {"projections": counts, "weight_bytes": model_weight_bytes(model),
               "checkpoint": True}
    logger.info("pre-quantized weights: %s", counts)
    return summary


def projections(model):
    for i, layer in enumerate(model.layers):
        for attr, (sub, proj) in zip(PROJECTIONS, (("self_attn", "qkv_proj"),
                                                   ("self_attn", "o_proj"),
                                                   ("mlp", "gate_up_proj"),
                                                   ("mlp", "down_proj"))):
            yield f"layers.{i}.{attr}", getattr(layer, sub), proj


def model_weight_bytes(model) -> int:
    """Bytes of every weight the model holds: its parameters, and the codes, scales and
    biases of its QuantLinear modules (rotary tables and other buffers are not weights)."""
    from engine.quant.linear import QuantLinear

    tensors = {id(p): p for p in model.parameters()}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            tensors.update((id(b), b) for b in m.buffers())
    return sum(t.numel() * t.element_size() for t in tensors.values())
