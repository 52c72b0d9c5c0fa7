"""Quality metrics of a candidate's next-token distributions against a baseline's.

For each scored position t (predicting token t + 1 of a window):

    nll         -log p(token t+1)                    -> perplexity exp(mean nll)
    kl          KL(baseline || candidate) = sum_v p_b(v) (log p_b(v) - log p_c(v))
    top-1       argmax of the two distributions agree

and for greedy continuations of the same prompts, the tokens generated before the first
divergence (the whole continuation when there is none).
"""
from __future__ import annotations

import math

import torch


def token_stats(base_lp: torch.Tensor, cand_lp: torch.Tensor, targets: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    """Per-position tensors: base/cand nll, kl, top-1 agreement. *_lp: [T, V] log-probs
    of the next token after positions 0..T-1; targets [T]: the actual next tokens."""
    kl = (base_lp.exp() * (base_lp - cand_lp)).sum(-1).clamp_min(0.0)
    return {"base_nll": -base_lp.gather(1, targets[:, None]).squeeze(1),
            "cand_nll": -cand_lp.gather(1, targets[:, None]).squeeze(1),
            "kl": kl, "top1": (base_lp.argmax(-1) == cand_lp.argmax(-1)).float()}


def summarize(parts: list[dict[str, torch.Tensor]]) -> dict:
    cat = {k: torch.cat([p[k] for p in parts]).double() for k in parts[0]}
    kl = cat["kl"]
    return {"tokens": int(kl.numel()),
            "perplexity_base": math.exp(cat["base_nll"].mean().item()),
            "perplexity": math.exp(cat["cand_nll"].mean().item()),
            "kl_mean": kl.mean().item(),
            "kl_p99": torch.quantile(kl, 0.99).item(),
            "kl_max": kl.max().item(),
            "top1_agreement": cat["top1"].mean().item()}


def prefix_agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first position where ``a`` and ``b`` differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def continuation_stats(base: list[list[int]], cand: list[list[int]]) -> dict:
    agree = [prefix_agreement(a, b) for a, b in zip(base, cand)]
    full = sum(1 for a, b, n in zip(base, cand, agree) if n == len(a) == len(b))
    return {"prompts": len(agree), "tokens_each": max((len(a) for a in base), default=0),
            "mean_tokens_before_divergence": sum(agree) / max(1, len(agree)),
            "identical": full, "per_prompt": agree}
