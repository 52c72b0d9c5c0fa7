"""1P1D against two colocated workers on a two-GPU machine (issue 5), through the whole
product: a real redis-server, a real gateway, real worker processes (pdserve.cluster.LocalCluster).

    PYTHONPATH=. python3 bench/disagg_gpu.py --out bench/results/disagg_gpu_h200.json
        (2 x H200: about 6-7 min; --time-budget 450 s drops the top rates if start-up is slow)
    python bench/disagg_gpu.py --quick --devices cpu --model dummy:tiny --dtype float32 \\
        --kv-backend tcp --out /tmp/disagg_cpu.json              (CPU smoke run, ~40 s)
    python bench/disagg_gpu.py --print-commands ...              (the worker command lines)

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

Rates: ``4,8,16,32`` req/s by default. Prefill of this mix costs ~1,260 tokens per request
(~35-40 ms of one H200): 1P1D's single prefill GPU nears saturation around 25-30 req/s, two
colocated GPUs share prefill and decode; the low rates show the ITL cost of prefill
interference, the top rate where 1P1D's prefill side runs out.

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

Figures are defined in pdserve.benchlib.metrics. Progress lines carry timestamps; the JSON is
rewritten after every phase, so a killed run leaves what it had measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import grpc  # noqa: E402

from pdserve import client  # noqa: E402
from pdserve.benchlib import metrics, workload  # noqa: E402
from pdserve.benchlib.metrics import RequestResult  # noqa: E402
from pdserve.benchlib.runner import poisson_times, to_request  # noqa: E402
from pdserve.benchlib.workload import Item  # noqa: E402
from pdserve.cluster import LocalCluster  # noqa: E402
from protos.pdserve.v1 import gateway_pb2_grpc  # noqa: E402

GiB = 1 << 30
T0 = time.monotonic()
MIXED_TOKENS: dict[tuple[str, int], dict[str, list[int]]] = {}  # (deployment, rate index)
TARGETS = {"ttft_added_pct_max": 5.0, "itl_p99_ratio_min": 3.0, "goodput_ratio_min": 1.3}

# What changes between a GPU run and the CPU smoke run (--quick): None = flag not given.
GPU_DEFAULTS = dict(rates="4,8,16,32", duration=20.0, ttft_repeats=8, exact_prompts=8,
                    exact_max_tokens=32, warmup_rounds=2, warmup_size=8, short_len="128:512",
                    output_len="128:256", timeout=60.0, startup_timeout=420.0,
                    time_budget=450.0)
QUICK_DEFAULTS = dict(prompt_len=512, rates="2,4", duration=5.0, ttft_repeats=3,
                      exact_prompts=6, exact_max_tokens=16, warmup_rounds=1, warmup_size=4,
                      short_len="16:64", output_len="8:16", timeout=60.0, startup_timeout=180.0,
                      time_budget=0.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------ settings
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "bench/results/disagg_gpu.json"))
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
                   help="do not pass the GPU worker defaults (only --dtype and --worker-args)")
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
    w.add_argument("--rates", default=None, help="mixed workload req/s, rising [4,8,16,32]")
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
    a.short = _range(a.short_len)
    a.out_range = _range(a.output_len)
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


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


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


# ------------------------------------------------------------------------------ prompts
def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def ttft_items(a) -> list[Item]:
    rng = random.Random(a.seed * 1000 + 2)
    return [Item(f"ttft{i}", a.ttft_max_tokens, token_ids=random_ids(rng, a.prompt_len,
                                                                      a.vocab_size),
                 prompt_units=a.prompt_len) for i in range(a.ttft_repeats)]


def exact_lengths(a) -> list[int]:
    """Mixed lengths, the longest first: the full long prompt, fractions of it, short ones."""
    p = a.prompt_len
    cands = [p, 3 * p // 4 + 5, p // 2, p // 4 + 3, p // 8, 100, 33, 7, 2 * p // 3, 3 * p // 8]
    out = []
    for n in cands:
        if n >= 1 and n not in out:
            out.append(n)
    return (out * (a.exact_prompts // len(out) + 1))[:a.exact_prompts]


def exact_items(a) -> list[Item]:
    rng = random.Random(a.seed * 1000 + 3)
    return [Item(f"exact{i}", a.exact_max_tokens, token_ids=random_ids(rng, n, a.vocab_size),
                 prompt_units=n) for i, n in enumerate(exact_lengths(a))]


def mix_items(a, n: int, seed: int, tag: str) -> list[Item]:
    spec = workload.WorkloadSpec(kind="longmix", num_requests=n, seed=seed, fmt="tokens",
                                 vocab_size=a.vocab_size, input_len=a.short,
                                 output_len=a.out_range, long_frac=a.long_frac,
                                 long_len=a.prompt_len)
    return [Item(**{**it.__dict__, "id": f"{tag}.{it.id}"}) for it in workload.generate(spec)]


def rate_items(a, k: int, rate: float) -> list[Item]:
    """The mixed workload of the k-th rate: new prompts at every rate (no prefix hits across
    rates), the same items for every deployment."""
    n = a.num_requests or int(math.ceil(rate * a.duration * 1.5)) + 10
    return mix_items(a, n, seed=a.seed * 1000 + 100 + k, tag=f"rate{k}")


def warmup_items(a, rnd: int) -> list[Item]:
    items = mix_items(a, a.warmup_size, seed=a.seed * 1000 + 10 + rnd, tag=f"warm{rnd}")
    rng = random.Random(a.seed * 1000 + 20 + rnd)
    for i, it in enumerate(items):  # half long, so every worker sees chunked long prompts
        if i % 2 == 0:
            it.token_ids = random_ids(rng, a.prompt_len, a.vocab_size)
            it.prompt_units = a.prompt_len
        it.max_tokens = min(it.max_tokens, 16)
    return items


# ------------------------------------------------------------------------------ driving
async def drive(address: str, items: list[Item], *, rate: float | None, timeout_s: float,
                seed: int = 0, duration_s: float | None = None
                ) -> tuple[list[RequestResult], dict[str, list[int]]]:
    """Send ``items`` (greedy, EOS ignored): one at a time when ``rate`` is None, else Poisson
    arrivals at ``rate`` (math.inf: all at once), stopping sends at ``duration_s``. Returns
    the results in send order and each successful request's generated token ids."""
    tokens: dict[str, list[int]] = {}
    results: list[RequestResult] = []
    async with client.channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        try:
            await asyncio.wait_for(ch.channel_ready(), 10.0)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            pass  # every request will fail and say why
        t0 = time.perf_counter()

        async def one(item: Item) -> None:
            res = RequestResult(id=item.id, start_s=time.perf_counter() - t0)
            try:
                c = await client.generate(stub, to_request(item, "d", 0.0), timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                res.code, res.error = e.code().name, (e.details() or "")[:200]
            except Exception as e:  # noqa: BLE001 - recorded, never stops the run
                res.code, res.error = f"CLIENT_{type(e).__name__}", str(e)[:200]
            else:
                res.ok = True
                res.ttft_s, res.latency_s, res.token_times = c.ttft_s, c.latency_s, c.token_times
                res.prompt_tokens, res.cached_tokens = c.prompt_tokens, c.cached_tokens
                res.completion_tokens = c.completion_tokens or len(c.token_ids)
                res.finish_reason = c.finish_reason
                tokens[item.id] = list(c.token_ids)
            if not res.ok:
                res.latency_s = time.perf_counter() - t0 - res.start_s
            results.append(res)

        if rate is None:
            for item in items:
                await one(item)
        else:
            tasks = []
            for item, at in zip(items, poisson_times(len(items), rate, seed)):
                if duration_s is not None and at >= duration_s:
                    break
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(item)))
            await asyncio.gather(*tasks)
    results.sort(key=lambda r: r.start_s)
    return results, tokens


