"""What the OpenAI-compatible HTTP front costs against gRPC: one colocated cluster (real
processes, real Redis) serving both fronts, driven by ``pdserve bench``'s own runner
(pdserve.benchlib.runner.run_load, ``api`` grpc or openai: streamed, greedy, EOS ignored).

    python3 -m bench.openai_front_cpu --set cpu-mybox              (dummy:tiny: the worst case)
    python3 -m bench.openai_front_cpu --model smollm2-135m --set cpu-mybox
    python3 -m bench.openai_front_cpu --pairs 1 --requests 16 --out /tmp/front.json   (quick)

Trials alternate grpc, openai, then openai, grpc, ... so the slow drifts of a shared machine
hit both alike; each trial has its own prompts (a workload seed per trial: nothing is in the
prefix cache from an earlier trial). Per pair: output tok/s at --concurrency (16) and TTFT
p50 at concurrency 1; reported: the medians of the per-pair ratio (openai / grpc) and of the
added TTFT, and, much less noisy on a shared machine, the gateway's CPU time (from /proc) per
request with each front. Targets (issue 25): throughput >= 0.95x, added p50 TTFT <= 5 ms.
With --pin (default) the serving processes and the runner get CPUs of their own.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

from pdserve.benchlib import affinity, harness, metrics, workload
from pdserve.benchlib.runner import LoadSpec, run_load

FIGURES = [
    harness.Figure("HTTP / gRPC output throughput at concurrency 16 (median of pairs)", "",
                   ("summary", "median_throughput_ratio"), format=".3f"),
    harness.Figure("added TTFT p50 at concurrency 1 (median of pairs)", "ms",
                   ("summary", "median_added_ttft_p50_ms"), format=".2f"),
    harness.Figure("gateway CPU per request, HTTP / gRPC", "",
                   ("summary", "gateway_cpu_ratio"), format=".3f"),
]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def items(a, n: int, seed: int) -> list:
    return workload.generate(workload.WorkloadSpec(
        kind="random", num_requests=n, seed=seed, input_len=(a.input_lo, a.input_hi),
        output_len=(a.max_tokens, a.max_tokens)))


def trial(cluster, api: str, its, concurrency: int) -> dict:
    addr = cluster.address if api == "grpc" else cluster.http_address
    gw = cluster.gateway.proc.pid
    c0 = cpu_s(gw)
    res = asyncio.run(run_load(addr, its, LoadSpec(concurrency=concurrency, api=api),
                               progress=False))
    cpu = cpu_s(gw) - c0
    s = metrics.summarize(res)
    return {"api": api, "concurrency": concurrency, "ok": s["num_ok"], "requests": len(res),
            "output_tok_s": s["output_token_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "e2e_p50_ms": s["e2e_ms"]["p50"],
            "gateway_cpu_ms_per_request": 1000 * cpu / max(len(res), 1),
            "errors": s["errors_by_code"]}


def pair(cluster, a, i: int) -> dict:
    order = ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc")
    out: dict = {"order": order}
    for conc, n, key in ((a.concurrency, a.requests, "load"), (1, a.ttft_requests, "ttft")):
        for k, api in enumerate(order):
            seed = 1000 * i + 10 * k + (conc == 1)
            out[f"{key}_{api}"] = trial(cluster, api, items(a, n, seed), conc)
    out["throughput_ratio"] = out["load_openai"]["output_tok_s"] / out["load_grpc"]["output_tok_s"]
    out["added_ttft_p50_ms"] = out["ttft_openai"]["ttft_p50_ms"] - out["ttft_grpc"]["ttft_p50_ms"]
    print(f"pair {i}: conc {a.concurrency} grpc {out['load_grpc']['output_tok_s']:.0f} tok/s, "
          f"openai {out['load_openai']['output_tok_s']:.0f} tok/s (x{out['throughput_ratio']:.3f}); "
          f"conc 1 TTFT p50 grpc {out['ttft_grpc']['ttft_p50_ms']:.1f} ms, openai "
          f"{out['ttft_openai']['ttft_p50_ms']:.1f} ms ({out['added_ttft_p50_ms']:+.2f})",
          flush=True)
    return out


def summary(pairs: list[dict]) -> dict:
    ratios = [p["throughput_ratio"] for p in pairs]
    added = [p["added_ttft_p50_ms"] for p in pairs]

    def cpu(api):
        return statistics.median(p[f"load_{api}"]["gateway_cpu_ms_per_request"] for p in pairs)
    return {"median_throughput_ratio": statistics.median(ratios),
            "throughput_ratio_range": [min(ratios), max(ratios)],
            "median_added_ttft_p50_ms": statistics.median(added),
            "added_ttft_p50_ms_range": [min(added), max(added)],
            "gateway_cpu_ms_per_request_grpc": cpu("grpc"),
            "gateway_cpu_ms_per_request_openai": cpu("openai"),
            # None in a run too short for the clock's ticks (the gRPC side measured 0 ms)
            "gateway_cpu_ratio": cpu("openai") / cpu("grpc") if cpu("grpc") else None,
            "target": "median_throughput_ratio >= 0.95 and median_added_ttft_p50_ms <= 5"}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.openai_front_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="per throughput trial")
    ap.add_argument("--ttft-requests", type=int, default=16, help="per concurrency-1 trial")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--input-lo", type=int, default=32)
    ap.add_argument("--input-hi", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="the serving processes on every CPU but the last, the runner on the "
                         "last (pdserve.benchlib.affinity): the client's CPU is not taken "
                         "from the gateway it measures")
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    harness.add_output_args(ap, "openai_front_cpu")
    a = ap.parse_args(argv)
    from pdserve.cluster import LocalCluster
    rec = harness.Recorder.start("openai_front_cpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    rec["note"] = a.note
    with LocalCluster(a.model, prefill=0, decode=0, colocated=1, http_port=0) as c:
        split = affinity.split_cluster(c) if a.pin else None
        rec["cpus"] = split or {"server": "all", "client": "all"}
        for api in ("grpc", "openai"):  # warm-up: connections, the engine's first steps
            trial(c, api, items(a, 8, 99999), 4)
        pairs = []
        for i in range(a.pairs):
            pairs.append(pair(c, a, i))
            rec["pairs"] = pairs
            rec.save()
    rec["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    rec["summary"] = summary(pairs)
    print(rec["summary"])
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
