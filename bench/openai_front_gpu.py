"""The OpenAI-compatible HTTP front against gRPC on one H200: a colocated worker on the GPU
(dummy:llama-3-8b: random weights, real shapes), the gateway serving both fronts, driven by
``pdserve bench``'s runner (streamed, greedy, EOS ignored).

    PYTHONPATH=. python3 -m bench.openai_front_gpu --out $OUT/openai_front_gpu.json
    PYTHONPATH=. python3 -m bench.openai_front_gpu --concurrency 64 --pairs 1 --out /tmp/f.json

For each --concurrency (64, 256): --pairs pairs of trials, grpc then openai, then openai then
grpc, each trial its own prompts (--requests-per-slot x concurrency requests of --input-lo ..
--input-hi random token ids, --max-tokens output tokens). Reported per concurrency: output
tok/s of every trial, the median ratio openai / grpc, and the gateway's CPU per request with
each front (the gateway is one Python process: at high concurrency it is what an HTTP front
could slow down). Target (issue 25): >= 0.95x at 64 and at 256.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench.openai_front_cpu import trial
from pdserve.benchlib import harness, workload

FIGURES = [
    harness.Figure("HTTP / gRPC output throughput at concurrency 64 (median of pairs)", "",
                   ("summary", "64", "median_throughput_ratio"), format=".3f"),
    harness.Figure("HTTP / gRPC output throughput at concurrency 256 (median of pairs)", "",
                   ("summary", "256", "median_throughput_ratio"), format=".3f"),
]


def items(a, n: int, seed: int) -> list:
    """n prompts of random token ids (exact lengths, whatever the tokenizer)."""
    return workload.generate(workload.WorkloadSpec(
        kind="random", num_requests=n, seed=seed, fmt="tokens", vocab_size=a.vocab_size,
        input_len=(a.input_lo, a.input_hi), output_len=(a.max_tokens, a.max_tokens)))


def sweep(c, a, conc: int) -> dict:
    pairs = []
    for i in range(a.pairs):
        order = ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc")
        p = {api: trial(c, api, items(a, a.requests_per_slot * conc, 1000 * conc + 10 * i + k),
                        conc)
             for k, api in enumerate(order)}
        p["ratio"] = p["openai"]["output_tok_s"] / p["grpc"]["output_tok_s"]
        print(f"concurrency {conc} pair {i}: grpc {p['grpc']['output_tok_s']:.0f} tok/s, "
              f"openai {p['openai']['output_tok_s']:.0f} tok/s (x{p['ratio']:.3f})", flush=True)
        pairs.append(p)
    ratios = [p["ratio"] for p in pairs]
    return {"pairs": pairs, "median_throughput_ratio": statistics.median(ratios),
            "throughput_ratio_range": [min(ratios), max(ratios)],
            "gateway_cpu_ms_per_request": {
                api: statistics.median(p[api]["gateway_cpu_ms_per_request"] for p in pairs)
                for api in ("grpc", "openai")}}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.openai_front_gpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--requests-per-slot", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--input-lo", type=int, default=128)
    ap.add_argument("--input-hi", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    harness.add_output_args(ap, "openai_front_gpu")
    a = ap.parse_args(argv)
    from engine.loader import load_config
    from pdserve.cluster import LocalCluster
    a.vocab_size = load_config(a.model).vocab_size
    rec = harness.Recorder.start("openai_front_gpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES, cuda=True)
    rec["note"], rec["summary"] = a.note, {}
    concs = [int(x) for x in a.concurrency.split(",")]
    with LocalCluster(a.model, prefill=0, decode=0, colocated=1, http_port=0,
                      devices={"colocated": [a.device]}, startup_timeout_s=900) as c:
        for api in ("grpc", "openai"):  # warm-up: CUDA graphs, connections
            trial(c, api, items(a, 2 * max(concs), 99999), max(concs))
        for conc in concs:
            rec["summary"][str(conc)] = sweep(c, a, conc)
            rec.save()
    rec["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print({k: v["median_throughput_ratio"] for k, v in rec["summary"].items()})
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
