"""1P1D against two colocated workers on a two-GPU machine, through the whole
product: a real redis-server, a real gateway, real worker processes (pdserve.cluster.LocalCluster).

    python3 -m bench.disagg_gpu --set h200-mycommit
        (2 x H200: about 7.5 min; --time-budget 540 s drops the top rates if start-up is slow)
    python3 -m bench.disagg_gpu --quick --devices cpu --model dummy:tiny --dtype float32 \\
        --kv-backend tcp --out /tmp/disagg_cpu.json              (CPU smoke run, ~40 s)
    python3 -m bench.disagg_gpu --print-commands ...             (the worker command lines)

Deployments, one after the other (never at the same time), same workload for both:

- ``1p1d``: a prefill worker on cuda:0 and a decode worker on cuda:1, KV over ``--kv-backend``
  (default nccl).
- ``colocated``: two colocated workers, cuda:0 and cuda:1; the gateway balances requests over
  them by load and each request is prefilled and decoded by one worker (no KV transfer: the
  backend they are started with, ``--colocated-kv-backend``, default the same, is unused;
  tcp cannot start on a GPU cache).

Every worker sees both GPUs (no CUDA_VISIBLE_DEVICES); LocalCluster sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 in every process.

Worker settings on the GPU (the same for both deployments; ``--worker-args`` appends/overrides):
``--dtype bfloat16 --kv-cache-memory-bytes 40GiB --max-model-len 8192 --max-num-seqs 128
--max-num-batched-tokens 2048``. The token budget is the chunked-prefill chunk: a colocated
worker runs at most 2048 prompt tokens in a step that its running requests wait on (~50 ms
for Llama-3-8B on an H200, about the TPOT SLO), a 4096-token prompt takes two such steps. 2048
keeps prefill GEMMs compute-bound (so TTFT stays near the unchunked 4096-token figure) while
bounding the colocated decode stall: a strong colocated baseline. A bigger budget (8192)
would double the colocated stall (one ~105 ms step per long prompt) and flatter 1P1D's ITL;
a smaller one (512) would cut the stall but cost prefill efficiency on both sides.
Workers also get PDSERVE_GEMV=off (``--gemv``): the per-process GEMV tuner may pick different
kernels in different workers, and bf16 rounding differences flip greedy near-ties between the
deployments; only batch-1 decode steps use the GEMV, so the mixed workload barely notices.

Conditional disaggregation (``1p1d`` only, off by default): ``--gateway-args
'--local-prefill-max-tokens 512 --local-prefill-queue-tokens 8192'`` has the gateway send a
short prompt to the decode worker alone while the prefill worker has that many prompt tokens
queued, and ``--decode-worker-args '--max-num-batched-tokens 512'`` bounds the stall such a
local prefill adds to the decode worker's running requests. docs/performance.md has what it
did on two H200s; plain 1P1D is the default. Each rate's routing decisions by mode
(``local_prefill`` among them) are recorded from the gateway's /metrics.

Rates: ``4,8,12,16,20,24,28,32`` req/s by default (a grid fine enough to place each
deployment's highest rate with 90% of requests within the SLO). Prefill of this mix costs
~1,260 tokens per request (~35-40 ms of one H200): 1P1D's single prefill GPU nears
saturation around 25-30 req/s, two colocated GPUs share prefill and decode; the low rates
show the ITL cost of prefill interference, the top rate where 1P1D's prefill side runs out.

Per deployment, after start-up and a warm-up (bursts of long and short prompts, so every
worker has compiled its kernels and seen mixed steps; not measured):

a. TTFT of ``--prompt-len`` (4096) token prompts, sent one at a time (``--ttft-repeats``
   distinct random prompts: no prefix-cache hits); ``ttft_added_pct`` = 1P1D median /
   colocated median - 1 (target <= 5%).
b. Token-exactness: the same ``--exact-prompts`` prompts of mixed lengths (up to
   ``--prompt-len``), greedy, ``--exact-max-tokens`` tokens, one at a time; the token ids of
   the two deployments must be identical. Agreement under load (the mixed-workload requests,
   same items at the same send times in both deployments) is reported separately: batch
   composition differs between the deployments, and in bf16 that can flip a near-tie.
c. The mixed workload at each rate of ``--rates``: Poisson arrivals for ``--duration`` s
   (or ``--num-requests``), a ``--long-frac`` of prompts ``--prompt-len`` tokens long, the rest
   ``--short-len`` (LO:HI), ``--output-len`` (LO:HI) new tokens, EOS ignored, greedy (benchlib
   workload ``longmix`` in token ids; new prompts at every rate, the same for both
   deployments). Per rate and deployment: benchlib's summary (TTFT/TPOT/ITL/E2E percentiles,
   throughput, goodput under TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``), TTFT of
   long and short prompts apart; and the ratios colocated p99 ITL / 1P1D p99 ITL (target >= 3)
   and 1P1D goodput / colocated goodput (target >= 1.3).

Prompts come from bench/disagg_workload.py, figures are defined in pdserve.benchlib.metrics,
the comparison and the printed summary live in bench/disagg_report.py. Progress lines carry
timestamps; the JSON is rewritten after every phase, so a killed run leaves what it had
measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import sys
import time

from bench.disagg_report import FIGURES, compare, print_summary, settings
from bench.disagg_workload import exact_items, rate_items, rate_seed, ttft_items, warmup_items
from pdserve.benchlib import harness, metrics
from pdserve.benchlib.metrics import RequestResult
from pdserve.benchlib.runner import LoadSpec, run_load
from pdserve.benchlib.workload import Item, parse_range
from pdserve.cluster import LocalCluster

GiB = 1 << 30
T0 = time.monotonic()
MIXED_TOKENS: dict[tuple[str, int], dict[str, list[int]]] = {}  # (deployment, rate index)

# What changes between a GPU run and the CPU smoke run (--quick): None = flag not given.
GPU_DEFAULTS = dict(rates="4,8,12,16,20,24,28,32", duration=20.0, ttft_repeats=8, exact_prompts=8,
                    exact_max_tokens=32, warmup_rounds=2, warmup_size=8, short_len="128:512",
                    output_len="128:256", timeout=60.0, startup_timeout=420.0,
                    time_budget=540.0, gateway_args="", decode_worker_args="",
                    prefill_worker_args="")
QUICK_DEFAULTS = dict(prompt_len=512, rates="2,4", duration=5.0, ttft_repeats=3,
                      exact_prompts=6, exact_max_tokens=16, warmup_rounds=1, warmup_size=4,
                      short_len="16:64", output_len="8:16", timeout=60.0, startup_timeout=180.0,
                      time_budget=0.0, gateway_args="", decode_worker_args="",
                      prefill_worker_args="")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------ settings
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    harness.add_output_args(p, "disagg_gpu")
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv-backend", default="nccl", help="1P1D KV transfer backend")
    p.add_argument("--colocated-kv-backend", default="same",
                   help="backend the colocated workers are started with ('same': "
                        "--kv-backend); they never transfer KV, the flag only matters if "
                        "that backend cannot start there (then e.g. 'fake')")
    p.add_argument("--devices", default="gpu", choices=["gpu", "cpu"],
                   help="gpu: 1P1D prefill cuda:0 + decode cuda:1, colocated cuda:0 + cuda:1")
    p.add_argument("--deployments", default="1p1d,colocated",
                   help="which to run, in order (both are needed for the ratios)")
    p.add_argument("--worker-args", default="",
                   help="extra worker flags, appended after the defaults (later flags win)")
    p.add_argument("--no-default-worker-args", action="store_true",
                   help="do not pass the GPU worker defaults (only --dtype and --worker-args; "
                        "--decode-worker-args has its own default)")
    p.add_argument("--gateway-args", default=None,
                   help="1P1D only: extra gateway flags, e.g. '--local-prefill-max-tokens 512 "
                        "--local-prefill-queue-tokens 8192' (conditional disaggregation) [none]")
    p.add_argument("--decode-worker-args", default=None,
                   help="1P1D only: extra flags of the decode worker, after --worker-args "
                        "[none]")
    p.add_argument("--prefill-worker-args", default=None,
                   help="1P1D only: extra flags of the prefill worker, after --worker-args, "
                        "e.g. '--max-num-batched-tokens 8192' (no decodes to protect) [none]")
    p.add_argument("--gemv", default="off", choices=["off", "auto", "force", "unset"],
                   help="GPU: PDSERVE_GEMV of every worker. 'auto' times Triton GEMV configs "
                        "against cuBLAS in each process and may pick different kernels in "
                        "different workers (bf16 rounding differs -> greedy near-ties flip "
                        "between deployments); 'off' (cuBLAS) is the same in every process. "
                        "Only batch-1 decode steps use it")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of every service (repeatable)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="s of wall time for the whole run: a rate whose send window would "
                        "end past its deployment's share (budget x k/n for the k-th of n) is "
                        "skipped, and later deployments run only the rates the first one ran "
                        "(0: no limit) [GPU 450, --quick 0]")
    p.add_argument("--quick", action="store_true", help="scaled-down run (CPU smoke test)")
    p.add_argument("--print-commands", action="store_true",
                   help="print each deployment's worker command lines and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=0,
                   help="prompt token ids are drawn from [10, V) (0: the dummy model's vocab)")
    w = p.add_argument_group("workload (defaults: GPU values; --quick scales them down)")
    w.add_argument("--prompt-len", type=int, default=None, help="long prompt tokens [4096]")
    w.add_argument("--rates", default=None, help="mixed workload req/s, rising [4,8,...,32]")
    w.add_argument("--duration", type=float, default=None, help="s of arrivals per rate [20]")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests per rate instead of --duration")
    w.add_argument("--long-frac", type=float, default=0.25)
    w.add_argument("--short-len", default=None, help="short prompt tokens LO:HI [128:512]")
    w.add_argument("--output-len", default=None, help="new tokens LO:HI [128:256]")
    w.add_argument("--ttft-repeats", type=int, default=None, help="[8]")
    w.add_argument("--ttft-max-tokens", type=int, default=4)
    w.add_argument("--exact-prompts", type=int, default=None, help="[8]")
    w.add_argument("--exact-max-tokens", type=int, default=None, help="[32]")
    w.add_argument("--warmup-rounds", type=int, default=None, help="[2]")
    w.add_argument("--warmup-size", type=int, default=None, help="requests per round [8]")
    w.add_argument("--timeout", type=float, default=None, help="per request deadline (s) [60]")
    w.add_argument("--startup-timeout", type=float, default=None, help="per cluster (s) [420]")
    w.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    w.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--note", default="", help="free text stored in the JSON")
    p.add_argument("--echo", action="store_true", help="echo the services' logs")
    return p


def resolve(a) -> argparse.Namespace:
    base = dict(GPU_DEFAULTS, prompt_len=4096)
    if a.quick:
        base.update(QUICK_DEFAULTS)
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.rate_list = [float(x) for x in a.rates.split(",") if x.strip()]
    a.short = parse_range(a.short_len)
    a.out_range = parse_range(a.output_len)
    a.deps = [d.strip() for d in a.deployments.split(",") if d.strip()]
    for d in a.deps:
        if d not in DEPLOYMENTS:
            raise SystemExit(f"unknown deployment {d!r}; known: {', '.join(DEPLOYMENTS)}")
    if not a.vocab_size:
        a.vocab_size = _model_vocab(a.model)
    if a.colocated_kv_backend == "same":
        a.colocated_kv_backend = a.kv_backend
    a.worker_env = dict(kv.split("=", 1) for kv in a.env)
    if a.devices == "gpu" and a.gemv != "unset":
        a.worker_env.setdefault("PDSERVE_GEMV", a.gemv)
    elif a.devices != "gpu":
        a.gemv = "unset"  # a GPU-only setting
    a.ran_rates = None  # the rates the first deployment ran (later ones run the same)
    return a


def _model_vocab(model: str) -> int:
    if model.startswith("dummy:"):
        from engine.loader.dummy import dummy_config
        return dummy_config(model.split(":", 1)[1]).vocab_size
    return 32000  # any real tokenizer has at least this many ids; --vocab-size to change


DEPLOYMENTS = {
    "1p1d": dict(counts=dict(prefill=1, decode=1, colocated=0),
                 gpu={"prefill": ["cuda:0"], "decode": ["cuda:1"]}),
    "colocated": dict(counts=dict(prefill=0, decode=0, colocated=2),
                      gpu={"colocated": ["cuda:0", "cuda:1"]}),
    # the same colocated deployment again: a control for the agreement under load (how many
    # greedy tokens differ between two runs of ONE deployment, from batching alone)
    "colocated_rerun": dict(counts=dict(prefill=0, decode=0, colocated=2),
                            gpu={"colocated": ["cuda:0", "cuda:1"]}),
}


def worker_args(a) -> list[str]:
    args = ["--dtype", a.dtype]
    if a.devices == "gpu" and not a.no_default_worker_args:
        args += ["--kv-cache-memory-bytes", str(40 * GiB), "--max-model-len", "8192",
                 "--max-num-seqs", "128", "--max-num-batched-tokens", "2048"]
    return args + shlex.split(a.worker_args)


def deployment_args(a, name: str) -> tuple[list[str], dict[str, list[str]]]:
    """The gateway's flags and the per-role worker flags of deployment ``name`` (1P1D only:
    conditional disaggregation, each role's token budget)."""
    if name != "1p1d":
        return [], {}
    roles = {role: shlex.split(extra) for role, extra in
             (("prefill", a.prefill_worker_args), ("decode", a.decode_worker_args))}
    return shlex.split(a.gateway_args), {r: x for r, x in roles.items() if x}


