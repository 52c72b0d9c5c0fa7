"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token logprobs.

Seeded requests draw from their own ``torch.Generator`` seeded once with the request's seed, so
a request's samples do not depend on what else is in the batch. Unseeded requests share the
engine's generator. Sampling is done by the exponential-race trick: ``argmax(p / E)`` with
``E ~ Exp(1)`` picks index ``i`` with probability ``p_i``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    generators: list[torch.Generator | None]  # per row: its own generator, or None (shared)
    want_logprobs: bool

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)


class Sampler:
    def __init__(self, shared_generator: torch.Generator):
        self.shared = shared_generator

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch):
        """logits [B, V] -> (token ids [B] on the host as a list, logprobs list or None)."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy
        else:
            tokens = greedy.clone()
            for i, t in enumerate(batch.temperatures):
                if t == 0.0:
                    continue
                tokens[i] = self._sample_row(logits[i], t, batch.top_ks[i], batch.top_ps[i],
                                             batch.generators[i] or self.shared)
        logprobs = None
        if batch.want_logprobs:
            lp = torch.log_softmax(logits, dim=-1)
            logprobs = lp.gather(1, tokens.view(-1, 1)).view(-1).tolist()
        return tokens.tolist(), logprobs

    @staticmethod
    def _sample_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    gen: torch.Generator) -> int:
        row = row / temperature
        if top_k and top_k < row.numel():
            kth = torch.topk(row, top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if top_p < 1.0:
            sp, idx = probs.sort(descending=True)
            cum = sp.cumsum(0)
            # keep the smallest prefix whose mass reaches top_p (always keep the first)
            drop = (cum - sp) >= top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sp)
        e = torch.empty_like(probs).exponential_(generator=gen)
        return int((probs / e).argmax())
