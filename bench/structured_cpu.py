"""Structured output on the CPU (issue 25, point 4): which grammar engine, and what a mask costs.

    python3 -m bench.structured_cpu --set cpu-mybox
    python3 -m bench.structured_cpu --engines llguidance --steps 10 --out /tmp/s.json  (quick)

1. Grammar engines, on SmolLM2-135M's own tokenizer (49,152 tokens; built from our
   tokenizer.json, as engine.grammar does): the time to build the engine's tokenizer, to
   compile each of the 20 committed schemas (tests/data/json_schemas.json; a fresh compile,
   no cache, plus the first mask), and the per-token mask time while replaying one document
   per schema (a seeded random walk over llguidance's allowed tokens, so every engine masks
   the same tokens; a token another engine refuses ends its replay there). llguidance 1.9
   and xgrammar 0.2 (each is skipped when not installed).
2. The mask per decode step in the engine (llguidance, as served): LLMEngine on
   smollm2-135m, --batch rows decoding (EOS ignored), of which 0, 1, half or all are
   constrained by a grammar that never ends; the median step time of each mix (repeats
   interleaved, so a shared machine's drift hits all alike), and, timed alone on the same
   rows, the mask work of one step (fill the bitmasks + apply them: Sampler.process with only
   the masks). A shared 2-core machine's other jobs stretch single timings by 10x and more:
   the figures are the fastest run's median step time per mix and the 10th percentile of
   the mask timings (all timings are in the JSON). Targets: mask <= 5% of the step for
   constrained rows; unconstrained rows in the same batch <= 1% (they are never read for
   it: what they pay is the batch-wide step).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pdserve.benchlib import harness

SCHEMAS = Path(__file__).resolve().parents[1] / "tests" / "data" / "json_schemas.json"
FIGURES = [
    harness.Figure("llguidance: compile a schema (median of 20)", "ms",
                   ("engines", "llguidance", "compile_ms_median"), format=".2f"),
    harness.Figure("xgrammar: compile a schema (median of 20)", "ms",
                   ("engines", "xgrammar", "compile_ms_median"), format=".2f"),
    harness.Figure("llguidance: mask per token (median)", "us",
                   ("engines", "llguidance", "mask_us_median"), format=".1f"),
    harness.Figure("xgrammar: mask per token (median)", "us",
                   ("engines", "xgrammar", "mask_us_median"), format=".1f"),
    harness.Figure("mask share of a decode step, all rows constrained", "%",
                   ("steps", "mask_share_all_pct"), format=".2f"),
    harness.Figure("step time added for unconstrained rows (half constrained)", "%",
                   ("steps", "unconstrained_overhead_pct"), format=".2f"),
]
# a constrained row that never ends (here): the grammar accepts only after 100 records, over
# 1,000 tokens. With ``(...)+`` it accepted after each record, and EOS may follow then: on the
# zero-weight models of the GPU runs (all logits equal) a greedy row takes the lowest allowed
# id, EOS (2), after its first record (13 tokens), and uniform draws end ~90% of the rows
# within 68 tokens, so those mixes measured shrinking batches
FOREVER = r'(\{"k":"[a-z ]{1,12}","n":[0-9]{1,3}\},){100,}'


def schemas() -> list[dict]:
    return json.loads(SCHEMAS.read_text())["schemas"]


def _med(xs):
    return statistics.median(xs) if xs else None


class LLG:
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        from engine.grammar.compiler import _JSON_OPTIONS, build_ll_tokenizer
        self.ll, self.opts = llguidance, _JSON_OPTIONS
        t0 = time.perf_counter()
        self.tok = build_ll_tokenizer(tok, vocab, tok.eos_token_ids)
        self.tokenizer_s = time.perf_counter() - t0
        self.mask = None
        self.words = (vocab + 31) // 32

    def compile(self, schema):
        g = self.ll.LLMatcher.grammar_from_json_schema(schema, overrides=self.opts)
        m = self.ll.LLMatcher(self.tok, g, log_level=0)
        self.fill(m)
        return m

    def fresh(self, compiled):
        return compiled.deep_copy()

    def fill(self, m):
        import torch
        if self.mask is None:
            self.mask = torch.empty((1, self.words), dtype=torch.int32)
        m.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.words * 4)
        return self.mask[0]

    def accept(self, m, t) -> bool:
        return m.consume_token(t)


class XGR:
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        import xgrammar as xg
        self.xg = xg
        t0 = time.perf_counter()
        ids = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
        info = xg.TokenizerInfo(ids, xg.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xg.GrammarCompiler(info, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - t0
        self.mask = xg.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        g = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                              separators=(",", ":"))
        m = self.xg.GrammarMatcher(g)
        m.fill_next_token_bitmask(self.mask, 0)
        return g

    def fresh(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def fill(self, m):
        m.fill_next_token_bitmask(self.mask, 0)
        return self.mask[0]

    def accept(self, m, t) -> bool:
        return m.accept_token(t)


def walk(llg: LLG, schema, seed: int, max_len: int) -> list[int]:
    """A seeded random document of ``schema``: allowed tokens, EOS as soon as allowed."""
    import torch
    rng = random.Random(seed)
    m = llg.compile(schema)
    eos = llg.tok.eos_token
    out: list[int] = []
    while len(out) < max_len and not m.is_stopped():
        row = llg.fill(m)
        bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)
        ok = bits.nonzero().view(-1).tolist()
        if eos in ok:
            break
        t = rng.choice(ok)
        m.consume_token(t)
        out.append(t)
    return out


def engines_section(a, tok, vocab: int) -> dict:
    kinds = {"llguidance": LLG, "xgrammar": XGR}
    built = {}
    for name in a.engines:
        try:
            built[name] = kinds[name](tok, vocab)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
    docs = [walk(built["llguidance"], s["schema"], i, a.max_doc_tokens)
            for i, s in enumerate(schemas())] if "llguidance" in built else []
    res = {}
    for name, eng in built.items():
        comp, masks, per_schema = [], [], []
        for s, doc in zip(schemas(), docs):
            t0 = time.perf_counter()
            g = eng.compile(s["schema"])
            comp.append((time.perf_counter() - t0) * 1e3)
            m, n, ts = eng.fresh(g), 0, []
            for t in doc:
                t0 = time.perf_counter()
                eng.fill(m)
                ts.append((time.perf_counter() - t0) * 1e6)
                if not eng.accept(m, t):
                    break
                n += 1
            masks += ts
            per_schema.append({"schema": s["name"], "compile_ms": round(comp[-1], 3),
                               "tokens": len(doc), "replayed": n,
                               "mask_us_median": round(_med(ts) or 0, 1)})
        res[name] = {"tokenizer_build_s": round(eng.tokenizer_s, 3),
                     "compile_ms_median": _med(comp), "compile_ms_max": max(comp),
                     "mask_us_median": _med(masks), "mask_us_p90": sorted(masks)[
                         int(0.9 * len(masks))] if masks else None,
                     "mask_us_mean": statistics.fmean(masks) if masks else None,
                     "per_schema": per_schema}
        print(name, {k: v for k, v in res[name].items() if k != "per_schema"}, flush=True)
    return res


def _engine(a):
    from engine.engine import LLMEngine
    from engine.llm import build_engine_config
    return LLMEngine(build_engine_config(a.model, max_num_seqs=a.batch, device=a.device))


def _clock(a):
    """Wall time (process CPU time was tried on the CPU: torch's OpenMP threads spin while
    they wait, which counts as CPU time and swamps the figures on a loaded machine)."""
    return time.perf_counter


def _p10(xs):
    xs = sorted(xs)
    return xs[len(xs) // 10] if xs else None


@contextlib.contextmanager
def lockstep(eng, on: bool = True):
    """With ``on``: async decode off meanwhile (no step launched before the previous one's
    tokens are read), the engine's behaviour for constrained rows before issue 25's fix."""
    old = eng.config
    if on:
        eng.config = eng.runner.config = dataclasses.replace(old, async_decode=False)
    try:
        yield
    finally:
        eng.config = eng.runner.config = old


def add_mix(eng, a, k: int, tag: str) -> list[str]:
    """Add --batch requests, ``k`` of them constrained; their ids."""
    from engine import Constraint, SamplingParams
    prompt = eng.encode("Write a list of records:")
    ids = [f"{tag}-{i}" for i in range(a.batch)]
    for i, rid in enumerate(ids):
        c = Constraint("regex", FOREVER) if i < k else None
        eng.add_request(rid, prompt, SamplingParams(
            max_tokens=a.steps + 4, temperature=a.temperature, seed=i, ignore_eos=True,
            constraint=c))
    return ids


def _mix(eng, a, k: int, tag: str, info: dict) -> float:
    """Median step time (s) of --batch rows, ``k`` of them constrained; ``info``: the steps
    timed, steps launched ahead (async decode) and rows that ended before max_tokens."""
    add_mix(eng, a, k, tag)
    times, clock = [], _clock(a)
    chained, early = eng.chained_steps, 0
    while eng.has_work:
        t0 = clock()
        outs = eng.step()  # returns once the step's tokens are on the host (CUDA synchronised)
        times.append(clock() - t0)
        early += sum(1 for o in outs if o.finished and o.finish_reason.value != "length")
    info.update(steps=len(times), timed=len(times[3:-2]), ended_early=early,
                chained=eng.chained_steps - chained)
    return _med(times[3:-2])


def _mask_only(eng, a, k: int) -> float:
    """The mask work of one step with ``k`` constrained rows of --batch (s, median)."""
    import torch
    from engine.layers.sampler import Sampler, SamplingBatch
    from engine import Constraint
    ids = eng.encode('{"k":"ab c","n":12},{"k":"x')
    c = Constraint("regex", FOREVER)
    ms = []
    for _ in range(k):
        m = eng.grammars.matcher(c)
        m.consume_all(ids)
        ms.append(m)
    batch = SamplingBatch([0.8] * a.batch, [0] * a.batch, [1.0] * a.batch,
                          [None] * a.batch, False, masks=list(zip(range(k), ms)))
    logits = torch.randn(a.batch, eng.model_config.vocab_size, device=eng.runner.device)
    ts, clock = [], _clock(a)
    for _ in range(a.mask_repeats):
        t0 = clock()
        Sampler.process(logits, batch)
        if logits.is_cuda:
            torch.cuda.synchronize()
        ts.append(clock() - t0)
    return _p10(ts)


def _batch_copy(eng, a) -> float:
    """What a mixed batch costs its unconstrained rows in the sampler: the scores are copied
    once ([B, V] fp32) before the constrained rows are masked (s, median)."""
    import torch
    logits = torch.randn(a.batch, eng.model_config.vocab_size, device=eng.runner.device)
    ts, clock = [], _clock(a)
    for _ in range(a.mask_repeats):
        t0 = clock()
        logits.clone()
        if logits.is_cuda:
            torch.cuda.synchronize()
        ts.append(clock() - t0)
    return _p10(ts)


def mixes_of(eng, batch: int) -> dict[str, tuple[int, bool]]:
    """Mix name -> (constrained rows, lockstep). With async decode (a GPU), the none and all
    mixes again in lockstep: what launching steps ahead saves, and the engine before issue
    25's fix (a constrained row kept its whole batch in lockstep)."""
    mixes = {"none": (0, False), "one": (1, False), "half": (batch // 2, False),
             "all": (batch, False)}
    if eng.config.async_decode:
        mixes.update(none_lockstep=(0, True), all_lockstep=(batch, True))
    return mixes


def steps_section(a, eng=None) -> dict:
    eng = eng or _engine(a)
    mixes = mixes_of(eng, a.batch)
    runs: dict[str, list[float]] = {m: [] for m in mixes}
    info: dict[str, dict] = {m: {} for m in mixes}  # of the last repeat
    _mix(eng, a, 0, "warm", {})
    for r in range(a.repeats):
        for name, (k, ls) in (mixes.items() if r % 2 == 0 else reversed(mixes.items())):
            with lockstep(eng, ls):
                runs[name].append(_mix(eng, a, k, f"{name}{r}", info[name]))
    step = {m: min(v) for m, v in runs.items()}
    by_k = {k: _mask_only(eng, a, k) if k else 0.0 for k, _ in set(mixes.values())}
    mask = {m: by_k[k] for m, (k, _) in mixes.items()}
    base = step["none"]
    copy = _batch_copy(eng, a)
    out = {"batch_copy_ms": 1e3 * copy, "batch_copy_share_pct": 100 * copy / base,
           "batch": a.batch, "temperature": a.temperature, "grammar": FOREVER,
           "async_decode": bool(eng.config.async_decode), "mix_steps": info,
           "step_ms": {m: 1e3 * v for m, v in step.items()},
           "step_ms_runs": {m: [round(1e3 * x, 2) for x in v] for m, v in runs.items()},
           "mask_ms": {m: 1e3 * v for m, v in mask.items()},
           "mask_share_pct": {m: 100 * mask[m] / base for m in mixes},
           "step_added_pct": {m: 100 * (step[m] - base) / base for m in mixes},
           "mask_share_all_pct": 100 * mask["all"] / base,
           # an unconstrained row's extra cost in a half-constrained batch: the step time
           # beyond the constrained rows' own mask work
           "unconstrained_overhead_pct": 100 * max(0.0, step["half"] - base - mask["half"])
           / base}
    print({k: v for k, v in out.items() if k != "step_ms_runs"}, flush=True)
    return out


def add_step_args(ap: argparse.ArgumentParser, batch: int) -> None:
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per mix")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--mask-repeats", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="every row's; 0: greedy (greedy batches chain steps ahead on a "
                         "GPU, async decode; constrained ones too since issue 25's fix)")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.structured_cpu",
                                 description=__doc__.splitlines()[0])
    add_step_args(ap, 16)
    ap.add_argument("--engines", nargs="*", default=["llguidance", "xgrammar"],
                    choices=["llguidance", "xgrammar"], help="none: skip section 1")
    ap.add_argument("--max-doc-tokens", type=int, default=120)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--note", default="")
    harness.add_output_args(ap, "structured_cpu")
    a = ap.parse_args(argv)
    rec = harness.Recorder.start("structured_cpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    rec["note"] = a.note
    from engine.loader import load_config, load_tokenizer
    rec["engines"] = engines_section(a, load_tokenizer(a.model), load_config(a.model).vocab_size)
    rec.save()
    if not a.skip_steps:
        rec["steps"] = steps_section(a)
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
