"""Static scales of a quantized KV cache (``kv_scales = checkpoint | FILE``).

A quantized cache (engine.quant.kv) stores a float32 scale beside every (token, head) row of
codes. With ``kv_scales dynamic`` (the default) each row's scale is its own ``max|x| /
qmax``. A static scale is one value per (layer, K/V, KV head), fixed before serving: the
store writes it into every row's slot, so the attention kernels, the KV transfer (blocks
carry their scales) and a peer with dynamic scales read the cache the same way. Values
beyond a static range saturate at the format's largest code.

Where static scales come from:

- ``checkpoint``: the model folder's safetensors, as Hugging Face checkpoints calibrated by
  llm-compressor (compressed-tensors ``kv_cache_scheme``) or quantized for vLLM store them:
  ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (older exports:
  ``...self_attn.k_proj.output_scale`` / ``v_proj.output_scale``), one value per layer
  (strategy ``tensor``) or one per KV head (``attn_head``). A scale ``s`` multiplies a code
  (x = code * s) on the checkpoint's grid: e4m3 (qmax 448) unless config.json's
  ``quantization_config.kv_cache_scheme`` says ``type: int`` (qmax 127). The engine takes the
  range ``s * qmax`` and puts it on its own grid, so an fp8-calibrated checkpoint also
  serves an int8 cache.
- a file written by ``pdserve quantize --kv-scales`` (:func:`calibrate`): the same tensor
  names, per KV head on the e4m3 grid, in a safetensors file whose metadata names the format
  (``pdserve-kv-scales/1``) and the model it was calibrated on (checked at load).
"""
from __future__ import annotations

import glob
import json
import logging
import os

import torch

from engine.config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT = "pdserve-kv-scales/1"
QMAX_FP8, QMAX_INT8 = 448.0, 127.0


def names(layer: int, which: int) -> tuple[str, str]:
    """(current name, older export's name) of layer ``layer``'s K (0) or V (1) scale."""
    kv = "kv"[which]
    a = f"model.layers.{layer}.self_attn."
    return a + f"{kv}_scale", a + f"{kv}_proj.output_scale"


def _ranges(found: dict[str, torch.Tensor], mc: ModelConfig, qmax: float, where: str
            ) -> torch.Tensor:
    """float32 [num_layers, 2, num_kv_heads] ranges (max |x|) from checkpoint scales."""
    out = torch.empty(mc.num_layers, 2, mc.num_kv_heads, dtype=torch.float32)
    missing = []
    for layer in range(mc.num_layers):
        for which in (0, 1):
            name = next((n for n in names(layer, which) if n in found), None)
            if name is None:
                missing.append(names(layer, which)[0])
                continue
            s = found[name].float().reshape(-1)
            if s.numel() not in (1, mc.num_kv_heads):
                raise ValueError(f"{where}: {name} has {s.numel()} values; expected 1 (per "
                                 f"layer) or {mc.num_kv_heads} (per KV head)")
            if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
                raise ValueError(f"{where}: {name} holds a scale that is not a positive "
                                 f"finite number ({s.tolist()[:4]})")
            out[layer, which] = s.expand(mc.num_kv_heads) * qmax
    if missing:
        raise ValueError(f"{where}: no KV cache scale for {len(missing)} of "
                         f"{2 * mc.num_layers} (layer, K/V) pairs, e.g. {missing[0]}")
    return out