def errors_of(results: list[RequestResult]) -> dict:
    out: dict = {}
    for r in results:
        if not r.ok:
            out.setdefault(r.code, r.error)
    return out


def make_cluster(a, name: str) -> LocalCluster:
    spec = DEPLOYMENTS[name]
    return LocalCluster(a.model, kv_backend=a.kv_backend if name == "1p1d" else
                        a.colocated_kv_backend, worker_args=tuple(worker_args(a)),
                        devices=spec["gpu"] if a.devices == "gpu" else None,
                        startup_timeout_s=a.startup_timeout, echo=a.echo, env=a.worker_env,
                        **spec["counts"])


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


def run_deployment(a, name: str, doc: dict, save, deadline: float | None = None) -> dict:
    spec = DEPLOYMENTS[name]
    cluster = make_cluster(a, name)
    dep = {"name": name, "cluster": spec["counts"], "devices": cluster.devices or None,
           "kv_backend": cluster.kv_backend, "worker_args": list(cluster.worker_args)}
    doc["deployments"][name] = dep
    log(f"{name}: starting {spec['counts']} devices={dep['devices']} kv={cluster.kv_backend} "
        f"args={' '.join(dep['worker_args'])}")
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
            res, _ = asyncio.run(drive(addr, warmup_items(a, rnd), rate=math.inf,
                                       timeout_s=max(a.timeout, 120.0)))
            bad = [r for r in res if not r.ok]
            if bad:
                log(f"{name}: warm-up round {rnd}: {len(bad)} failed: {errors_of(bad)}")
        dep["warmup_s"] = round(time.monotonic() - t, 1)
        log(f"{name}: warm-up done in {dep['warmup_s']} s")

        # a. TTFT of long prompts, one at a time
        res, _ = asyncio.run(drive(addr, ttft_items(a), rate=None, timeout_s=a.timeout))
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
        res, toks = asyncio.run(drive(addr, items, rate=None, timeout_s=a.timeout))
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
            res, toks = asyncio.run(drive(
                addr, items, rate=rate, timeout_s=a.timeout, seed=a.seed * 1000 + 200 + k,
                duration_s=None if a.num_requests else a.duration))
            s = metrics.summarize(res, slo_ttft, slo_tpot)
            s["slo_attainment"] = round(s["num_good"] / s["num_requests"], 4) \
                if s["num_requests"] else None
            s["by_prompt"] = {
                kind: {"n": len(sub), "ttft_ms": metrics.dist_ms([r.ttft_s for r in sub if r.ok]),
                       "num_good": sum(metrics.meets_slo(r, slo_ttft, slo_tpot) for r in sub)}
                for kind, sub in (("long", [r for r in res if r.id in long_ids]),
                                  ("short", [r for r in res if r.id not in long_ids]))}
            MIXED_TOKENS[(name, k)] = toks  # compared in memory: too big for the JSON
            dep["mixed"].append({"rate": rate, "wall_s": round(time.monotonic() - t, 1),
                                 "summary": s, "errors": errors_of(res),
                                 "request_fields": REQUEST_FIELDS,
                                 "requests": [_row(r, r.id in long_ids) for r in res]})
            log(f"{name}: rate {rate:g}: {s['num_ok']}/{s['num_requests']} ok, ITL p50/p99 "
                f"{s['itl_ms']['p50']}/{s['itl_ms']['p99']} ms, TTFT p50/p99 "
                f"{s['ttft_ms']['p50']}/{s['ttft_ms']['p99']} ms, TPOT p50 "
                f"{s['tpot_ms']['p50']} ms, goodput {s['goodput']} req/s "
                f"({s['num_good']} good), {s['output_token_throughput']} tok/s")
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


