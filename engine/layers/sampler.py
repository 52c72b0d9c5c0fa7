"""Token sampling: logits processors, then greedy or a seeded draw, with logprobs.

Per step, for the rows that sample (one per sequence), in this order:
  1. ``logit_bias``: added to the named tokens' logits.
  2. ``min_tokens``: EOS and ``stop_token_ids`` get -inf while fewer tokens were generated.
  3. repetition penalty (Keskar et al., as transformers' RepetitionPenaltyLogitsProcessor):
     each token seen in the prompt or output has its logit divided by the penalty when
     positive, multiplied when not.
  4. frequency / presence penalties (OpenAI): ``logit -= frequency * count + presence *
     (count > 0)``, counts over the output tokens.
  4b. structured output: each constrained row's matcher (engine.grammar) writes its
     next-token bitmask (on the host, all rows at once on the grammar engine's threads; on a
     GPU while the forward pass runs); one kernel (engine.kernels.apply_token_bitmask) reads
     the copied words and gives the tokens they forbid -inf. Unconstrained rows are neither
     copied nor read for it.
  Chosen-token logprobs and ``top_logprobs`` are those of this processed distribution
  (log-softmax, before temperature); a request without controls gets the raw model's.
  5. greedy rows: argmax. Sampled rows: temperature, top-k, top-p, min_p (probability below
     ``min_p`` x the top one), then the exponential race ``argmax(p / E)`` with
     ``E ~ Exp(1)``, which picks index ``i`` with probability ``p_i``.

Every step is batched tensor work with no host synchronisation: per-row parameters are
copied to the device (pinned, non-blocking), penalty counts are a scatter-add of the rows'
token ids, and the results stay on the device until :meth:`SampleOutput.to_host` is read.
Rows without a control pay nothing for it (each stage runs on the rows that use it).

Seeded rows draw their exponentials (one per vocabulary entry per sample) as a pure function
of the request's seed and step, so its samples do not depend on what else is in the batch:
on a GPU from the counter-based RNG of engine.kernels (``counters``: one launch for every
seeded row of the step), on the CPU from a ``torch.Generator`` of their own. Unseeded rows
share the engine's generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step (row i: the i-th sampled sequence)."""
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    generators: list[torch.Generator | None]  # per row: its own generator, or None (shared)
    want_logprobs: bool
    min_ps: list[float] = field(default_factory=list)  # empty: none
    top_logprobs: list[int] = field(default_factory=list)  # empty: none
    # (row, token, value) of every logit_bias entry
    bias: list[tuple[int, int, float]] = field(default_factory=list)
    # (row, token) masked to -inf (min_tokens not reached: EOS and stop tokens)
    banned: list[tuple[int, int]] = field(default_factory=list)
    # rows with a penalty: (row, presence, frequency, repetition, token ids (prompt then
    # output, an int64 array), number of prompt tokens)
    penalties: list[tuple[int, float, float, float, np.ndarray, int]] = \
        field(default_factory=list)
    # constrained rows: (row, engine.grammar.Matcher); the masks are computed by the sampler
    masks: list[tuple[int, object]] = field(default_factory=list)
    # per row (empty: none): (seed, step) of a seeded row whose exponentials come from the
    # counter-based RNG (a GPU's: engine.kernels.seeded_exponentials, one launch for every
    # such row) instead of a generator of its own; step = tokens it generated before
    counters: list[tuple[int, int] | None] = field(default_factory=list)

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)

    @property
    def processed(self) -> bool:
        """Some row's logits change before the argmax / draw."""
        return bool(self.bias or self.banned or self.penalties or self.masks)

    @property
    def argmax_only(self) -> bool:
        """The tokens are the argmax of the (processed) logits and nothing else is asked for."""
        return self.all_greedy and not self.want_logprobs and not any(self.top_logprobs)

    @property
    def masks_only(self) -> bool:
        """Argmax only, and no processing but structured output's masks (masked_greedy)."""
        return self.argmax_only and not (self.bias or self.banned or self.penalties)

    @property
    def plain(self) -> bool:
        """The tokens are the argmax of the raw logits and nothing else is asked for."""
        return self.argmax_only and not self.processed

    @classmethod
    def from_seqs(cls, seqs, generators: list, eos_token_ids,
                  counters: list | None = None) -> "SamplingBatch":
        """``seqs``: engine Sequences (sampling, token_ids, num_prompt_tokens)."""
        b = cls([], [], [], list(generators), False, counters=list(counters or []))
        any_min_p = any(s.sampling.min_p for s in seqs)
        any_top = any(s.sampling.top_logprobs for s in seqs)
        for i, s in enumerate(seqs):
            sp = s.sampling
            b.temperatures.append(sp.temperature)
            b.top_ks.append(sp.top_k)
            b.top_ps.append(sp.top_p)
            b.want_logprobs |= sp.logprobs
            if any_min_p:
                b.min_ps.append(sp.min_p)
            if any_top:
                b.top_logprobs.append(sp.top_logprobs)
            if sp.plain:
                continue
            b.bias.extend((i, t, v) for t, v in sp.logit_bias)
            if sp.min_tokens and len(s.token_ids) - s.num_prompt_tokens < sp.min_tokens:
                stops = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    stops |= set(eos_token_ids)
                b.banned.extend((i, t) for t in sorted(stops))
            if sp.penalized:
                b.penalties.append((i, sp.presence_penalty, sp.frequency_penalty,
                                    sp.repetition_penalty, _token_array(s),
                                    s.num_prompt_tokens))
            matcher = getattr(s, "matcher", None)
            if matcher is not None:
                b.masks.append((i, matcher))
        return b