def _scale_tensors(files: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Every ``*k_scale`` / ``*v_scale`` / ``*_proj.output_scale`` tensor of the files (only
    those are read), and the first file's metadata."""
    from safetensors import safe_open
    found, meta = {}, {}
    for i, file in enumerate(files):
        with safe_open(file, framework="pt", device="cpu") as f:
            if i == 0:
                meta = f.metadata() or {}
            for name in f.keys():
                if name.endswith((".k_scale", ".v_scale", "k_proj.output_scale",
                                  "v_proj.output_scale")):
                    found[name] = f.get_tensor(name)
    return found, meta


def checkpoint_ranges(folder: str, mc: ModelConfig) -> torch.Tensor:
    """A Hugging Face folder's static KV scales as ranges [num_layers, 2, num_kv_heads]."""
    with open(os.path.join(folder, "config.json")) as f:
        scheme = ((json.load(f).get("quantization_config") or {}).get("kv_cache_scheme")
                  or {})
    if scheme.get("num_bits", 8) != 8 or scheme.get("type", "float") not in ("float", "int"):
        raise ValueError(f"{folder}: kv_cache_scheme {scheme!r}: only 8-bit float or int "
                         "KV scales are supported")
    if scheme.get("dynamic"):
        raise ValueError(f"{folder}: its kv_cache_scheme is dynamic (no static scales): use "
                         "kv_scales dynamic")
    qmax = QMAX_INT8 if scheme.get("type") == "int" else QMAX_FP8
    found, _ = _scale_tensors(sorted(glob.glob(os.path.join(folder, "*.safetensors"))))
    if not found:
        raise ValueError(f"{folder}: kv_scales checkpoint, but the checkpoint stores no KV "
                         "cache scales (k_scale / v_scale)")
    return _ranges(found, mc, qmax, folder)


def file_ranges(path: str, mc: ModelConfig, model_id: str) -> torch.Tensor:
    """A ``pdserve quantize --kv-scales`` file's ranges [num_layers, 2, num_kv_heads]."""
    if not os.path.isfile(path):
        raise ValueError(f"kv_scales {path!r}: expected dynamic, checkpoint or a scales file "
                         "(no such file)")
    try:
        found, meta = _scale_tensors([path])
    except Exception as e:  # noqa: BLE001 - not a safetensors file: say so in one line
        raise ValueError(f"kv_scales {path}: not a safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"kv_scales {path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("model") != model_id:
        raise ValueError(f"kv_scales {path} was calibrated on {meta.get('model')!r}, not on "
                         f"{model_id!r}")
    return _ranges(found, mc, QMAX_FP8, path)


def load_static_scales(kv_scales: str, model_spec: str, mc: ModelConfig, model_id: str,
                       code_dtype: torch.dtype) -> torch.Tensor | None:
    """The cache's static scales, float32 [num_layers, 2, num_kv_heads] on the CPU, on the
    grid of ``code_dtype`` (engine.quant.kv: a code times its scale); None for dynamic."""
    from engine.quant.kv import INV_QMAX
    if kv_scales == "dynamic":
        return None
    if kv_scales == "checkpoint":
        from engine.loader import resolve_spec
        kind, location, _ = resolve_spec(model_spec)
        if kind != "hf":
            raise ValueError(f"kv_scales checkpoint: {model_spec!r} is not a Hugging Face "
                             "folder, so it stores no KV cache scales (use a file from "
                             "`pdserve quantize --kv-scales`)")
        ranges = checkpoint_ranges(location, mc)
    else:
        ranges = file_ranges(os.path.expanduser(kv_scales), mc, model_id)
    scales = (ranges.clamp_min(1e-8) * INV_QMAX[code_dtype]).contiguous()
    logger.info("KV cache: static scales from %s (K range %.3g-%.3g, V %.3g-%.3g)", kv_scales,
                float(ranges[:, 0].min()), float(ranges[:, 0].max()),
                float(ranges[:, 1].min()), float(ranges[:, 1].max()))
    return scales


# ------------------------------------------------------------------- calibration
class RangeRecorder:
    """An attention backend wrapper that records max |K| and max |V| per (layer, KV head)
    of every token it stores, then runs the wrapped backend (calibration only)."""

    def __init__(self, inner, num_layers: int, num_kv_heads: int):
        self.inner = inner
        self.name = inner.name
        self.fuses_rotary = False  # K arrives rotated, as the cache stores it
        self.ranges = torch.zeros(num_layers, 2, num_kv_heads, dtype=torch.float32)

    def forward(self, layer, q, k, v, kv_cache, meta, rope=None):
        for which, x in ((0, k), (1, v)):
            m = x.detach().float().abs().amax(dim=(0, 2)).cpu()  # [heads]
            torch.maximum(self.ranges[layer, which], m, out=self.ranges[layer, which])
        return self.inner.forward(layer, q, k, v, kv_cache, meta)

    def __getattr__(self, name):  # everything else is the wrapped backend's
        return getattr(self.inner, name)


def write_file(path: str, ranges: torch.Tensor, model_id: str, info: dict) -> None:
    """Ranges [num_layers, 2, num_kv_heads] as per-head e4m3-grid scales (checkpoint names)."""
    from safetensors.torch import save_file
    tensors = {}
    for layer in range(ranges.shape[0]):
        for which in (0, 1):
            s = (ranges[layer, which].clamp_min(1e-8) / QMAX_FP8).contiguous()
            tensors[names(layer, which)[0]] = s
    meta = {"format": FORMAT, "model": model_id,
            "kv_cache_scheme": json.dumps({"num_bits": 8, "type": "float",
                                           "strategy": "attn_head", "dynamic": False}),
            "calibration": json.dumps(info)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path, metadata=meta)