# ------------------------------------------------------------------------------ comparing
def _ratio(num, den):
    if num is None or den is None:
        return None
    if den == 0:
        return None if num == 0 else math.inf
    return round(num / den, 4)


def _first_divergence(x: list[int], y: list[int]) -> int:
    for i, (p, q) in enumerate(zip(x, y)):
        if p != q:
            return i
    return min(len(x), len(y)) if len(x) != len(y) else -1


def token_agreement(ta: dict, tb: dict, ids: list[str], detail: bool = False) -> dict:
    """Requests compared (ok in both) and identical; tokens matching before the first
    divergence over all compared tokens."""
    compared = identical = tok_total = tok_prefix = 0
    mismatches = []
    for rid in ids:
        x, y = ta.get(rid), tb.get(rid)
        if x is None or y is None:
            continue
        compared += 1
        d = _first_divergence(x, y)
        tok_total += max(len(x), len(y))
        tok_prefix += max(len(x), len(y)) if d < 0 else d
        if d < 0:
            identical += 1
        elif detail:
            mismatches.append({"id": rid, "first_divergence": d, "a": x[:d + 8], "b": y[:d + 8]})
    out = {"requests_compared": compared, "requests_identical": identical,
           "tokens_compared": tok_total, "tokens_before_divergence": tok_prefix,
           "token_agreement": round(tok_prefix / tok_total, 4) if tok_total else None}
    if detail:
        out["mismatches"] = mismatches
    return out