@dataclass
class SampleOutput:
    """One step's samples, on the device until :meth:`to_host`."""
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32
    top_ids: torch.Tensor | None = None  # [B, K] int64 (K: the batch's largest top_logprobs)
    top_lps: torch.Tensor | None = None  # [B, K] float32
    top_k: list[int] | None = None  # per row: how many of the K it asked for
    event: object = None  # GPU: completes once the pinned host copies have landed

    def start_copy(self) -> None:
        """Queue the copies to pinned host memory (GPU); :meth:`to_host` waits for them."""
        if self.tokens.device.type != "cuda":
            return
        names = ("tokens", "logprobs", "top_ids", "top_lps")
        for name in names:
            t = getattr(self, name)
            if t is not None:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                setattr(self, name, host)
        self.event = torch.cuda.Event()
        self.event.record()

    def to_host(self) -> tuple[list[int], list[float] | None, list | None]:
        """(tokens, chosen-token logprobs or None, per row top list or None)."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.tokens.tolist()
        lps = self.logprobs.tolist() if self.logprobs is not None else None
        tops = None
        if self.top_ids is not None:
            ids, vals = self.top_ids.tolist(), self.top_lps.tolist()
            tops = [list(zip(ids[r][:k], vals[r][:k])) if k else None
                    for r, k in enumerate(self.top_k)]
        return tokens, lps, tops


def _token_array(seq) -> np.ndarray:
    if hasattr(seq, "token_array"):  # engine Sequences keep it incrementally
        return seq.token_array()
    return np.asarray(seq.token_ids, dtype=np.int64)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (sampling.n > 1):
    sample 0 uses the request's seed, so n = 1 is unchanged; the others a stream of their
    own, the same whatever else runs."""
    if index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


