"""RMSNorm (torch reference path; the GPU path swaps in the fused Triton kernel)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused = False  # GPU: one Triton kernel (engine.kernels), set by the model runner

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rmsnorm(x)``; with ``residual``: returns ``(rmsnorm(x + residual), x + residual)``."""
        if self.fused:
            from engine.kernels.elementwise import fused_add_rmsnorm, rmsnorm
            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
