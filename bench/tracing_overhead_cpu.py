"""What tracing costs: the same serving workload on two identical 1P1D clusters (real processes,
real Redis, KV over tcp), one with tracing off and one exporting every span over OTLP/gRPC to
a collector in this process (pdserve.otlp_receiver), sampler always_on.

    python3 -m bench.tracing_overhead_cpu --model smollm2-135m --set cpu-mybox
    python3 -m bench.tracing_overhead_cpu --set cpu-mybox      (dummy:tiny: the worst case)
    python3 -m bench.tracing_overhead_cpu --pairs 1 --streams 2 --rounds 1 --max-tokens 4 \\
        --out /tmp/tracing.json                                (quick)

Both clusters run at once; trials alternate off, on, off, on, ... so slow drifts of a shared,
noisy machine hit both alike. One trial: --streams closed-loop streams each send --rounds
requests back to back (greedy, EOS ignored, --max-tokens new tokens, prompts of 64-192 random
token ids). Reported: output tok/s of every trial, the ratio on/off of each adjacent pair, and
their median and spread; and, much less noisy on a shared machine, the CPU time the services
(gateway + workers, read from /proc) spent per request with tracing off and on. Target: tracing
on keeps >= 97% of the throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from bench.serving_cpu import gateway_trial, make_prompts, proc_cpu_s
from pdserve.benchlib import harness

FIGURES = [
    harness.Figure("throughput with tracing on / off (median of pairs)", "",
                   ("summary", "median_ratio_on_off"), format=".3f"),
    harness.Figure("service CPU added per request by tracing", "",
                   ("summary", "service_cpu_overhead"), format="+.1%"),
]


def cluster_cpu_s(cluster) -> float:
    """CPU seconds (user + system, all threads) used so far by the cluster's services."""
    return sum(proc_cpu_s(svc.proc.pid) for svc in [cluster.gateway, *cluster.workers])


def timed_trial(cluster, prompts, args, tag) -> dict:
    cpu0 = cluster_cpu_s(cluster)
    res = asyncio.run(gateway_trial(cluster.address, prompts, args, tag))
    res["service_cpu_s"] = cluster_cpu_s(cluster) - cpu0
    res["service_cpu_ms_per_request"] = 1000 * res["service_cpu_s"] / res["requests"]
    return res


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.tracing_overhead_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=6, help="off/on trial pairs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    harness.add_output_args(ap, "tracing_overhead_cpu")
    a = ap.parse_args(argv)

    from pdserve.cluster import LocalCluster
    from pdserve.otlp_receiver import OtlpReceiver
    from engine.loader import load_config
    prompts = make_prompts(a.streams * a.rounds, load_config(a.model).vocab_size)
    rec = harness.Recorder.start("tracing_overhead_cpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    doc = rec.doc
    doc["note"] = a.note
    wargs = ("--num-threads", str(a.threads))
    off_env = {"OTEL_TRACES_EXPORTER": "none"}
    with OtlpReceiver() as rx:
        on_env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
                  "OTEL_TRACES_SAMPLER": "always_on"}
        with LocalCluster(a.model, prefill=1, decode=1, env=off_env, worker_args=wargs) as off, \
                LocalCluster(a.model, prefill=1, decode=1, env=on_env, worker_args=wargs) as on:
            for c, tag in ((off, "warm-off"), (on, "warm-on")):
                asyncio.run(gateway_trial(c.address, prompts[:4], argparse.Namespace(
                    **{**vars(a), "streams": 2, "rounds": 1}), tag))
            trials = []
            for i in range(a.pairs):
                order = ((off, "off"), (on, "on")) if i % 2 == 0 else ((on, "on"), (off, "off"))
                pair = {}
                for c, tag in order:
                    pair[tag] = timed_trial(c, prompts, a, f"{tag}{i}")
                ratio = pair["on"]["output_tok_s"] / pair["off"]["output_tok_s"]
                print(f"pair {i}: off {pair['off']['output_tok_s']:.1f} tok/s "
                      f"{pair['off']['service_cpu_ms_per_request']:.1f} cpu-ms/req, on "
                      f"{pair['on']['output_tok_s']:.1f} tok/s "
                      f"{pair['on']['service_cpu_ms_per_request']:.1f} cpu-ms/req, "
                      f"ratio {ratio:.3f}", flush=True)
                trials.append({"off": pair["off"], "on": pair["on"], "ratio_on_off": ratio})
            time.sleep(1.0)  # let the last batch of spans arrive
        spans = rx.snapshot()
    ratios = [t["ratio_on_off"] for t in trials]
    off_tps = [t["off"]["output_tok_s"] for t in trials]
    on_tps = [t["on"]["output_tok_s"] for t in trials]
    cpu_off = [t["off"]["service_cpu_ms_per_request"] for t in trials]
    cpu_on = [t["on"]["service_cpu_ms_per_request"] for t in trials]
    traced_requests = len({s.trace_id for s in spans if s.name == "gateway.Generate"})
    doc["trials"] = trials
    doc["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["summary"] = {
        "median_ratio_on_off": statistics.median(ratios),
        "min_ratio": min(ratios), "max_ratio": max(ratios),
        "ratio_of_totals": sum(on_tps) / sum(off_tps),
        "off_tok_s_median": statistics.median(off_tps),
        "on_tok_s_median": statistics.median(on_tps),
        "off_tok_s_range": [min(off_tps), max(off_tps)],
        "on_tok_s_range": [min(on_tps), max(on_tps)],
        "service_cpu_ms_per_request_off_median": statistics.median(cpu_off),
        "service_cpu_ms_per_request_on_median": statistics.median(cpu_on),
        # None in a run too short for the clock's ticks (the off trials measured 0 ms)
        "service_cpu_overhead": (statistics.median(cpu_on) / statistics.median(cpu_off) - 1
                                 if statistics.median(cpu_off) else None),
        "spans_received": len(spans), "traces_received": traced_requests,
        "target": "median_ratio_on_off >= 0.97",
    }
    print(json.dumps(doc["summary"], indent=2))
    print(f"wrote {rec.save()}")
    return doc


if __name__ == "__main__":
    main()
