"""What the gateway's transport to a decode worker costs (issue 22): the same serving load
on two identical clusters (what ``pdserve up`` runs: a gateway and one colocated worker,
mutual TLS, Redis), one with ``--decode-stream many`` (every request for the worker on one
DecodeWorker.GenerateMany stream: one message per engine step) and one with
``--decode-stream per_request`` (one DecodeWorker.Generate call per request: one message per
request per step).

    python3 -m bench.decode_stream_cpu --set cpu-2core
    python3 -m bench.decode_stream_cpu --pairs 1 --streams 4 --rounds 1 --max-tokens 8 \\
        --out /tmp/decode_stream.json                                   (quick)

Both clusters run at once; trials alternate (many, per_request, per_request, many, ...) so
drifts of a shared machine hit both alike. One trial: --streams closed-loop streams each send
--rounds requests back to back (greedy, EOS ignored, --max-tokens new tokens, prompts of
64-192 random token ids). The model is dummy:tiny by default: its steps are short, so the
per-message work is a large part of the worker's time, as it is on a GPU at high
concurrency. Reported per trial: output tok/s, and CPU seconds per 1000 output tokens (user
+ system, from /proc) of the worker process, of its main thread (the asyncio event loop that
serves gRPC; the engine runs on another thread) and of the gateway; medians over the trials.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys

from bench.serving_cpu import gateway_trial, make_prompts, proc_cpu_s
from pdserve.benchlib import harness

MODES = ("many", "per_request")
FIGURES = [
    harness.Figure("worker event-loop CPU per 1000 tokens, many / per_request", "",
                   ("summary", "loop_cpu_ratio"), format=".2f"),
    harness.Figure("gateway CPU per 1000 tokens, many / per_request", "",
                   ("summary", "gateway_cpu_ratio"), format=".2f"),
    harness.Figure("throughput many / per_request (median of pairs)", "",
                   ("summary", "median_tok_s_ratio"), format=".3f"),
]


def cpu_sample(cluster) -> dict:
    worker = cluster.workers[0].proc.pid
    return {"worker": proc_cpu_s(worker), "worker_loop": proc_cpu_s(worker, worker),
            "gateway": proc_cpu_s(cluster.gateway.proc.pid)}


def timed_trial(cluster, prompts, args, tag) -> dict:
    before = cpu_sample(cluster)
    res = asyncio.run(gateway_trial(cluster.address, prompts, args, tag))
    after = cpu_sample(cluster)
    k = res["output_tokens"] / 1000
    for name in before:
        res[f"{name}_cpu_s"] = round(after[name] - before[name], 3)
        res[f"{name}_cpu_s_per_1k_tokens"] = round((after[name] - before[name]) / k, 4)
    return res


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.decode_stream_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--streams", type=int, default=64, help="concurrent closed-loop streams")
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream per trial")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4, help="many / per_request trial pairs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    harness.add_output_args(ap, "decode_stream_cpu")
    a = ap.parse_args(argv)

    from engine.loader import load_config
    from pdserve.cluster import LocalCluster
    prompts = make_prompts(a.streams * a.rounds, load_config(a.model).vocab_size)
    rec = harness.Recorder.start("decode_stream_cpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    rec["note"] = a.note
    wargs = ("--num-threads", str(a.threads), "--max-num-seqs", str(max(64, a.streams)))
    clusters = {m: LocalCluster(a.model, prefill=0, decode=0, colocated=1, worker_args=wargs,
                                gateway_args=("--decode-stream", m)) for m in MODES}
    trials = []
    try:
        for c in clusters.values():
            c.start()
        for m, c in clusters.items():  # warm-up: graphs, caches, the stream
            asyncio.run(gateway_trial(c.address, prompts[:4], argparse.Namespace(
                **{**vars(a), "streams": 2, "rounds": 1}), f"warm-{m}"))
        for i in range(a.pairs):
            order = MODES if i % 2 == 0 else MODES[::-1]
            pair = {m: timed_trial(clusters[m], prompts, a, f"{m}{i}") for m in order}
            trials.append(pair)
            print(f"pair {i}: " + "; ".join(
                f"{m} {pair[m]['output_tok_s']:.0f} tok/s, loop "
                f"{pair[m]['worker_loop_cpu_s_per_1k_tokens']:.3f} / worker "
                f"{pair[m]['worker_cpu_s_per_1k_tokens']:.3f} / gateway "
                f"{pair[m]['gateway_cpu_s_per_1k_tokens']:.3f} cpu-s per 1k tokens"
                for m in MODES), flush=True)
            rec["trials"] = trials
            rec.save()
    finally:
        for c in clusters.values():
            c.stop()

    def med(mode, key):
        return statistics.median(t[mode][key] for t in trials)
    summary = {m: {k: med(m, k) for k in (
        "output_tok_s", "worker_cpu_s_per_1k_tokens", "worker_loop_cpu_s_per_1k_tokens",
        "gateway_cpu_s_per_1k_tokens", "ttft_p50_ms")} for m in MODES}
    summary["median_tok_s_ratio"] = statistics.median(
        t["many"]["output_tok_s"] / t["per_request"]["output_tok_s"] for t in trials)
    for ratio, key in (("loop_cpu_ratio", "worker_loop_cpu_s_per_1k_tokens"),
                       ("worker_cpu_ratio", "worker_cpu_s_per_1k_tokens"),
                       ("gateway_cpu_ratio", "gateway_cpu_s_per_1k_tokens")):
        base = summary["per_request"][key]  # 0 in a run too short for the clock's ticks
        summary[ratio] = summary["many"][key] / base if base else None
    rec["summary"] = summary
    rec.doc["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(summary, indent=2))
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