def compare(doc: dict) -> dict | None:
    deps = doc["deployments"]
    p, c = deps.get("1p1d"), deps.get("colocated")
    if not c:
        return None
    p = p or {}
    out: dict = {"a": "1p1d", "b": "colocated", "targets": TARGETS}
    if "ttft" in p and "ttft" in c:
        pm, cm = p["ttft"]["ttft_ms"]["p50"], c["ttft"]["ttft_ms"]["p50"]
        added = round(100 * (pm / cm - 1), 2) if pm and cm else None
        out["ttft"] = {"prompt_len": p["ttft"]["prompt_len"], "1p1d_p50_ms": pm,
                       "colocated_p50_ms": cm, "1p1d_p90_ms": p["ttft"]["ttft_ms"]["p90"],
                       "colocated_p90_ms": c["ttft"]["ttft_ms"]["p90"],
                       "ttft_added_ms": round(pm - cm, 2) if pm and cm else None,
                       "ttft_added_pct": added,
                       "pass": added is not None and added <= TARGETS["ttft_added_pct_max"]}
    if "exact" in p and "exact" in c:
        ids = list(p["exact"]["tokens"])
        ag = token_agreement(p["exact"]["tokens"], c["exact"]["tokens"], ids, detail=True)
        ag["total"] = len(ids)
        ag["identical"] = ag["requests_identical"]
        ag["all_identical"] = ag["identical"] == len(ids)
        ag["prompt_lens"] = p["exact"]["prompt_lens"]
        out["exact_sequential"] = ag
    rows, under_load = [], []
    for k, (rp, rc) in enumerate(zip(p.get("mixed", []), c.get("mixed", []))):
        sp, sc = rp["summary"], rc["summary"]
        itl_ratio = _ratio(sc["itl_ms"]["p99"], sp["itl_ms"]["p99"])
        gp_ratio = _ratio(sp["goodput"], sc["goodput"])
        rows.append({
            "rate": rp["rate"],
            "itl_p99_ms": {"1p1d": sp["itl_ms"]["p99"], "colocated": sc["itl_ms"]["p99"]},
            "itl_p50_ms": {"1p1d": sp["itl_ms"]["p50"], "colocated": sc["itl_ms"]["p50"]},
            "ttft_p99_ms": {"1p1d": sp["ttft_ms"]["p99"], "colocated": sc["ttft_ms"]["p99"]},
            "tpot_p50_ms": {"1p1d": sp["tpot_ms"]["p50"], "colocated": sc["tpot_ms"]["p50"]},
            "goodput": {"1p1d": sp["goodput"], "colocated": sc["goodput"]},
            "slo_attainment": {"1p1d": sp["slo_attainment"], "colocated": sc["slo_attainment"]},
            "itl_p99_ratio": itl_ratio,
            "itl_pass": itl_ratio is not None and itl_ratio >= TARGETS["itl_p99_ratio_min"],
            "goodput_ratio": gp_ratio,
            "goodput_pass": gp_ratio is not None and gp_ratio >= TARGETS["goodput_ratio_min"]})
        tp, tc = MIXED_TOKENS.get(("1p1d", k)), MIXED_TOKENS.get(("colocated", k))
        if tp is not None and tc is not None:
            ag = token_agreement(tp, tc, list(tp))
            ag["rate"] = rp["rate"]
            under_load.append(ag)
    out["mixed"] = rows
    if under_load:
        tot = {k: sum(x[k] for x in under_load) for k in
               ("requests_compared", "requests_identical", "tokens_compared",
                "tokens_before_divergence")}
        tot["token_agreement"] = round(tot["tokens_before_divergence"] / tot["tokens_compared"],
                                       4) if tot["tokens_compared"] else None
        out["agreement_under_load"] = {"per_rate": under_load, "total": tot}
    rerun = []  # control: colocated against a second run of itself
    for k in range(len(c.get("mixed", []))):
        ta, tb = MIXED_TOKENS.get(("colocated", k)), MIXED_TOKENS.get(("colocated_rerun", k))
        if ta is not None and tb is not None:
            ag = token_agreement(ta, tb, list(ta))
            ag["rate"] = c["mixed"][k]["rate"]
            rerun.append(ag)
    if rerun:
        out["agreement_under_load_colocated_vs_rerun"] = rerun
    out["pass"] = {
        "ttft_added": out.get("ttft", {}).get("pass"),
        "exact_sequential": out.get("exact_sequential", {}).get("all_identical"),
        "itl_p99_3x_at_rates": [r["rate"] for r in rows if r["itl_pass"]],
        "goodput_1.3x_at_rates": [r["rate"] for r in rows if r["goodput_pass"]],
    }
    return out