def _dev(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without a blocking copy (pinned staging on a GPU)."""
    t = torch.as_tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _flat_index(rows, tokens, width: int, device) -> torch.Tensor:
    idx = np.asarray(rows, dtype=np.int64) * width + np.asarray(tokens, dtype=np.int64)
    return _dev(idx, torch.int64, device)


TOP_P_CANDIDATES = 1024  # CPU top-p: tokens sorted first (see _top_p_drop)


class Sampler:
    def __init__(self, shared_generator: torch.Generator):
        self.shared = shared_generator

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """logits [B, V] -> the step's samples (on the device; see SampleOutput)."""
        scores = self.process(logits, batch)
        tokens = scores.argmax(dim=-1)
        sampled = [i for i, t in enumerate(batch.temperatures) if t != 0.0]
        if sampled:
            tokens = self._draw(scores, tokens, sampled, batch)
        out = SampleOutput(tokens)
        k = max(batch.top_logprobs, default=0)
        if batch.want_logprobs or k:
            lp = torch.log_softmax(scores, dim=-1)
            out.logprobs = lp.gather(1, tokens.view(-1, 1)).view(-1)
            if k:
                out.top_lps, out.top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
                out.top_k = batch.top_logprobs
        return out

    @staticmethod
    def process(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 1-4 of the module docstring: fp32 scores [B, V] (a new tensor when any row
        changes; ``logits`` itself is never written)."""
        x = logits.float()
        if not batch.processed:
            return x
        if x is logits:
            x = x.clone()
        B, V = x.shape
        dev = x.device
        flat = x.view(-1)
        if batch.bias:
            rows, toks, vals = zip(*batch.bias)
            flat.index_add_(0, _flat_index(rows, toks, V, dev), _dev(vals, torch.float32, dev))
        if batch.banned:
            rows, toks = zip(*batch.banned)
            flat.index_fill_(0, _flat_index(rows, toks, V, dev), float("-inf"))
        if batch.penalties:
            _apply_penalties(x, batch.penalties)
        if batch.masks:
            apply_masks(x, batch.masks)
        return x

    def _draw(self, scores: torch.Tensor, tokens: torch.Tensor, rows: list[int],
              batch: SamplingBatch) -> torch.Tensor:
        """Tokens of the sampled ``rows`` (step 5), written into ``tokens``."""
        dev = scores.device
        idx = _dev(rows, torch.int64, dev)
        temps = _dev([batch.temperatures[i] for i in rows], torch.float32, dev)
        w = scores.index_select(0, idx) / temps.view(-1, 1)
        w = warp(w, [batch.top_ks[i] for i in rows], [batch.top_ps[i] for i in rows],
                 [batch.min_ps[i] for i in rows] if batch.min_ps else [])
        probs = torch.softmax(w, dim=-1)
        e = torch.empty_like(probs)
        counted = [j for j, i in enumerate(rows)
                   if batch.counters and batch.counters[i] is not None]
        shared = [j for j, i in enumerate(rows) if batch.generators[i] is None
                  and not (batch.counters and batch.counters[i] is not None)]
        if len(shared) == len(rows):
            e.exponential_(generator=self.shared)
        else:
            if counted:
                from engine.kernels import seeded_exponentials
                seeds, steps = zip(*(batch.counters[rows[j]] for j in counted))
                drawn = seeded_exponentials(_dev(seeds, torch.int64, dev),
                                            _dev(steps, torch.int64, dev), probs.shape[1])
                if len(counted) == len(rows):
                    e = drawn
                else:
                    e.index_copy_(0, _dev(counted, torch.int64, dev), drawn)
            for j, i in enumerate(rows):
                g = batch.generators[i]
                if g is not None:
                    e[j].exponential_(generator=g)
            if shared:
                sh = torch.empty((len(shared), probs.shape[1]), device=dev)
                sh.exponential_(generator=self.shared)
                e.index_copy_(0, _dev(shared, torch.int64, dev), sh)
        picked = (probs / e).argmax(dim=-1)
        return tokens.index_copy(0, idx, picked)


def warp(w: torch.Tensor, top_ks: list[int], top_ps: list[float],
         min_ps: list[float]) -> torch.Tensor:
    """Temperature-scaled logits [R, V] with top-k, top-p and min_p applied (-inf outside)."""
    R, V = w.shape
    dev = w.device
    ninf = float("-inf")
    ks = [k if 0 < k < V else 0 for k in top_ks]
    if any(ks):
        kmax = max(ks)
        top = torch.topk(w, kmax, dim=-1).values
        kth = top.gather(1, _dev([max(k, 1) - 1 for k in ks], torch.int64, dev).view(-1, 1))
        off = _dev([k == 0 for k in ks], torch.bool, dev).view(-1, 1)
        w = w.masked_fill((w < kth) & ~off, ninf)
    if any(p < 1.0 for p in top_ps):
        w = w.masked_fill(_top_p_drop(torch.softmax(w, dim=-1), top_ps), ninf)
    if any(min_ps):
        probs = torch.softmax(w, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * _dev(min_ps, torch.float32, dev).view(-1, 1)
        w = w.masked_fill(probs < floor, ninf)
    return w


def _nucleus_drop(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Which of ``probs`` [R, n] (sorted descending) fall outside the smallest prefix whose
    mass reaches top_p (the first always stays)."""
    return (probs.cumsum(dim=-1) - probs) >= top_ps.view(-1, 1)


def _top_p_drop(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """The top-p mask [R, V] (True: dropped). A full sort of each row, except on the CPU,
    where sorting 10^5 entries per row dominates a sampled step: a row whose
    TOP_P_CANDIDATES most likely tokens already hold top_p of the mass sorts only those
    (everything after them is dropped either way); which way a row goes depends on that
    row alone, so a seeded row's mask does not depend on the batch."""
    R, V = probs.shape
    tp = _dev(top_ps, torch.float32, probs.device)
    on = _dev([p < 1.0 for p in top_ps], torch.bool, probs.device).view(-1, 1)  # top_p 1: off
    k = TOP_P_CANDIDATES
    if probs.device.type != "cpu" or V <= 2 * k:
        sp, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order,
                                                                  _nucleus_drop(sp, tp))
        return drop & on
    cand, idx = probs.topk(k, dim=-1)  # sorted, descending
    short = [i for i, (p, mass) in enumerate(zip(top_ps, cand.sum(dim=-1).tolist()))
             if p < 1.0 and mass < p]  # (the CPU: reading it costs no sync)
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, idx, _nucleus_drop(cand, tp))
    if short:  # too flat: these rows sort everything
        rows = torch.tensor(short)
        sp, order = probs[rows].sort(dim=-1, descending=True)
        drop[rows] = torch.zeros_like(sp, dtype=torch.bool).scatter_(
            1, order, _nucleus_drop(sp, tp[rows]))
    return drop & on


def _bitmasks(rows: list[tuple[int, object]], vocab: int, pin: bool) -> torch.Tensor:
    """The constrained rows' next-token bitmasks [R, ceil(V / 32)] int32, filled on the host
    by the grammar engine's threads (pinned for a copy to a GPU)."""
    from engine.grammar import fill_bitmasks
    host = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32, pin_memory=pin)
    fill_bitmasks([m for _, m in rows], host)
    return host


