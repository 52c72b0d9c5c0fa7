"""Weight formats of ``--quantization`` and their torch reference kernels (any device).

Every format keeps one output feature per row (``[N, K]`` like ``nn.Linear.weight``):

    int8   weight-only, symmetric, one scale per output channel
           q int8 [N, K], scale float32 [N]                       w = q * scale
    int4   weight-only, asymmetric, groups of GROUP (128) input features per scale
           q uint8 [N, Kp / 2] (Kp: K rounded up to GROUP; byte j holds features 2j in its
           low nibble and 2j + 1 in its high nibble), scale, zero float32 [N, Kp / GROUP]
           w = q * scale + zero   (zero is the group's minimum: AWQ / GPTQ's integer zero
           point z converts to zero = -z * scale)
    fp8    e4m3 weights, one scale per output channel, float32 [N]   w = q * scale
           W8A8 for every call: activations quantized per token (dynamic scale = max|x| /
           448) and multiplied in fp8 (FP8 tensor cores on Hopper for more than
           GEMV_MAX_ROWS tokens, a GEMV that quantizes x itself below), so a token's result
           does not depend on how many others share its call (a weight-only decode once
           made a request's logits change with the batch and with CUDA-graph padding)

The reference matmuls dequantize to float32 and use one plain matmul, so a GPU kernel can be
checked against them; the CPU runs them as its kernels (quality is what the CPU measures).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
GEMV_MAX_ROWS = 8  # calls of at most this many tokens run as GEMVs (engine.quant.kernels)
FORMATS = ("int8", "int4", "fp8")

__all__ = ["GROUP", "FP8_MAX", "GEMV_MAX_ROWS", "FORMATS", "quantize_int8", "quantize_int4",
           "quantize_fp8", "dequantize", "gemv_keywords", "quant_act_fp8", "quant_matmul_ref",
           "weight_bytes"]


def quantize_int8(w: torch.Tensor) -> dict:
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"format": "int8", "q": q.contiguous(), "scale": scale.contiguous(),
            "k": w.shape[1]}


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> dict:
    n, k = w.shape
    kp = -(-k // group) * group
    w = w.float()
    g = F.pad(w, (0, kp - k)).view(n, kp // group, group)
    # the pad's zeros must not widen the last group's range: take min / max over real values
    real = (torch.arange(kp, device=w.device) < k).view(1, kp // group, group)
    lo = torch.where(real, g, torch.inf).amin(dim=2)
    hi = torch.where(real, g, -torch.inf).amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = pack_int4(q.view(n, kp))
    return {"format": "int4", "q": packed, "scale": scale.contiguous(), "zero": lo.contiguous(),
            "k": k, "group": group}


def quantize_fp8(w: torch.Tensor) -> dict:
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"format": "fp8", "q": q.contiguous(), "scale": scale.contiguous(), "k": w.shape[1]}


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8}


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, Kp] (0..15) -> uint8 [N, Kp/2] (feature 2j low nibble, 2j+1 high)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp/2] -> uint8 [N, Kp] (feature 2j from the low nibble, 2j+1 the high)."""
    n, half = packed.shape
    out = torch.empty(n, half, 2, dtype=torch.uint8, device=packed.device)
    out[..., 0] = packed & 0x0F
    out[..., 1] = packed >> 4
    return out.view(n, 2 * half)


def dequantize(qw: dict) -> torch.Tensor:
    """The float32 weight [N, K] a quantized one stands for."""
    f = qw["format"]
    if f in ("int8", "fp8"):
        return qw["q"].float() * qw["scale"][:, None]
    if f == "int4":
        q = unpack_int4(qw["q"]).float()
        n, kp = q.shape
        group = qw["group"]
        w = q.view(n, kp // group, group) * qw["scale"][..., None] + qw["zero"][..., None]
        return w.view(n, kp)[:, :qw["k"]]
    raise ValueError(f"unknown weight format {f!r}")


def gemv_keywords(qw: dict) -> dict:
    """The engine.kernels.matvec.gemv keywords of a quantized weight (its codes go as the
    weight argument)."""
    kw = {"w_format": qw["format"], "w_scale": qw["scale"]}
    if qw["format"] == "fp8":
        kw["a8"] = True  # W8A8 in every call (the module docstring)
    if qw["format"] == "int4":
        kw.update(w_zero=qw["zero"], group=qw["group"])
    return kw


def quant_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic fp8 quantization: (xq float8_e4m3fn [M, K], scale float32 [M, 1])."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quant_matmul_ref(x: torch.Tensor, qw: dict, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) in float32, W as the format says; returns x's dtype."""
    if qw["format"] == "fp8":
        xq, sx = quant_act_fp8(x)
        y = (xq.float() @ qw["q"].float().t()) * sx * qw["scale"][None, :]
    else:
        y = x.float() @ dequantize(qw).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def weight_bytes(qw: dict) -> int:
    """Bytes a quantized weight holds (codes and scales)."""
    return sum(t.numel() * t.element_size() for t in qw.values() if isinstance(t, torch.Tensor))