# ------------------------------------------------------------------------------ driving
async def drive(address: str, items: list[Item], *, rate: float | None, timeout_s: float,
                seed: int = 0, duration_s: float | None = None, workers=None,
                ) -> tuple[list[RequestResult], dict[str, list[int]], dict]:
    """Send ``items`` (greedy, EOS ignored): one at a time when ``rate`` is None, else Poisson
    arrivals at ``rate`` (math.inf: all at once), stopping sends at ``duration_s``. Returns
    the results in send order, each successful request's generated token ids and, with
    ``workers`` (``{name: address}``), their queues sampled every 0.5 s meanwhile."""
    tokens: dict[str, list[int]] = {}
    load = LoadSpec(rate=rate, concurrency=None if rate is not None else 1,
                    duration_s=duration_s, timeout_s=timeout_s, temperature=0.0, seed=seed)
    sampler = asyncio.ensure_future(sample_workers(workers)) if workers else None
    try:
        results = await run_load(address, items, load, progress=False, tokens=tokens)
    finally:
        queues = {}
        if sampler is not None:
            sampler.cancel()
            queues = await asyncio.gather(sampler, return_exceptions=True)
            queues = queues[0] if isinstance(queues[0], dict) else {}
    return results, tokens, queues


async def sample_workers(workers: dict[str, str], interval_s: float = 0.5) -> dict:
    """Where requests wait during a run: per worker, the max and mean of its running and
    waiting requests, KV transfers in flight and KV blocks in use (its Stats RPC)."""
    import grpc

    from protos.pdserve.v1 import common_pb2, worker_pb2_grpc

    fields = ("num_running", "num_waiting", "active_transfers", "kv_blocks_used")
    seen: dict[str, dict[str, list[int]]] = {n: {f: [] for f in fields} for n in workers}
    from pdserve.cluster import operator_channels
    # as an operator of the (secure by default) local cluster; plaintext for --insecure ones
    channels = {n: operator_channels(a)[0]() for n, a in workers.items()}
    stubs = {n: (worker_pb2_grpc.PrefillWorkerStub if n.startswith("prefill") else
                 worker_pb2_grpc.DecodeWorkerStub)(ch) for n, ch in channels.items()}
    try:
        while True:
            for n, stub in stubs.items():
                try:
                    st = await stub.Stats(common_pb2.StatsRequest(), timeout=2)
                except grpc.aio.AioRpcError:
                    continue
                for f in fields:
                    seen[n][f].append(getattr(st, f))
            await asyncio.sleep(interval_s)
    except asyncio.CancelledError:
        return {n: {f: {"max": max(v), "mean": round(sum(v) / len(v), 2)}
                    for f, v in d.items() if v} for n, d in seen.items()}
    finally:
        for ch in channels.values():
            await ch.close()


