"""QuantLinear: the module a quantized projection becomes (a module swap after loading, like
gpt-fast's: the model file stays plain).

It holds the codes and scales of one format (engine.quant.reference) as buffers and picks
its kernel by device: on a GPU the Triton kernels of engine.quant.kernels (FP8 GEMMs through
torch._scaled_mm), on the CPU the torch reference, whose float32 codes (int4: the
dequantized weight) are kept after the first call (the CPU measures quality, not speed:
the same values, computed once).
"""
from __future__ import annotations

import torch
from torch import nn

import engine.quant.reference as ref


class QuantLinear(nn.Module):
    def __init__(self, qw: dict, bias: torch.Tensor | None, out_features: int):
        super().__init__()
        self.format = qw["format"]
        self.in_features = qw["k"]
        self.out_features = out_features
        self.group = qw.get("group", 0)
        self.register_buffer("q", qw["q"])
        self.register_buffer("scale", qw["scale"])
        self.register_buffer("zero", qw.get("zero"))
        self.register_buffer("bias", bias)
        self._dense: torch.Tensor | None = None  # CPU: the dequantized weight, once

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> "QuantLinear":
        qw = ref.QUANTIZERS[fmt](linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qw, bias, linear.out_features)

    def qweight(self) -> dict:
        d = {"format": self.format, "q": self.q, "scale": self.scale, "k": self.in_features}
        if self.format == "int4":
            d.update(zero=self.zero, group=self.group)
        return d

    def gemv_args(self) -> tuple[torch.Tensor, dict]:
        """(codes, keywords) for engine.kernels.matvec.gemv (one-token projections)."""
        return self.q, ref.gemv_keywords(self.qweight())

    def prologue_forward(self, prologue: str, x: torch.Tensor,
                         residual: torch.Tensor | None = None, norm=None):
        """self(prologue(x)) with the prologue fused where this format and call have a kernel
        for it (fp8 on a GPU, more than one row: the row-wise kernel writes the activation
        codes, engine.quant.kernels.fp8_prologue_linear); None elsewhere (the caller runs the
        prologue, then this module; one row takes the GEMV and its fused prologues). "rmsnorm" (``norm`` an RMSNorm) ->
        (y, x + residual, or None without a residual); "silu_mul" -> y."""
        if self.format != "fp8" or not x.is_cuda or x.dim() != 2 or x.shape[0] <= 1:
            return None
        from engine.quant.kernels import fp8_prologue_linear
        if prologue == "rmsnorm":
            return fp8_prologue_linear(self.qweight(), self.bias, "rmsnorm", x.contiguous(),
                                       residual, norm.weight, norm.eps)
        return fp8_prologue_linear(self.qweight(), self.bias, prologue, x.contiguous())

    @property
    def weight_bytes(self) -> int:
        return ref.weight_bytes(self.qweight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:
            from engine.quant.kernels import quant_linear
            y = quant_linear(x2, self.qweight(), self.bias)
        else:
            y = self._cpu(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is None:  # int8 / fp8: the codes as float32 (scaled below); int4: w
            self._dense = (ref.dequantize(self.qweight()) if self.format == "int4"
                           else self.q.float())
        if self.format == "int4":
            y = x.float() @ self._dense.t()
        elif self.format == "fp8":  # W8A8 in every call (engine.quant.reference)
            xq, sx = ref.quant_act_fp8(x)
            y = (xq.float() @ self._dense.t()) * sx * self.scale[None, :]
        else:
            y = (x.float() @ self._dense.t()) * self.scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.format}"