# ------------------------------------------------------------------------------ report
def environment(a) -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform(),
           "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())}
    for mod in ("torch", "triton", "grpcio", "nixl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu13"):
        try:
            from importlib.metadata import version
            env[mod] = version(mod)
        except Exception:  # noqa: BLE001 - not installed
            pass
    env["git"] = _run(["git", "rev-parse", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    env["git_dirty"] = None if dirty is None else bool(dirty)
    env["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader"])
    if a.devices == "gpu":  # in a child: this process never opens a CUDA context
        info = _run([sys.executable, "-c", "import json, torch; print(json.dumps({"
                     "'torch': torch.__version__, 'cuda': torch.version.cuda, 'devices': "
                     "[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]"
                     ", 'nccl': '.'.join(map(str, torch.cuda.nccl.version())) "
                     "if torch.cuda.is_available() else None}))"], timeout=120)
        try:
            env["torch_cuda"] = json.loads(info) if info else None
        except ValueError:
            env["torch_cuda"] = info
    return env


_SCALAR = r'(?:-?[0-9.]+(?:[eE][-+]?[0-9]+)?|true|false|null|"[^"\\,\[\]{}]*")'
_SCALAR_LIST = re.compile(r"\[\s*(" + _SCALAR + r"(?:\s*,\s*" + _SCALAR + r")*)\s*\]")


def dumps(doc: dict) -> str:
    """Indented JSON with lists of scalars (token ids, samples, request rows) on one line."""
    text = json.dumps(doc, indent=1)
    return _SCALAR_LIST.sub(lambda m: "[" + ", ".join(
        x.strip() for x in re.split(r",\s*\n\s*", m.group(1))) + "]", text) + "\n"


def _run(cmd, timeout=20):
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def settings(a) -> dict:
    return {k: getattr(a, k) for k in (
        "model", "dtype", "kv_backend", "colocated_kv_backend", "devices", "quick", "seed",
        "vocab_size", "prompt_len", "rate_list", "duration", "num_requests", "long_frac",
        "short_len", "output_len", "ttft_repeats", "ttft_max_tokens", "exact_prompts",
        "exact_max_tokens", "warmup_rounds", "warmup_size", "timeout", "startup_timeout",
        "slo_ttft_ms", "slo_tpot_ms", "deps", "gemv", "worker_env", "time_budget")}


def _f(v, spec=".3g"):
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def print_summary(doc: dict) -> None:
    cmp_ = doc.get("comparison")
    print("\n== disagg_gpu summary", flush=True)
    for name, dep in doc["deployments"].items():
        t = dep.get("ttft", {}).get("ttft_ms", {})
        print(f"   {name:10s} startup {dep.get('startup_s')} s; TTFT({doc['settings']['prompt_len']})"
              f" p50 {_f(t.get('p50'))} ms p90 {_f(t.get('p90'))} ms")
    if not cmp_:
        return
    if "ttft" in cmp_:
        t = cmp_["ttft"]
        print(f"   TTFT added by disaggregation: {_f(t['ttft_added_pct'])}% "
              f"({_f(t['ttft_added_ms'])} ms; target <= 5%): {'PASS' if t['pass'] else 'FAIL'}")
    if "exact_sequential" in cmp_:
        e = cmp_["exact_sequential"]
        print(f"   token-exact, one at a time: {e['identical']}/{e['total']} identical "
              f"({'PASS' if e['all_identical'] else 'FAIL'}); token agreement "
              f"{_f(e['token_agreement'], '.4f')}")
    if "agreement_under_load" in cmp_:
        g = cmp_["agreement_under_load"]["total"]
        print(f"   agreement under load: {g['requests_identical']}/{g['requests_compared']} "
              f"requests identical, token agreement {_f(g['token_agreement'], '.4f')}")
    print(f"   {'rate':>6s} {'ITL p99 1P1D':>13s} {'coloc':>8s} {'ratio':>6s}   "
          f"{'goodput 1P1D':>12s} {'coloc':>7s} {'ratio':>6s}   {'TTFT p99 1P1D':>13s} "
          f"{'coloc':>8s}")
    for r in cmp_.get("mixed", []):
        print(f"   {r['rate']:6g} {_f(r['itl_p99_ms']['1p1d'], '.1f'):>13s} "
              f"{_f(r['itl_p99_ms']['colocated'], '.1f'):>8s} {_f(r['itl_p99_ratio'], '.2f'):>5s}"
              f"{'*' if r['itl_pass'] else ' '}   {_f(r['goodput']['1p1d'], '.3g'):>12s} "
              f"{_f(r['goodput']['colocated'], '.3g'):>7s} {_f(r['goodput_ratio'], '.2f'):>5s}"
              f"{'*' if r['goodput_pass'] else ' '}   {_f(r['ttft_p99_ms']['1p1d'], '.0f'):>13s} "
              f"{_f(r['ttft_p99_ms']['colocated'], '.0f'):>8s}")
    print("   (* = target met: ITL p99 ratio >= 3, goodput ratio >= 1.3; ITL/TTFT in ms, "
          "goodput in req/s)", flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = resolve(build_parser().parse_args(argv))
    if a.print_commands:
        print_commands(a)
        return 0
    doc = {"command": "python3 bench/disagg_gpu.py " + " ".join(shlex.quote(x) for x in argv),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "note": a.note,
           "settings": settings(a), "worker_args": worker_args(a),
           "environment": environment(a), "deployments": {}, "complete": False}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def save():
        doc["comparison"] = compare(doc)
        doc["elapsed_s"] = round(time.monotonic() - T0, 1)
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(dumps(doc))
        os.replace(tmp, a.out)

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
    doc["environment"]["loadavg_end"] = list(os.getloadavg())
    doc["complete"] = not failed
    save()
    print_summary(doc)
    log(f"wrote {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