def errors_of(results: list[RequestResult]) -> dict:
    out: dict = {}
    for r in results:
        if not r.ok:
            out.setdefault(r.code, r.error)
    return out


def make_cluster(a, name: str) -> LocalCluster:
    spec = DEPLOYMENTS[name]
    gateway_args, role_args = deployment_args(a, name)
    return LocalCluster(a.model, kv_backend=a.kv_backend if name == "1p1d" else
                        a.colocated_kv_backend, worker_args=tuple(worker_args(a)),
                        gateway_args=tuple(gateway_args),
                        role_args={r: tuple(x) for r, x in role_args.items()},
                        devices=spec["gpu"] if a.devices == "gpu" else None,
                        startup_timeout_s=a.startup_timeout, echo=a.echo, env=a.worker_env,
                        metrics=True, **spec["counts"])


def print_commands(a) -> None:
    for name in a.deps:
        c = make_cluster(a, name)
        env = {k: c.env[k] for k in sorted(c.env) if k.startswith(("PDSERVE_", "NCCL_",
                                                                    "TORCH_SYMM", "NVSHMEM_"))}
        print(f"# {name}: environment {env}")
        for role, n in c.counts.items():
            for i in range(n):
                print(f"pdserve {role} " + " ".join(shlex.quote(x)
                                                    for x in c.worker_cmd_args(role, i)))
        print("pdserve gateway " + " ".join(shlex.quote(x) for x in c.gateway_cmd_args()))


