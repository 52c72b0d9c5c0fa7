"""CPU engine benchmark: pdserve's engine against transformers generate(), side by side.

    python3 -m bench.engine_cpu --set cpu-mybox               (~10 min on 2 cores)
    python3 -m bench.engine_cpu --new-tokens 8 --requests 4 --out /tmp/e.json   (quick)

SmolLM2-135M-Instruct (the embedded GGUF, dequantized to fp32; transformers gets the same
weights), fp32, CPU. Each measurement runs in its own subprocess (so peak RSS is its own):
  b1      batch-1 decode: a 32-token prompt, 128 new tokens (greedy, EOS ignored), tok/s
  batch   64 requests, prompts of 32-256 tokens, 128 new tokens each: output tok/s;
          transformers runs them as padded batches of 8 (left padding), pdserve all at once
Both sides use the same torch thread count (--threads, default: all cores).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from pdserve.benchlib import harness

FIGURES = [
    harness.Figure("batch-1 decode, pdserve", "tok/s", ("summary", "b1_decode_tok_s", "pdserve")),
    harness.Figure("batch-1 decode, transformers", "tok/s",
                   ("summary", "b1_decode_tok_s", "transformers")),
    harness.Figure("64 requests, pdserve", "out tok/s",
                   ("summary", "batch64_output_tok_s", "pdserve")),
    harness.Figure("64 requests, transformers (padded batches of 8)", "out tok/s",
                   ("summary", "batch64_output_tok_s", "transformers_padded_b8")),
]


def _prompts(n=64, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(32, 257, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (L,), generator=g).tolist() for L in lens]


def _b1_prompt():
    from engine.loader import load_tokenizer
    ids = load_tokenizer("smollm2-135m").encode(
        "The history of the Roman Empire spans many centuries, beginning with the founding "
        "of the city and ending with the fall of Constantinople. Write a summary:")
    return ids[:32]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def part_ours(kind: str, new: int, requests: int) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM("smollm2-135m", max_num_seqs=64, max_num_batched_tokens=4096)
    load_rss = _rss_mb()
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    if kind == "b1":
        p = _b1_prompt()
        llm.generate([p], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
        t = time.perf_counter()
        out = llm.generate([p], sp)
        dt = time.perf_counter() - t
        n = len(out[0].token_ids)
    else:
        prompts = _prompts(requests)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t
        n = sum(len(o.token_ids) for o in outs)
    return {"tokens": n, "seconds": dt, "tok_s": n / dt, "rss_after_load_mb": load_rss,
            "peak_rss_mb": _rss_mb(), "preemptions": llm.engine.num_preemptions}


def part_hf(kind: str, new: int, requests: int) -> dict:
    import torch
    from engine.loader import load_model
    from tests.reference import hf_model_from_loaded
    hf = hf_model_from_loaded(load_model("smollm2-135m"))
    hf.generation_config.eos_token_id = None
    load_rss = _rss_mb()

    def gen(batch: list[list[int]], n: int):
        L = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (L - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return out.shape[0] * (out.shape[1] - L)

    if kind == "b1":
        p = _b1_prompt()
        gen([p], 8)
        t = time.perf_counter()
        n = gen([p], new)
        dt = time.perf_counter() - t
    else:
        prompts = _prompts(requests)
        gen(prompts[:2], 4)
        t = time.perf_counter()
        n = sum(gen(prompts[i:i + 8], new) for i in range(0, len(prompts), 8))
        dt = time.perf_counter() - t
    return {"tokens": n, "seconds": dt, "tok_s": n / dt, "rss_after_load_mb": load_rss,
            "peak_rss_mb": _rss_mb()}


def run_part(name: str, a: argparse.Namespace) -> dict:
    """One measurement in a fresh process (its own peak RSS), this module run with -m."""
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    cmd = [sys.executable, "-m", "bench.engine_cpu", "--part", name, "--threads",
           str(a.threads), "--new-tokens", str(a.new_tokens), "--requests", str(a.requests)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=harness.REPO,
                       timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.engine_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--requests", type=int, default=64, help="requests of the batch part")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    harness.add_output_args(ap, "engine_cpu")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    if a.part:
        side, kind = a.part.split("-")
        res = (part_ours if side == "ours" else part_hf)(kind, a.new_tokens, a.requests)
        print(json.dumps(res))
        return
    rec = harness.Recorder.start("engine_cpu", a, argv=argv, about=__doc__, figures=FIGURES)
    rec["model"] = "smollm2-135m (GGUF Q4_1/Q8_0 dequantized to fp32)"
    rec["dtype"] = "float32"
    results = {}
    for name in ("hf-b1", "ours-b1", "hf-batch", "ours-batch"):
        results[name] = run_part(name, a)
        print(name, json.dumps(results[name]), flush=True)
    rec["summary"] = {
        "b1_decode_tok_s": {"pdserve": results["ours-b1"]["tok_s"],
                            "transformers": results["hf-b1"]["tok_s"],
                            "ratio": results["ours-b1"]["tok_s"] / results["hf-b1"]["tok_s"],
                            "target_ratio": 1.5},
        "batch64_output_tok_s": {
            "pdserve": results["ours-batch"]["tok_s"],
            "transformers_padded_b8": results["hf-batch"]["tok_s"],
            "ratio": results["ours-batch"]["tok_s"] / results["hf-batch"]["tok_s"],
            "target_ratio": 2.0},
        "peak_rss_mb": {k: v["peak_rss_mb"] for k, v in results.items()},
    }
    rec["runs"] = results
    print(json.dumps(rec["summary"], indent=2))
    print(f"wrote {rec.save()}")


if __name__ == "__main__":
    main()