def apply_masks(x: torch.Tensor, rows: list[tuple[int, object]]) -> None:
    """Step 4b on the constrained ``rows`` of ``x`` [B, V], in place."""
    V = x.shape[1]
    dev = x.device
    host = _bitmasks(rows, V, pin=dev.type == "cuda")
    ordered = len(rows) == x.shape[0] and all(r == j for j, (r, _) in enumerate(rows))
    if dev.type == "cpu":  # one C pass: bits (little-endian words) -> bools
        bits = np.unpackbits(host.numpy().view(np.uint8), axis=1, bitorder="little")
        forbid = torch.from_numpy(bits[:, :V]) == 0
        if ordered:
            x.masked_fill_(forbid, float("-inf"))
            return
        idx = torch.tensor([r for r, _ in rows], dtype=torch.int64)
        x.index_copy_(0, idx, x.index_select(0, idx).masked_fill_(forbid, float("-inf")))
        return
    # on a GPU: one copy of the words, one kernel (a torch unpack took 4-7 launches a step)
    on_dev = host.to(dev, non_blocking=True)
    idx = None if ordered else _dev([r for r, _ in rows], torch.int32, dev)
    _bitmask_fn()(x, on_dev, idx)


def masked_greedy(logits: torch.Tensor, greedy: torch.Tensor,
                  batch: SamplingBatch) -> SampleOutput:
    """The tokens of a batch whose only processing is structured output's masks
    (``batch.masks_only``), given ``greedy`` [B], the argmax of the raw ``logits`` [B, V]
    that the forward pass computed anyway: the unconstrained rows keep it, the constrained
    rows take their masked argmax (engine.kernels.masked_argmax, one launch). Equal to
    ``Sampler()(logits, batch).tokens``, without a float copy of every row's logits or a
    second argmax over them. Needs Triton (a GPU, or the interpreter)."""
    from engine.kernels import masked_argmax
    tokens = greedy.clone()
    if batch.masks:
        dev = logits.device
        bits = _bitmasks(batch.masks, logits.shape[1], pin=dev.type == "cuda")
        masked_argmax(logits, bits.to(dev, non_blocking=True),
                      _dev([r for r, _ in batch.masks], torch.int32, dev), tokens)
    return SampleOutput(tokens)


_BITMASK_FN = None


def _bitmask_fn():
    """The Triton kernel where Triton runs (always on a CUDA machine with the engine's
    dependencies), else its torch reference; decided once."""
    global _BITMASK_FN
    if _BITMASK_FN is None:
        from engine import kernels
        if kernels.triton_available():
            _BITMASK_FN = kernels.apply_token_bitmask
        else:
            from engine.kernels.reference import apply_token_bitmask_ref
            _BITMASK_FN = apply_token_bitmask_ref
    return _BITMASK_FN


def _apply_penalties(x: torch.Tensor, rows: list) -> None:
    """Steps 3 and 4 on the penalised rows of ``x`` [B, V], in place."""
    V = x.shape[1]
    dev = x.device
    sel = [r[0] for r in rows]
    idx = _dev(sel, torch.int64, dev)
    sub = x.index_select(0, idx)
    R = len(rows)
    rep = [r[3] for r in rows]
    if any(p != 1.0 for p in rep):
        seen = torch.zeros(R * V, dtype=torch.bool, device=dev)
        ids = [r[4] + j * V for j, r in enumerate(rows)]
        seen.index_fill_(0, _dev(np.concatenate(ids), torch.int64, dev), True)
        seen = seen.view(R, V)
        p = _dev(rep, torch.float32, dev).view(-1, 1)
        sub = torch.where(seen, torch.where(sub > 0, sub / p, sub * p), sub)
    pres = [r[1] for r in rows]
    freq = [r[2] for r in rows]
    if any(pres) or any(freq):
        ids = [r[4][r[5]:] + j * V for j, r in enumerate(rows)]
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        counts = torch.zeros(R * V, dtype=torch.float32, device=dev)
        if flat.size:
            counts.index_add_(0, _dev(flat, torch.int64, dev),
                              torch.ones(flat.size, dtype=torch.float32, device=dev))
        counts = counts.view(R, V)
        f = _dev(freq, torch.float32, dev).view(-1, 1)
        pr = _dev(pres, torch.float32, dev).view(-1, 1)
        sub = sub - (f * counts + pr * (counts > 0).float())
    x.index_copy_(0, idx, sub)