def _scrape(port: int, metric: str, label: str) -> dict[str, float]:
    """``{label value: sample}`` of one labelled counter on a service's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    if not port:
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {s.labels[label]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == metric}


def route_counts(cluster: LocalCluster) -> dict[str, float]:
    """The gateway's routing decisions so far, by mode (its /metrics)."""
    return _scrape(cluster.gateway.metrics_port if cluster.gateway else 0,
                   "pdserve_routing_decisions_total", "mode")


def step_paths(cluster: LocalCluster) -> dict[str, dict[str, float]]:
    """Each worker's model runs so far by path (decode_graph, mixed_graph, eager)."""
    return {f"{w.kind}{i}": _scrape(w.metrics_port, "pdserve_engine_steps_total", "path")
            for i, w in enumerate(cluster.workers)}


def kv_received(cluster: LocalCluster) -> dict[str, float]:
    """The decode-side KV transfer counters summed over workers: transfers with a piece
    count, pieces (runs contiguous in both caches), bytes received."""
    out = {"transfers": 0.0, "pieces": 0.0, "bytes": 0.0}
    for w in cluster.workers:
        for key, metric in (("transfers", "pdserve_kv_transfer_pieces_count"),
                            ("pieces", "pdserve_kv_transfer_pieces_sum"),
                            ("bytes", "pdserve_kv_transfer_bytes_total")):
            out[key] += _scrape(w.metrics_port, metric, "direction").get("received", 0.0)
    return out


