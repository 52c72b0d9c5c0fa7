"""GPTQ: weight rounding that compensates its own error (Frantar et al., 2022).

Round-to-nearest quantizes every weight alone. GPTQ quantizes a projection's input features
one after another and spreads each one's rounding error over the features not yet quantized,
weighted by the inverse of the layer's input second moment ``H = sum x x^T`` over calibration
tokens, so the projection's *output* on such inputs moves least. The formats are those of
engine/quant/reference.py, bit for bit (int4: asymmetric groups, a group's scale and minimum
taken from its weights as they stand when the group is reached; int8 and fp8: one scale per
output channel from the original weights; fp8 rounds to the nearest e4m3 value), so every
kernel runs the result unchanged.

It runs where its inputs are: the Hessians accumulate on the device of the activations and
:func:`gptq_quantize` rounds on the device of the weight (the engine's; bench/gptq_gpu.py
times it at Llama-3-8B shapes). Features are taken in blocks of ``BLOCK`` (the paper's lazy
batch): a feature's error updates only the rest of its block, and the features after the
block take the block's errors in one matrix product. Within a block each feature is a few
kernels on N values, without a device-to-host read.

:class:`HessianCollector` accumulates ``H`` for every projection from forward pre-hooks;
:func:`gptq_quantize` rounds one weight. engine.quant.calibrate wires them to an engine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.reference import FP8_MAX, GROUP, pack_int4

BLOCK = 128  # input features updated together (the lazy batch of the paper)
DAMP = 0.01  # added to H's diagonal, as a fraction of its mean (numerical safety)


class HessianCollector:
    """``H`` [K, K] and the token count of every module it hooks, on the activations' device:
    float64 on the CPU; float32 on a GPU (half the memory of float64, which a Llama-3-8B's 128
    projections need: 33 GB; each call's product is one float32 GEMM, TF32 off as is torch's
    default) unless ``dtype`` says otherwise."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.h: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self._handles = []

    def hook(self, name: str, module: torch.nn.Module) -> None:
        def pre(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            x = x.to(self.dtype or (torch.float64 if x.device.type == "cpu"
                                    else torch.float32))
            h = self.h.get(name)
            self.h[name] = x.t() @ x if h is None else h.addmm_(x.t(), x)
            self.tokens[name] = self.tokens.get(name, 0) + x.shape[0]
        self._handles.append(module.register_forward_pre_hook(pre))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _inverse_factor(h: torch.Tensor, damp: float, dtype: torch.dtype) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 (H damped; features never seen get a unit row), in
    ``dtype`` on H's device."""
    h = h.to(dtype, copy=True)
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(hinv, upper=True)


def _int4_params(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of one group [N, g] as quantize_int4 takes them (in float32, the
    precision they are stored in), returned in ``dtype``."""
    w = w.float()
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    return ((hi - lo) / 15.0).clamp_min(1e-12).to(dtype), lo.to(dtype)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, fmt: str, group: int = GROUP,
                  damp: float = DAMP, act_order: bool = True,
                  dtype: torch.dtype = torch.float64) -> dict:
    """``w`` [N, K] rounded to ``fmt`` (int4 | int8 | fp8) by GPTQ with input second moment
    ``h`` [K, K]; returns the quantized dict of engine/quant/reference.py, on ``w``'s device
    (``h`` is moved there).

    ``act_order``: features are taken largest ``H`` diagonal first (the inputs that move the
    output most are rounded while the most features are left to absorb their error); int4
    groups then keep their contiguous features and take their range from the weights before
    any update (static groups), so the format stays the kernels'. Without it, features go
    in order and a group's range is taken from its weights as they stand when it is reached.
    ``dtype``: the precision of the updates and of H's inverse (float64 on any device, what
    pdserve quantize uses; bench/gptq_gpu.py measures float32 against it)."""
    if fmt not in ("int4", "int8", "fp8"):
        raise ValueError(f"GPTQ rounds int4, int8 and fp8 weights, not {fmt!r}")
    n, k = w.shape
    if h.shape != (k, k):
        raise ValueError(f"H is {tuple(h.shape)}, the weight has {k} input features")
    dev = w.device
    h = h.to(dev)
    w = w.to(dtype, copy=True)
    w[:, torch.diagonal(h) == 0] = 0.0  # features never seen: any value, 0 is cheapest
    order = (torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order
             else torch.arange(k, device=dev))
    cols = order.tolist()  # a host copy: indexing a device tensor per feature would sync
    scale, zero, codes = _grid(w, fmt, group, static=act_order)
    wp = w[:, order]
    u = _inverse_factor(h[order][:, order], damp, dtype)
    q = torch.empty(n, k, dtype=dtype, device=dev)  # the codes' values
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        wb, err = wp[:, b0:b1].clone(), torch.empty(n, b1 - b0, dtype=dtype, device=dev)
        ub = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            f = cols[b0 + i]
            if not act_order and fmt == "int4" and f % group == 0:
                # the group's range as its weights stand now (earlier errors folded in)
                g1 = min(f + group, k)
                cur = torch.cat([wb[:, i:], wp[:, b1:g1]], dim=1)[:, :g1 - f]
                scale[:, f // group], zero[:, f // group] = _int4_params(cur, dtype)
            s, z = (scale, zero) if fmt != "int4" else (scale[:, f // group],
                                                        zero[:, f // group])
            code = (wb[:, i] - z) / s
            if fmt == "fp8":
                q[:, f] = code.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            else:  # rounded straight into q (on a GPU each kernel launch counts)
                torch.round(code, out=q[:, f]).clamp_(*codes)
            e = torch.div(wb[:, i] - (q[:, f] * s + z), ub[i, i], out=err[:, i])
            # column i itself is done: only the block's later features take its error
            wb[:, i + 1:] -= e[:, None] * ub[i, i + 1:][None, :]
        wp[:, b1:] -= err @ u[b0:b1, b1:]
    return _pack(q, scale, zero, fmt, k, group)


def _grid(w: torch.Tensor, fmt: str, group: int, static: bool):
    """(scale, zero, (lowest code, highest code)) in ``w``'s dtype and device: int8 and fp8
    one scale per row from the original weights (as quantize_int8 / quantize_fp8 take it);
    int4 per group, from the original weights when ``static`` (else filled in as the groups
    are reached)."""
    n, k = w.shape
    like = {"dtype": w.dtype, "device": w.device}
    if fmt in ("int8", "fp8"):
        top = 127.0 if fmt == "int8" else FP8_MAX
        scale = (w.float().abs().amax(dim=1).clamp_min(1e-12) / top).to(w.dtype)
        return scale, torch.zeros(n, **like), (-top, top)
    ng = -(-k // group)
    scale = torch.empty(n, ng, **like)
    zero = torch.empty(n, ng, **like)
    if static:
        for g in range(ng):
            scale[:, g], zero[:, g] = _int4_params(w[:, g * group:(g + 1) * group], w.dtype)
    return scale, zero, (0, 15)


def _pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: str, k: int,
          group: int) -> dict:
    if fmt in ("int8", "fp8"):
        dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
        return {"format": fmt, "q": q.to(dtype).contiguous(),
                "scale": scale.float().contiguous(), "k": k}
    kp = -(-k // group) * group
    codes = F.pad(q, (0, kp - k)).to(torch.uint8)  # padding codes 0: weight = the group's min
    return {"format": "int4", "q": pack_int4(codes), "scale": scale.float().contiguous(),
            "zero": zero.float().contiguous(), "k": k, "group": group}
