"""Pre-quantized Hugging Face checkpoints (``quantization_config`` in config.json), read into
the engine's own formats (engine.quant.reference) without re-quantizing:

- compressed-tensors, ``float-quantized`` FP8 (llm-compressor's FP8 / FP8_DYNAMIC): each
  quantized linear stores ``weight`` (float8_e4m3fn [N, K]) and ``weight_scale`` ([N, 1] for
  the channel strategy, one value for the tensor strategy) -> fp8, w = q * scale. Activations
  are quantized per token at run time (a static ``input_scale`` is not used: logged).
- AWQ (``quant_method: awq``, GEMM packing, 4 bits, zero point): ``qweight`` int32 [K, N/8]
  (nibble i of each int32 holds output column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]), ``qzeros``
  int32 [K/G, N/8] (same packing), ``scales`` [K/G, N] -> int4 with group G,
  w = (q - z) * s = q * s + (-z * s).
- GPTQ (``quant_method: gptq``, 4 bits, no act-order): ``qweight`` int32 [K/8, N] (nibble i
  of row r holds input feature 8r + i), ``qzeros`` int32 [K/G, N/8] (sequential nibbles along
  N, stored as z - 1: the format's historic offset), ``scales`` [K/G, N] -> int4.

:func:`convert` returns the float weights the model is built from (each quantized projection
dequantized: the model's shapes and names stay plain) and, per HF weight name, the
quantized form the runner swaps in (engine.quant.quantize_loaded). Static KV cache scales
(``k_scale`` / ``v_scale``, compressed-tensors' ``kv_cache_scheme``) are not weights: the
engine reads them with ``kv_scales checkpoint`` (engine.quant.kv_scales); a checkpoint with
KV scales and float weights is not a pre-quantized checkpoint (:func:`method_of` is None).
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def method_of(qcfg: dict | None) -> str | None:
    """"fp8" / "awq" / "gptq" for a supported quantization_config, None without one."""
    if not qcfg:
        return None
    m = qcfg.get("quant_method")
    if m == "compressed-tensors":
        groups = qcfg.get("config_groups") or {}
        if not groups:  # only a kv_cache_scheme: float weights (engine.quant.kv_scales)
            return None
        for g in groups.values():
            w = g.get("weights") or {}
            if w.get("type") != "float" or w.get("num_bits") != 8:
                raise ValueError(f"compressed-tensors weights {w!r}: only 8-bit float (FP8) "
                                 "is supported")
        return "fp8"
    if m in ("awq", "gptq"):
        if qcfg.get("bits", 4) != 4:
            raise ValueError(f"{m}: only 4-bit checkpoints are supported, got "
                             f"{qcfg.get('bits')} bits")
        if m == "awq" and str(qcfg.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"awq version {qcfg.get('version')!r}: only GEMM packing")
        if m == "gptq" and qcfg.get("desc_act"):
            raise ValueError("gptq with desc_act (act-order) is not supported")
        return m
    raise ValueError(f"unsupported quantization_config quant_method {m!r} (supported: "
                     "compressed-tensors FP8, awq, gptq)")


def _unpack(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: nibble i of packed column j -> column 8j + order[i]."""
    r, c = packed.shape
    out = torch.empty(r, c, 8, dtype=torch.uint8)
    p = packed.to(torch.int64) & 0xFFFFFFFF
    for i, col in enumerate(order):
        out[:, :, col] = ((p >> (4 * i)) & 0xF).to(torch.uint8)
    return out.reshape(r, 8 * c)


def _int4(q_nk: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> dict:
    """codes [N, K] 0..15, integer zeros and scales [K/G, N] -> the engine's int4 dict."""
    n, k = q_nk.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group}")
    q = q_nk.to(torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    scale = s.t().float().contiguous()
    zero = (-z.t().float() * scale).contiguous()
    return {"format": "int4", "q": packed, "scale": scale, "zero": zero, "k": k,
            "group": group}


def _from_awq(t: dict, group: int) -> dict:
    q = _unpack(t["qweight"], AWQ_ORDER)  # [K, N]
    z = _unpack(t["qzeros"], AWQ_ORDER)  # [K/G, N]
    return _int4(q.t().contiguous(), z, t["scales"], group)


def _from_gptq(t: dict, group: int) -> dict:
    kq, n = t["qweight"].shape
    q = _unpack(t["qweight"].t().contiguous()).t()  # [K, N]: feature 8r + i of row r
    z = _unpack(t["qzeros"]).to(torch.int16) + 1  # [K/G, N]
    g_idx = t.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(8 * kq) // group):
        raise ValueError("gptq g_idx is not the identity grouping (act-order)")
    return _int4(q.t().contiguous(), z, t["scales"], group)


def _from_fp8(t: dict) -> dict:
    w = t["weight"]
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"compressed-tensors FP8 weight has dtype {w.dtype}")
    s = t["weight_scale"].float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(w.shape[0])
    if s.numel() != w.shape[0]:
        raise ValueError(f"weight_scale of {s.numel()} values for {w.shape[0]} rows (only "
                         "the tensor and channel strategies are supported)")
    return {"format": "fp8", "q": w.contiguous(), "scale": s.contiguous(), "k": w.shape[1]}


def convert(raw: dict[str, torch.Tensor], qcfg: dict, dtype, device: str
            ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(float weights for the model, HF weight name -> quantized dict); see the module."""
    from engine.quant.reference import dequantize
    method = method_of(qcfg)
    group = int(qcfg.get("group_size", 128))
    suffix = {"fp8": ("weight_scale",), "awq": ("qweight",), "gptq": ("qweight",)}[method]
    bases = sorted(n[:-len(suffix[0]) - 1] for n in raw if n.endswith("." + suffix[0]))
    dense: dict[str, torch.Tensor] = {}
    quant: dict[str, dict] = {}
    used: set[str] = set()
    for base in bases:
        names = {k: f"{base}.{k}" for k in ("weight", "weight_scale", "input_scale", "qweight",
                                            "qzeros", "scales", "g_idx")}
        t = {k: raw[v] for k, v in names.items() if v in raw}
        used.update(v for v in names.values() if v in raw)
        if "input_scale" in t:
            logger.info("%s: static input_scale ignored (activations: dynamic per token)", base)
        qw = (_from_fp8(t) if method == "fp8" else _from_awq(t, group) if method == "awq"
              else _from_gptq(t, group))
        quant[base + ".weight"] = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                   for k, v in qw.items()}
        dense[base + ".weight"] = dequantize(qw).to(device=device, dtype=dtype)
    kv_scales = [n for n in raw if n.endswith((".k_scale", ".v_scale",
                                               "k_proj.output_scale", "v_proj.output_scale"))]
    if kv_scales:
        logger.info("%d static KV cache scales in the checkpoint: used with kv_dtype int8 / "
                    "fp8 and kv_scales checkpoint (engine.quant.kv_scales)", len(kv_scales))
    for name, tensor in raw.items():
        if name not in used and name not in kv_scales:
            dense[name] = tensor.to(device=device, dtype=dtype).contiguous()
    if not quant:
        raise ValueError(f"quantization_config says {method} but no tensor is quantized")
    return dense, quant
