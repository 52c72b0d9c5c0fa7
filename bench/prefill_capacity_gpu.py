"""Prefill capacity of one GPU engine on the disaggregated benchmark's prompt mix: what bounds
1P1D's goodput in bench/disagg_gpu.py is how many prompt tokens/s the single prefill worker
computes. Same settings as that bench's workers (dummy:llama-3-8b bf16, max-num-seqs 128,
--max-num-batched-tokens 2048 so a 4096-token prompt is prefilled in two chunks) and the same
mix (a quarter of the prompts 4096 tokens, the rest 128-512), one new token each, all queued
at once: the engine runs full prefill steps back to back, as a saturated prefill worker does.

Each of ``--rounds`` runs uses fresh prompts (prefix caching off). Also the TTFT of one
4096-token prompt alone. Compare engine variants by running it once per variant (the
engine's PDSERVE_* switches).

    python3 -m bench.prefill_capacity_gpu --set h200-mycommit       (one GPU, ~2 min)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.benchlib import harness
from pdserve.benchlib.workload import parse_range

FIGURES = [
    harness.Figure("prompt tokens/s of one prefill engine on the disagg mix (median)", "tok/s",
                   ("prompt_tok_s_median",)),
    harness.Figure("one 4096-token prompt alone, budget 2048", "ms",
                   ("ttft_long_ms", "median"), format=".1f"),
]


def prompts(rng: random.Random, n: int, a, vocab: int) -> list[list[int]]:
    lo, hi = parse_range(a.short)
    out = []
    for _ in range(n):
        length = a.long_len if rng.random() < a.long_frac else rng.randint(lo, hi)
        out.append([1] + [rng.randrange(3, vocab) for _ in range(length - 1)])
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.prefill_capacity_gpu",
                                 description=__doc__.splitlines()[0])
    harness.add_output_args(ap, "prefill_capacity_gpu")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--long-frac", type=float, default=0.25)
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--short", default="128:512")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    a = ap.parse_args(argv)
    rec = harness.Recorder.start("prefill_capacity_gpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    R = rec.doc
    R["device"] = torch.cuda.get_device_name(0)
    R["runs"] = []
    save = rec.save

    llm = LLM("dummy:llama-3-8b", dtype="bfloat16", device="cuda", max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_batched_tokens, max_model_len=a.long_len + 256,
              kv_cache_memory_bytes=int(a.kv_gib * 2**30), enable_prefix_caching=False)
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    llm.generate(prompts(rng, 24, a, vocab), one)  # warm-up: compile / autotune the kernels
    for rnd in range(a.rounds):
        ps = prompts(rng, a.requests, a, vocab)
        torch.cuda.synchronize()
        steps0 = eng.steps
        t0 = time.perf_counter()
        llm.generate(ps, one)
        dt = time.perf_counter() - t0
        ntok = sum(len(p) for p in ps)
        run = {"round": rnd, "requests": len(ps), "prompt_tokens": ntok, "wall_s": round(dt, 3),
               "prompt_tok_s": round(ntok / dt), "steps": eng.steps - steps0}
        R["runs"].append(run)
        print(run, flush=True)
        save()
    ttfts = []
    for _ in range(4):
        p = [[1] + [rng.randrange(3, vocab) for _ in range(a.long_len - 1)]]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(p, one)
        ttfts.append((time.perf_counter() - t0) * 1e3)
    R["ttft_long_ms"] = {"runs": [round(x, 2) for x in ttfts],
                         "median": round(statistics.median(ttfts[1:]), 2)}
    R["prompt_tok_s_median"] = round(statistics.median(r["prompt_tok_s"] for r in R["runs"]))
    R["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save()
    print(json.dumps({k: R[k] for k in ("prompt_tok_s_median", "ttft_long_ms")}))


if __name__ == "__main__":
    main()
