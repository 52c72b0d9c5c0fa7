"""Rotary position embeddings (HF "rotate_half" convention), incl. Llama-3 frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position; ``forward`` rotates q and k by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim = head_dim
        self.fused = False  # GPU: rotate q/k in place with one Triton kernel
        self._memo = None  # (positions, dtype, cos, sin) of the current step
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_position, head_dim] fp32: cos in the first half of the last dim, sin in the
        # second. A plain attribute, not a buffer, so casting the model never rounds it.
        self.cos_sin_cache = torch.cat((emb.cos()[:, :head_dim // 2], emb.sin()[:, :head_dim // 2]), -1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        cs = self.cos_sin_cache.index_select(0, positions)
        half = self.head_dim // 2
        cos, sin = cs[:, :half], cs[:, half:]
        cos = torch.cat((cos, cos), -1).to(dtype)
        sin = torch.cat((sin, sin), -1).to(dtype)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated copies (fused: rotated in place)."""
        if self.fused:
            from engine.kernels.elementwise import rotary_embedding
            rotary_embedding(positions, q, k, self.cos_sin_cache)
            return q, k
        # every layer of a step passes the same positions tensor: compute cos/sin once
        memo = self._memo
        if memo is None or memo[0] is not positions or memo[1] != q.dtype:
            cos, sin = self.cos_sin(positions, q.dtype)
            memo = self._memo = (positions, q.dtype, cos.unsqueeze(1), sin.unsqueeze(1))
        cos, sin = memo[2], memo[3]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
