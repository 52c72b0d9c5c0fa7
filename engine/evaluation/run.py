"""``pdserve eval``: a candidate engine configuration against a baseline, on a text corpus.

Both run the same token windows of the corpus part (teacher-forced: every position's
next-token distribution, LLMEngine.score) and greedy continuations of the same prompts
(LLM.generate). Engines are built one at a time (the baseline's log-probabilities are kept,
then each candidate is loaded, compared and released), so memory holds one model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
import gc
import logging
import time

from engine.config import EngineConfig
from engine.evaluation import metrics
from engine.evaluation.corpus import Corpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    window: int = 256  # tokens per scored window
    windows: int = 8  # windows scored, evenly spaced over the corpus part
    continuations: int = 8  # greedy continuations (prompts: the first windows' heads)
    prompt_tokens: int = 64
    new_tokens: int = 32
    part: str = "heldout"

    def __post_init__(self) -> None:
        for name in ("window", "windows", "prompt_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.continuations < 0 or self.continuations > self.windows:
            raise ValueError("continuations must be between 0 and windows")
        if self.prompt_tokens >= self.window:
            raise ValueError("prompt_tokens must be smaller than window")


def pick_windows(ids: list[int], window: int, count: int) -> list[list[int]]:
    """``count`` non-overlapping windows of ``window + 1`` tokens (the last one is only a
    target), evenly spaced over ``ids``."""
    span = window + 1
    total = len(ids) // span
    if total < count:
        raise ValueError(f"the corpus part holds {total} windows of {window} tokens, "
                         f"{count} asked")
    return [ids[j * span:(j + 1) * span] for j in (i * total // count for i in range(count))]


def _engine(config: EngineConfig):
    from engine.llm import LLM
    return LLM.from_config(config)


def run_config(config: EngineConfig, windows: list[list[int]], s: EvalSettings) -> dict:
    """Load ``config``, score the windows, generate the continuations; release it."""
    import torch
    from engine.quant import model_weight_bytes
    from engine.request import SamplingParams

    t0 = time.perf_counter()
    llm = _engine(config)
    eng = llm.engine
    load_s = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        lps = [eng.score(w[:-1]) for w in windows]
        score_s = time.perf_counter() - t1
        sp = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
        t2 = time.perf_counter()
        outs = llm.generate([w[:s.prompt_tokens] for w in windows[:s.continuations]], sp)
        gen_s = time.perf_counter() - t2
        r = eng.runner
        info = {"kv_dtype": str(r.kv_dtype).removeprefix("torch."),
                "kv_block_bytes": r.kv_cache_bytes // max(1, r.num_blocks),
                "weight_bytes": model_weight_bytes(r.model),
                "quantized_projections": (r.quantization or {}).get("projections"),
                "load_s": round(load_s, 2), "score_s": round(score_s, 2),
                "generate_s": round(gen_s, 2), "vocab_size": eng.model_config.vocab_size}
        return {"lp": lps, "cont": [list(o.token_ids) for o in outs], "info": info,
                "tokenizer": llm.tokenizer}
    finally:
        del llm, eng
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def evaluate(base: EngineConfig, candidates: dict[str, EngineConfig], corpus: Corpus,
             s: EvalSettings = EvalSettings(), tokenizer=None) -> dict:
    """The result document: corpus, settings, the baseline's figures, and per candidate the
    four metrics (perplexity, KL mean / p99, top-1 agreement, greedy agreement)."""
    import torch
    if tokenizer is None:
        from engine.loader import load_tokenizer
        tokenizer = load_tokenizer(base.model)
    ids = tokenizer.encode(corpus.part(s.part))
    windows = pick_windows(ids, s.window, s.windows)
    logger.info("eval: %d windows of %d tokens from %d %s tokens", len(windows), s.window,
                len(ids), s.part)
    b = run_config(base, windows, s)
    targets = [torch.tensor(w[1:]) for w in windows]
    self_stats = [metrics.token_stats(lp, lp, t) for lp, t in zip(b["lp"], targets)]
    doc = {"corpus": corpus.describe(), "settings": asdict(s), "part_tokens": len(ids),
           "baseline": {"config": _settings_of(base), **b["info"],
                        "perplexity": metrics.summarize(self_stats)["perplexity"]},
           "candidates": {}}
    for name, cfg in candidates.items():
        c = run_config(cfg, windows, s)
        if c["info"]["vocab_size"] != b["info"]["vocab_size"]:
            raise ValueError(f"candidate {name}: vocabulary {c['info']['vocab_size']} differs "
                             f"from the baseline's {b['info']['vocab_size']}")
        stats = [metrics.token_stats(bl, cl, t) for bl, cl, t in zip(b["lp"], c["lp"], targets)]
        doc["candidates"][name] = {
            "config": _settings_of(cfg), **c["info"], **metrics.summarize(stats),
            "greedy": metrics.continuation_stats(b["cont"], c["cont"]),
            "weight_bytes_vs_baseline": c["info"]["weight_bytes"] / b["info"]["weight_bytes"]}
        del c
    return doc


def _settings_of(cfg: EngineConfig) -> dict:
    """The settings of ``cfg`` that differ from the defaults (what makes it this config)."""
    from pdcore.config_tree import flat
    default = flat(EngineConfig())
    return {k: v for k, v in flat(cfg).items() if default.get(k) != v}


def table(doc: dict) -> str:
    """A plain-text table of a result document."""
    head = (f"{'candidate':<18}{'ppl':>9}{'d_ppl':>8}{'KL mean':>10}{'KL p99':>9}"
            f"{'top-1':>8}{'greedy':>8}{'same':>6}{'weights':>9}")
    base = doc["baseline"]
    lines = [f"corpus {doc['corpus']['source']} sha256 {doc['corpus']['sha256'][:16]} "
             f"part {doc['settings']['part']}: {doc['settings']['windows']} x "
             f"{doc['settings']['window']} tokens; greedy {doc['settings']['continuations']} "
             f"x {doc['settings']['new_tokens']} tokens",
             f"baseline {base['config'] or 'defaults'}: perplexity {base['perplexity']:.3f}, "
             f"weights {base['weight_bytes'] / 2**20:.1f} MiB", head]
    for name, c in doc["candidates"].items():
        g = c["greedy"]
        lines.append(
            f"{name:<18}{c['perplexity']:>9.3f}{c['perplexity'] - c['perplexity_base']:>+8.3f}"
            f"{c['kl_mean']:>10.5f}{c['kl_p99']:>9.4f}{100 * c['top1_agreement']:>7.2f}%"
            f"{g['mean_tokens_before_divergence']:>8.1f}{g['identical']:>3}/{g['prompts']:<2}"
            f"{100 * c['weight_bytes_vs_baseline']:>8.1f}%")
    return "\n".join(lines)
