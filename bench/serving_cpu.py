"""Serving overhead on CPU: 16 concurrent streams through the full gRPC path (gateway ->
workers, real processes, real Redis) against the in-process engine on the same prompts.

    python3 -m bench.serving_cpu --set cpu-mybox
    python3 -m bench.serving_cpu --threads 1 --set cpu-mybox       (equal thread counts)
    python3 -m bench.serving_cpu --model dummy:tiny --streams 2 --rounds 1 --max-tokens 4 \\
        --out /tmp/serving.json                                     (quick)

Each of --streams closed-loop streams sends --rounds requests back to back (greedy, EOS
ignored, --max-tokens new tokens, prompts of 64-192 tokens). Reported per deployment: output
tok/s, TTFT p50/p90 under that load (mostly queueing), the TTFT p50 of requests sent one at a
time (the path's own latency: gRPC hops, routing, KV transfer), and the ratios/differences to
the in-process engine (AsyncEngine driven by the same asyncio client loop in this process).
Deployments: colocated (1 worker, gateway in front) and 1P1D (prefill and decode workers, KV
over tcp). The clusters are what ``pdserve up`` runs: mutual TLS between the services, KV
inside TLS, Redis with a password; ``--insecure`` runs them plaintext (the TLS cost is the
ratio of the two). The KV transfer GB/s comes from bench/kv_transfer_cpu.py (tcp and shm between two
processes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from pdserve.benchlib import harness
from pdserve.benchlib.metrics import percentile

FIGURES = [
    harness.Figure("colocated throughput / in-process", "",
                   ("summary", "colocated", "throughput_ratio"), format=".2f"),
    harness.Figure("1P1D throughput / in-process", "", ("summary", "1p1d", "throughput_ratio"),
                   format=".2f"),
    harness.Figure("1P1D TTFT p50 added, one request at a time", "ms",
                   ("summary", "1p1d", "added_ttft_p50_ms_single"), format=".1f"),
]


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 64-192 random token ids in [100, min(vocab - 1, 40000))."""
    import random
    rng = random.Random(seed)
    hi = min(vocab - 1, 40000)
    return [[rng.randrange(min(100, hi // 2), hi) for _ in range(rng.randrange(64, 193))]
            for _ in range(n)]


def summarize(results, wall) -> dict:
    ttft = [r["ttft"] for r in results]
    toks = sum(r["tokens"] for r in results)
    return {"requests": len(results), "output_tokens": toks, "wall_s": wall,
            "output_tok_s": toks / wall, "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p90_ms": 1000 * percentile(ttft, 90)}


async def single_ttft(submit, prompts, n: int = 8) -> float:
    """TTFT p50 of ``n`` requests sent one at a time (no queueing: the path's own latency)."""
    ttfts = []
    for i in range(n):
        ttfts.append((await submit(f"single-{i}", prompts[i % len(prompts)][:96]))["ttft"])
    return 1000 * statistics.median(ttfts)


async def drive(submit, prompts, streams: int, rounds: int):
    results = []

    async def stream(i):
        for r in range(rounds):
            p = prompts[(i * rounds + r) % len(prompts)]
            results.append(await submit(f"s{i}-r{r}", p))
    t = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(streams)))
    return results, time.perf_counter() - t


def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) a process (all its threads), or one of its threads, has
    used so far, from /proc."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def gateway_trial(address: str, prompts, args, tag: str) -> dict:
    """One closed-loop trial through a gateway: ``args.streams`` streams of ``args.rounds``
    requests (greedy, EOS ignored, ``args.max_tokens`` new tokens); :func:`summarize`'s
    figures plus the messages the client received."""
    from pdserve import client
    from protos.pdserve.v1 import gateway_pb2_grpc
    async with client.channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def submit(rid, p):
            comp = await client.generate(stub, client.make_request(
                token_ids=p, request_id=f"{tag}-{rid}", max_tokens=args.max_tokens,
                temperature=0.0, ignore_eos=True), timeout=600)
            return {"ttft": comp.ttft_s, "tokens": comp.completion_tokens,
                    "messages": len(comp.token_times)}
        res, wall = await drive(submit, prompts, args.streams, args.rounds)
    return dict(summarize(res, wall), client_messages=sum(r["messages"] for r in res))


