"""Calibrated quantization (``pdserve quantize --gptq``) and the file it writes.

:func:`gptq_calibrate` scores calibration windows through a loaded float engine
(LLMEngine.score) with a :class:`engine.quant.gptq.HessianCollector` on every projection, then
swaps each projection for the format its plan names, rounded by GPTQ (int4, int8, fp8);
none is left alone. Both run on the engine's device (``device``: ``pdserve quantize --device
cuda``): the Hessians and the rounding there, the quantized modules stay there.

The result is saved as one safetensors file of the quantized projections, keyed by plan
names (``layers.<i>.<qkv|o|gate_up|down>.<q|scale|zero|bias>``), its header holding
``{"format": "pdserve-quantized/1", "model": ..., "projections": {name: {"format", "k",
"group", "out_features"}}, "calibration": {...}}``. The engine setting ``quantized_weights``
loads it over the checkpoint's float weights (:func:`apply_file`): the same modules, so the
same tokens, as the engine that calibrated.
"""
from __future__ import annotations

import json
import logging
import time

import torch

from engine.quant import model_weight_bytes, projections
from engine.quant.gptq import HessianCollector, gptq_quantize
from engine.quant.linear import QuantLinear
from engine.quant.plan import QuantPlan
from engine.quant.reference import QUANTIZERS

logger = logging.getLogger(__name__)

FILE_FORMAT = "pdserve-quantized/1"
GPTQ_FORMATS = ("int4", "int8", "fp8")


def gptq_calibrate(engine, windows: list[list[int]], plan: QuantPlan, progress=None) -> dict:
    """Quantize ``engine``'s float model in place per ``plan``; returns the calibration's
    description (tokens, time, formats)."""
    model = engine.runner.model
    device = next(model.parameters()).device
    projs = list(projections(model))
    if any(isinstance(getattr(p, a), QuantLinear) for _, p, a in projs):
        raise ValueError("calibration starts from an unquantized model (quantization none)")
    plan.check_model(len(model.layers))
    col = HessianCollector()
    for name, parent, attr in projs:
        if plan.format_of(name) in GPTQ_FORMATS:
            col.hook(name, getattr(parent, attr))
    t0 = time.perf_counter()
    try:
        for w in windows:
            engine.score(w)
    finally:
        col.remove()
    calib_s = time.perf_counter() - t0
    counts: dict[str, int] = {}
    for name, parent, attr in projs:
        fmt = plan.format_of(name)
        counts[fmt] = counts.get(fmt, 0) + 1
        lin = getattr(parent, attr)
        if fmt == "none":
            continue
        w = lin.weight.detach()
        # rounded on the engine's device (the weight's); each H is dropped once used
        qw = (gptq_quantize(w.float(), col.h.pop(name), fmt) if fmt in GPTQ_FORMATS
              else QUANTIZERS[fmt](w))
        bias = None if lin.bias is None else lin.bias.detach().clone()
        setattr(parent, attr, QuantLinear(qw, bias, lin.out_features))
        if progress:
            progress(f"{name}: {fmt}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # quantize_s counts the GPU's work, not its launches
    return {"method": "gptq", "tokens": sum(len(w) for w in windows), "windows": len(windows),
            "calibration_s": round(calib_s, 2),
            "quantize_s": round(time.perf_counter() - t0 - calib_s, 2),
            "projections": counts, "weight_bytes": model_weight_bytes(model)}


def save_file(model, path: str, model_id: str, calibration: dict) -> int:
    """Write the model's quantized projections to ``path``; returns how many."""
    from safetensors.torch import save_file as st_save
    tensors, meta = {}, {}
    for name, parent, attr in projections(model):
        m = getattr(parent, attr)
        if not isinstance(m, QuantLinear):
            continue
        for key in ("q", "scale", "zero", "bias"):
            t = getattr(m, key)
            if t is not None:
                tensors[f"{name}.{key}"] = t.detach().cpu().contiguous()
        meta[name] = {"format": m.format, "k": m.in_features, "group": m.group,
                      "out_features": m.out_features}
    if not meta:
        raise ValueError("the model has no quantized projection to save")
    header = {"format": FILE_FORMAT, "model": model_id, "projections": meta,
              "calibration": calibration}
    st_save(tensors, path, metadata={"pdserve": json.dumps(header)})
    return len(meta)


def read_file(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of a file :func:`save_file` wrote; ValueError saying what is wrong."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get("pdserve")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise ValueError(f"quantized_weights {path!r}: {e}") from None
    try:
        header = json.loads(raw) if raw else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FILE_FORMAT:
        raise ValueError(f"quantized_weights {path!r}: not a {FILE_FORMAT} file "
                         "(pdserve quantize --gptq writes one)")
    return header, tensors


def apply_file(model, path: str, model_id: str) -> dict:
    """Swap in the projections of ``path`` (checked against the model); the summary of
    engine.quant.quantize_model."""
    header, tensors = read_file(path)
    if header.get("model") and header["model"] != model_id:
        raise ValueError(f"quantized_weights {path!r} was made for {header['model']!r}, "
                         f"not {model_id!r}")
    metas = header.get("projections") or {}
    device = next(model.parameters()).device
    counts: dict[str, int] = {}
    for name, parent, attr in projections(model):
        lin, m = getattr(parent, attr), metas.get(name)
        if m is None:
            counts["none"] = counts.get("none", 0) + 1
            continue
        if (m.get("k"), m.get("out_features")) != (lin.in_features, lin.out_features):
            raise ValueError(f"quantized_weights {path!r}: {name} is {m.get('k')} -> "
                             f"{m.get('out_features')}, the model's is {lin.in_features} -> "
                             f"{lin.out_features}")
        qw = {"format": m["format"], "k": m["k"], "group": m.get("group", 0)}
        for key in ("q", "scale", "zero"):
            if f"{name}.{key}" in tensors:
                qw[key] = tensors[f"{name}.{key}"].to(device)
        bias = tensors.get(f"{name}.bias")
        setattr(parent, attr, QuantLinear(qw, None if bias is None else bias.to(device),
                                          lin.out_features))
        counts[m["format"]] = counts.get(m["format"], 0) + 1
    unknown = set(metas) - {n for n, _, _ in projections(model)}
    if unknown:
        raise ValueError(f"quantized_weights {path!r} names projections the model does not "
                         f"have: {sorted(unknown)[:3]}")
    logger.info("quantized weights from %s: %s", path, counts)
    return {"projections": counts, "weight_bytes": model_weight_bytes(model),
            "calibration": header.get("calibration")}
