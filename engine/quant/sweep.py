"""``pdserve quantize --plan``: per-projection sensitivity sweep -> a mixed-precision plan.

Each projection of each decoder layer (engine.quant.plan names) is quantized ALONE to the low
format (int4 by default) in the loaded float model, the tune windows are scored again
(LLMEngine.score), and its sensitivity is the mean KL divergence of the next-token
distributions against the float model's; the projection is then restored. The plan keeps the
projections with the most KL per extra byte in the high format (int8 by default) while the
whole model's weight bytes (embeddings and head counted) stay within ``budget`` (0.15: 15%
more than the model with every projection in the low format). A tool, not a CI test: its
cost is one scoring pass per projection.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.quant import projections, model_weight_bytes
from engine.quant.linear import QuantLinear
from engine.quant.plan import QuantPlan
from engine.quant.reference import QUANTIZERS, weight_bytes

logger = logging.getLogger(__name__)


def _kl(base_lp: torch.Tensor, lp: torch.Tensor) -> float:
    return (base_lp.exp() * (base_lp - lp)).sum(-1).clamp_min(0).mean().item()


def format_bytes(weight: torch.Tensor, fmt: str) -> int:
    if fmt == "none":
        return weight.numel() * weight.element_size()
    return weight_bytes(QUANTIZERS[fmt](weight))


def sweep(engine, windows: list[list[int]], low: str = "int4", high: str = "int8",
          budget: float = 0.15, progress=None) -> QuantPlan:
    """Measure every projection of ``engine``'s (float, eager) model; return the plan."""
    model = engine.runner.model
    base = [engine.score(w) for w in windows]
    rows, total_low = [], model_weight_bytes(model)
    t0 = time.perf_counter()
    for name, parent, attr in list(projections(model)):
        lin = getattr(parent, attr)
        if isinstance(lin, QuantLinear):
            raise ValueError("the sweep starts from an unquantized model (quantization none)")
        b_none, b_low, b_high = (format_bytes(lin.weight, f) for f in ("none", low, high))
        total_low += b_low - b_none
        setattr(parent, attr, QuantLinear.from_linear(lin, low))
        try:
            kl = sum(_kl(b, engine.score(w)) for b, w in zip(base, windows)) / len(windows)
        finally:
            setattr(parent, attr, lin)
        rows.append({"name": name, "kl": kl, "extra_bytes": b_high - b_low})
        if progress:
            progress(f"{name}: KL {kl:.5f} ({len(rows)} done, "
                     f"{time.perf_counter() - t0:.0f}s)")
    return select_plan(rows, total_low, low, high, budget, engine.model_id,
                       tokens=sum(len(w) for w in windows))


def select_plan(rows: list[dict], total_low: int, low: str, high: str, budget: float,
                model: str | None = None, tokens: int = 0) -> QuantPlan:
    """Projections by KL per extra byte, most first, into ``high`` while the bytes allow."""
    allowed = budget * total_low
    chosen, spent = {}, 0
    for r in sorted(rows, key=lambda r: r["kl"] / max(1, r["extra_bytes"]), reverse=True):
        if spent + r["extra_bytes"] <= allowed:
            chosen[r["name"]] = high
            spent += r["extra_bytes"]
    meta = {"low": low, "high": high, "budget": budget, "tokens": tokens,
            "bytes_all_low": total_low, "bytes_plan": total_low + spent, "rows": rows,
            "sensitivity_kl": {r["name"]: r["kl"] for r in rows}}
    return QuantPlan(default=low, layers=chosen, model=model, meta=meta)