async def bench_inprocess(args, prompts):
    import torch
    from engine.async_engine import AsyncEngine
    from engine.engine import LLMEngine
    from engine.llm import build_engine_config
    from engine.request import SamplingParams
    torch.set_num_threads(args.threads)
    eng = AsyncEngine(LLMEngine(build_engine_config(args.model)))
    await eng.start()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    async def submit(rid, p):
        t = time.perf_counter()
        ttft, n = None, 0
        async for out in eng.generate(rid, p, sp):
            if ttft is None:
                ttft = time.perf_counter() - t
            n += len(out.token_ids)
        return {"ttft": ttft, "tokens": n}
    await drive(submit, prompts[:2], 2, 1)  # warm-up
    res, wall = await drive(submit, prompts, args.streams, args.rounds)
    single = await single_ttft(submit, prompts)
    await eng.stop()
    return dict(summarize(res, wall), single_ttft_p50_ms=single)


async def bench_cluster(args, prompts, **kw):
    from pdserve import client
    from pdserve.cluster import LocalCluster
    from protos.pdserve.v1 import gateway_pb2_grpc
    c = LocalCluster(args.model, secure=not args.insecure, **kw).start()
    try:
        async with client.channel(c.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)

            async def submit(rid, p):
                comp = await client.generate(stub, client.make_request(
                    token_ids=p, request_id=rid, max_tokens=args.max_tokens, temperature=0.0,
                    ignore_eos=True), timeout=600)
                return {"ttft": comp.ttft_s, "tokens": comp.completion_tokens}
            await drive(submit, prompts[:2], 2, 1)
            res, wall = await drive(submit, prompts, args.streams, args.rounds)
            single = await single_ttft(submit, prompts)
        return dict(summarize(res, wall), single_ttft_p50_ms=single)
    finally:
        c.stop()


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.serving_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch threads of the in-process engine")
    ap.add_argument("--worker-threads", type=int, default=1,
                    help="torch threads per worker process (the gateway and the client need "
                         "a core too: more threads than free cores stalls OpenMP)")
    ap.add_argument("--insecure", action="store_true",
                    help="plaintext clusters (no mutual TLS, Redis without a password)")
    ap.add_argument("--deployments", default="colocated,1p1d",
                    help="comma list of colocated, 1p1d")
    ap.add_argument("--skip-inprocess", action="store_true",
                    help="no in-process baseline (ratios are then left out)")
    harness.add_output_args(ap, "serving_cpu")
    a = ap.parse_args(argv)
    from engine.loader import load_config
    prompts = make_prompts(a.streams * a.rounds, load_config(a.model).vocab_size)
    figures = FIGURES if not a.skip_inprocess else [
        harness.Figure(f"{d} output tok/s", "tok/s", (d, "output_tok_s"), format=".1f")
        for d in a.deployments.split(",") if d]
    rec = harness.Recorder.start("serving_cpu", a, argv=argv, about=__doc__, figures=figures)
    if not a.skip_inprocess:
        rec["inprocess"] = asyncio.run(bench_inprocess(a, prompts))
        print("in-process", rec["inprocess"], flush=True)
    wargs = ("--num-threads", str(a.worker_threads))
    names = [d for d in a.deployments.split(",") if d]
    shapes = {"colocated": dict(prefill=0, decode=0, colocated=1), "1p1d": {}}
    for name in names:
        rec[name] = asyncio.run(bench_cluster(a, prompts, worker_args=wargs, **shapes[name]))
        print(name, rec[name], flush=True)
    if a.skip_inprocess:
        print(f"wrote {rec.save()}")
        return rec.doc
    base = rec["inprocess"]
    summary = {
        name: {"throughput_ratio": rec[name]["output_tok_s"] / base["output_tok_s"],
               "added_ttft_p50_ms_under_load": rec[name]["ttft_p50_ms"] - base["ttft_p50_ms"],
               "added_ttft_p50_ms_single": rec[name]["single_ttft_p50_ms"]
               - base["single_ttft_p50_ms"]}
        for name in names}
    summary["targets"] = {"throughput_ratio": ">= 0.85", "added_ttft_p50_ms": "<= 20"}
    rec["summary"] = summary
    print(json.dumps(summary, indent=2))
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
