"""Where the time of one disaggregated request goes before its first token (from its trace).

Starts a 1P1D LocalCluster with tracing on (spans go to an in-process OTLP collector), sends
``--requests`` prompts of ``--prompt-len`` random tokens one at a time (max_tokens 2, greedy),
and prints, per span name, the median start and duration relative to the gateway's span
start: the gateway's routing, the decode worker's pre-allocation and remote-prefill call, the
prefill worker's queueing, compute and KV transfer, the decode worker's KV wait. The KV
transfer starts with the request (its handshake and finished chunks overlap the compute), so
what it adds is its end minus the compute's end (``end_ms_p50``).

    python3 -m bench.ttft_breakdown --model dummy:tiny --set cpu-mybox             (CPU)
    python3 -m bench.ttft_breakdown --devices gpu --kv-backend nccl,cuda_ipc \\
        --set h200-mycommit                                                        (2 GPUs)
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import defaultdict

from pdserve import client
from pdserve.benchlib import harness
from pdserve.cluster import LocalCluster
from pdserve.otlp_receiver import OtlpReceiver

GiB = 1 << 30
FIGURES = [
    harness.Figure(f"{what} ends, after the gateway's span starts", "ms",
                   ("spans", {"span": span}, "end_ms_p50"), format=".1f")
    for what, span in (("prefill compute", "pdserve-prefill/prefill.compute"),
                       ("KV transfer", "pdserve-prefill/kv.transfer"),
                       ("the decode worker's prefill call", "pdserve-decode/prefill.remote"))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m bench.ttft_breakdown",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--devices", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--kv-backend", default="tcp")
    p.add_argument("--prompt-len", type=int, default=None, help="[4096 gpu, 512 cpu]")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=None, help="token ids drawn below this")
    harness.add_output_args(p, "ttft_breakdown")
    return p.parse_args(argv)


async def _one(address: str, ids: list[int]) -> None:
    from protos.pdserve.v1 import gateway_pb2_grpc

    req = client.make_request(token_ids=ids, max_tokens=2, temperature=0.0)  # 1 sends no KV
    async with client.channel(address) as ch:
        await client.generate(gateway_pb2_grpc.GatewayStub(ch), req, timeout=60)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    rec = harness.Recorder.start("ttft_breakdown", a, argv=argv, about=__doc__, figures=FIGURES)
    gpu = a.devices == "gpu"
    plen = a.prompt_len or (4096 if gpu else 512)
    vocab = a.vocab or (128000 if gpu else 250)
    wargs = ["--dtype", "bfloat16" if gpu else "float32"]
    devices = None
    if gpu:
        wargs += ["--kv-cache-memory-bytes", str(40 * GiB), "--max-model-len", "8192",
                  "--max-num-batched-tokens", "2048"]
        devices = {"prefill": ["cuda:0"], "decode": ["cuda:1"]}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(plen)]
               for _ in range(a.warmup + a.requests)]
    with OtlpReceiver() as rx:
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
        with LocalCluster(a.model, prefill=1, decode=1, kv_backend=a.kv_backend,
                          worker_args=tuple(wargs), env=env, devices=devices) as cluster:
            for ids in prompts[:a.warmup]:
                asyncio.run(_one(cluster.address, ids))
            time.sleep(1.0)
            n_warm = len({s.trace_id for s in rx.spans if s.name == "gateway.Generate"})
            for ids in prompts[a.warmup:]:
                asyncio.run(_one(cluster.address, ids))
            time.sleep(1.5)
            spans = rx.wait_for(lambda s: sum(x.name == "gateway.Generate" for x in s)
                                >= n_warm + a.requests, timeout_s=20)
    traces = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    roots = sorted((s for s in spans if s.name == "gateway.Generate"), key=lambda s: s.start_ns)
    measured = roots[-a.requests:]
    rel: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for root in measured:
        for s in traces[root.trace_id]:
            rel[f"{s.service}/{s.name}"].append(((s.start_ns - root.start_ns) / 1e6,
                                                 (s.end_ns - s.start_ns) / 1e6))
    table = []
    for name, xs in rel.items():
        table.append({"span": name, "n": len(xs),
                      "start_ms_p50": round(statistics.median(x[0] for x in xs), 3),
                      "duration_ms_p50": round(statistics.median(x[1] for x in xs), 3),
                      "end_ms_p50": round(statistics.median(x[0] + x[1] for x in xs), 3)})
    table.sort(key=lambda r: r["start_ms_p50"])
    print(f"{'span':48s} {'start ms':>9s} {'dur ms':>9s} {'end ms':>9s}   "
          f"(medians over {a.requests} requests)")
    for r in table:
        print(f"{r['span']:48s} {r['start_ms_p50']:9.2f} {r['duration_ms_p50']:9.2f} "
              f"{r['end_ms_p50']:9.2f}")
    rec["settings"] = vars(a) | {"prompt_len": plen}
    rec["spans"] = table
    rec["note"] = "start/duration relative to the gateway's Generate span start; medians"
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