def kv_pieces(after: dict, before: dict) -> dict:
    """One rate's transfers: how many pieces each moved, and how large they were."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    if not d["transfers"] or not d["pieces"]:
        return {"transfers": int(d["transfers"])}
    return {"transfers": int(d["transfers"]),
            "pieces_per_transfer": round(d["pieces"] / d["transfers"], 2),
            "mib_per_piece": round(d["bytes"] / d["pieces"] / 2**20, 2)}


def _delta(after: dict, before: dict) -> dict:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


def run_deployment(a, name: str, doc: dict, save, deadline: float | None = None) -> dict:
    spec = DEPLOYMENTS[name]
    cluster = make_cluster(a, name)
    dep = {"name": name, "cluster": spec["counts"], "devices": cluster.devices or None,
           "kv_backend": cluster.kv_backend, "worker_args": list(cluster.worker_args),
           "role_args": {r: list(x) for r, x in cluster.role_args.items()},
           "gateway_args": list(cluster.gateway_args)}
    doc["deployments"][name] = dep
    log(f"{name}: starting {spec['counts']} devices={dep['devices']} kv={cluster.kv_backend} "
        f"args={' '.join(dep['worker_args'])}"
        + "".join(f" {r}+={' '.join(x)}" for r, x in dep["role_args"].items())
        + (f" gateway={' '.join(dep['gateway_args'])}" if dep["gateway_args"] else ""))
    t = time.monotonic()
    try:
        cluster.start()
        dep["startup_s"] = round(time.monotonic() - t, 1)
        dep["workers"] = [{"role": w.kind, "address": w.address,
                           "device": _flag(w.proc.args, "--device")} for w in cluster.workers]
        log(f"{name}: up in {dep['startup_s']} s at {cluster.address}")
        save()
        addr = cluster.address

        t = time.monotonic()
        for rnd in range(a.warmup_rounds):
            res, _, _ = asyncio.run(drive(addr, warmup_items(a, rnd), rate=math.inf,
                                       timeout_s=max(a.timeout, 120.0)))
            bad = [r for r in res if not r.ok]
            if bad:
                log(f"{name}: warm-up round {rnd}: {len(bad)} failed: {errors_of(bad)}")
        dep["warmup_s"] = round(time.monotonic() - t, 1)
        log(f"{name}: warm-up done in {dep['warmup_s']} s")

        # a. TTFT of long prompts, one at a time
        res, _, _ = asyncio.run(drive(addr, ttft_items(a), rate=None, timeout_s=a.timeout))
        ttfts = [r.ttft_s for r in res if r.ok]
        dep["ttft"] = {"prompt_len": a.prompt_len, "max_tokens": a.ttft_max_tokens,
                       "num_ok": len(ttfts), "errors": errors_of(res),
                       "ttft_ms": metrics.dist_ms(ttfts),
                       "ttft_ms_each": [round(1000 * x, 2) for x in ttfts]}
        log(f"{name}: TTFT {a.prompt_len}-token prompts: median "
            f"{dep['ttft']['ttft_ms']['p50']} ms, p90 {dep['ttft']['ttft_ms']['p90']} ms "
            f"({len(ttfts)}/{len(res)} ok)")
        save()

        # b. greedy tokens, one at a time
        items = exact_items(a)
        res, toks, _ = asyncio.run(drive(addr, items, rate=None, timeout_s=a.timeout))
        dep["exact"] = {"prompt_lens": [it.prompt_units for it in items],
                        "max_tokens": a.exact_max_tokens, "errors": errors_of(res),
                        "tokens": {it.id: toks.get(it.id) for it in items}}
        log(f"{name}: exactness prompts done ({len(toks)}/{len(items)} ok)")
        save()

        # c. mixed workload at rising rates
        dep["mixed"] = []
        dep["skipped_rates"] = []
        slo_ttft, slo_tpot = a.slo_ttft_ms / 1000, a.slo_tpot_ms / 1000
        for k, rate in enumerate(a.rate_list):
            window = a.duration if not a.num_requests else a.num_requests / rate
            if (a.ran_rates is not None and rate not in a.ran_rates) or (
                    deadline is not None and time.monotonic() + window + 5 > deadline):
                dep["skipped_rates"] = a.rate_list[k:]
                why = ("the first deployment did not run them" if a.ran_rates is not None
                       and rate not in a.ran_rates else f"time budget {a.time_budget:g} s: "
                       f"this deployment's share ends at +{(deadline or T0) - T0:.0f} s")
                log(f"{name}: SKIPPING rates {dep['skipped_rates']} ({why})")
                break
            items = rate_items(a, k, rate)
            long_ids = {it.id for it in items if it.extra.get("long")}
            t = time.monotonic()
            routes0, steps0 = route_counts(cluster), step_paths(cluster)
            kv0 = kv_received(cluster)
            res, toks, queues = asyncio.run(drive(
                addr, items, rate=rate, timeout_s=a.timeout, seed=rate_seed(a, rate, 200),
                duration_s=None if a.num_requests else a.duration,
                workers={f"{w.kind}{i}": w.address for i, w in enumerate(cluster.workers)}))
            s = metrics.summarize(res, slo_ttft, slo_tpot)
            s["slo_attainment"] = round(s["num_good"] / s["num_requests"], 4) \
                if s["num_requests"] else None
            # what the random draw of long prompts really asked of the prefill side: at one
            # rate label two samples can differ by 15% (docs/performance.md)
            s["offered_prompt_tokens_per_s"] = round(s["prompt_tokens"] / a.duration) \
                if not a.num_requests and a.duration else None
            s["by_prompt"] = {
                kind: {"n": len(sub), "ttft_ms": metrics.dist_ms([r.ttft_s for r in sub if r.ok]),
                       "num_good": sum(metrics.meets_slo(r, slo_ttft, slo_tpot) for r in sub)}
                for kind, sub in (("long", [r for r in res if r.id in long_ids]),
                                  ("short", [r for r in res if r.id not in long_ids]))}
            MIXED_TOKENS[(name, k)] = toks  # compared in memory: too big for the JSON
            routes = _delta(route_counts(cluster), routes0)
            steps = {w: _delta(v, steps0.get(w, {})) for w, v in step_paths(cluster).items()}
            pieces = kv_pieces(kv_received(cluster), kv0)
            dep["mixed"].append({"rate": rate, "wall_s": round(time.monotonic() - t, 1),
                                 "summary": s, "errors": errors_of(res),
                                 "worker_queues": queues, "routes": routes,
                                 "step_paths": steps, "kv_pieces": pieces,
                                 "request_fields": REQUEST_FIELDS,
                                 "requests": [_row(r, r.id in long_ids) for r in res]})
            log(f"{name}: rate {rate:g}: {s['num_ok']}/{s['num_requests']} ok, ITL p50/p99 "
                f"{s['itl_ms']['p50']}/{s['itl_ms']['p99']} ms, TTFT p50/p99 "
                f"{s['ttft_ms']['p50']}/{s['ttft_ms']['p99']} ms, TPOT p50 "
                f"{s['tpot_ms']['p50']} ms, goodput {s['goodput']} req/s "
                f"({s['num_good']} good), {s['output_token_throughput']} tok/s, offered "
                f"{s['offered_prompt_tokens_per_s']} prompt tok/s, routes {routes}, "
                f"model runs {steps}, KV pieces {pieces}")
            save()
    finally:
        t = time.monotonic()
        dep["alive_at_end"] = {w.kind + str(i): w.alive for i, w in enumerate(cluster.workers)}
        tails = {f"{w.kind}{i}": w.log[-20:] for i, w in enumerate(cluster.workers)
                 if not w.alive}
        if tails:
            dep["dead_worker_logs"] = tails
        cluster.stop()
        log(f"{name}: stopped in {time.monotonic() - t:.1f} s")
        save()
    return dep


REQUEST_FIELDS = ["id", "long", "start_s", "code", "e2e_ms", "ttft_ms", "prompt_tokens",
                  "completion_tokens", "cached_tokens", "max_gap_ms"]


def _row(r: RequestResult, long: bool) -> list:
    """One request of the mixed workload, as REQUEST_FIELDS (one line in the JSON)."""
    gaps = r.itls() if r.ok else []
    return [r.id, long, round(r.start_s, 3), r.code, round(1000 * r.latency_s, 1),
            round(1000 * r.ttft_s, 1) if r.ok else None, r.prompt_tokens, r.completion_tokens,
            r.cached_tokens, round(1000 * max(gaps), 1) if gaps else None]


def _flag(args, name):
    args = list(args or [])
    return args[args.index(name) + 1] if name in args else None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = resolve(build_parser().parse_args(argv))
    if a.print_commands:
        print_commands(a)
        return 0
    out = harness.output_path(a, "disagg_gpu")
    a.out = str(out)
    doc = harness.header("disagg_gpu", settings(a), argv=argv, about=__doc__, figures=FIGURES,
                         cuda=a.devices == "gpu")
    doc.update({"started": doc["date"], "note": a.note, "settings": settings(a),
                "worker_args": worker_args(a),
                "deployment_args": {n: dict(zip(("gateway", "roles"), deployment_args(a, n)))
                                    for n in a.deps},
                "deployments": {}, "complete": False})

    def save():
        doc["comparison"] = compare(doc, MIXED_TOKENS)
        doc["elapsed_s"] = round(time.monotonic() - T0, 1)
        harness.write_json(out, doc)

    log(f"disagg_gpu: {doc['command']}")
    log(f"settings: {json.dumps(doc['settings'])}")
    save()

    def _term(signum, frame):  # a killed run still stops its services (own sessions)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)
    failed = []
    for i, name in enumerate(a.deps):
        deadline = T0 + a.time_budget * (i + 1) / len(a.deps) if a.time_budget else None
        try:
            dep = run_deployment(a, name, doc, save, deadline)
            if a.ran_rates is None and dep.get("mixed"):
                a.ran_rates = [r["rate"] for r in dep["mixed"]]
        except KeyboardInterrupt:
            log(f"{name}: interrupted; partial results in {a.out}")
            doc["deployments"].setdefault(name, {})["failure"] = "interrupted"
            save()
            print_summary(doc)
            return 130
        except Exception as e:  # noqa: BLE001 - keep the other deployment's figures
            log(f"{name}: FAILED: {type(e).__name__}: {e}")
            doc["deployments"].setdefault(name, {})["failure"] = f"{type(e).__name__}: {e}"[:4000]
            failed.append(name)
            save()
    doc["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["complete"] = not failed
    save()
    print_summary(doc)
    log(f"wrote {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
