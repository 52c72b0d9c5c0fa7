"""TTFT added by disaggregation, GPU for GPU: each 1P1D set-up against a colocated
worker on the GPU that does the prefill, runs interleaved.

bench/disagg_gpu.py compares 1P1D (prefill on cuda:0) with two colocated workers (cuda:0 and
cuda:1, the gateway spreading the TTFT prompts over both). Two H200s of one machine differ
by a few ms on a 110 ms prefill (seen: 2-3 ms), about as much as the 5% budget, so that
figure mixes the cost of disaggregation with which GPU computed. Here each set-up runs on a
named GPU, and the set-ups take turns (``--rounds`` passes over the list, a fresh cluster
each time, new prompts each round), so drift over the run (clocks, temperature) hits all.

Set-ups (``--configs``, comma-separated):
  ``coloc@G[:K=V...]``        one colocated worker on cuda:G
  ``1p1d@G:BACKEND[:K=V...]`` prefill on cuda:G, decode on the other GPU, KV over BACKEND,
                              K=V set in the workers' environment (e.g.
                              ``PDSERVE_NCCL_LAYERS_PER_MESSAGE=2``)

Per set-up: the TTFT of ``--repeats`` distinct random ``--prompt-len``-token prompts per
round, sent one at a time through the gateway (the client's time to the first token), after
a warm-up; the workers are disagg_gpu.py's (same arguments, GEMV off). Reported: median and
spread of all its prompts, and for every 1P1D set-up the added TTFT against ``coloc@G`` of
its prefill GPU (with the same K=V where that set-up exists). Where both GPUs have both,
``pooled``: the mean of the 1P1D medians over the two prefill GPUs against the mean of the
two colocated medians (the prefill GPU of a deployment being either one).

    python3 -m bench.ttft_gpu --set h200-mycommit                        (2 GPUs, ~4 min)
    python3 -m bench.ttft_gpu --devices cpu --configs coloc@0,1p1d@0:tcp --rounds 1 \\
        --repeats 2 --prompt-len 64 --model dummy:tiny --out /tmp/ttft_gpu_cpu.json  (CPU smoke)
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from bench import disagg_gpu as dg
from bench.disagg_workload import ttft_items, warmup_items
from pdserve.benchlib import harness, metrics
from pdserve.cluster import LocalCluster

FIGURES = [
    harness.Figure("1P1D nccl TTFT added, pooled over both prefill GPUs", "%",
                   ("summary", "pooled", "nccl", "added_pct"), format="+.2f"),
    harness.Figure("1P1D cuda_ipc TTFT added on cuda:0", "%",
                   ("summary", "added", "1p1d@0:cuda_ipc", "added_pct"), format="+.2f"),
    harness.Figure("colocated TTFT on cuda:0 (4096-token prompt)", "ms",
                   ("summary", "setups", "coloc@0", "ttft_ms", "p50"), format=".1f"),
]
DEFAULT_CONFIGS = "coloc@0,1p1d@0:nccl,coloc@1,1p1d@1:nccl"


def parse_config(text: str) -> dict:
    kind, _, rest = text.partition("@")
    gpu, *more = rest.split(":")
    if kind == "coloc":
        more = [""] + more  # no backend
    if kind not in ("coloc", "1p1d") or gpu not in ("0", "1") or not more or \
            any("=" not in kv for kv in more[1:]):
        raise SystemExit(f"bad set-up {text!r}: coloc@G[:K=V...] or 1p1d@G:BACKEND[:K=V...]")
    env = dict(kv.split("=", 1) for kv in more[1:])
    other = "1" if gpu == "0" else "0"
    if kind == "coloc":
        return dict(name=text, kind=kind, gpu=int(gpu), backend=None, env=env,
                    counts=dict(prefill=0, decode=0, colocated=1),
                    devices={"colocated": [f"cuda:{gpu}"]})
    return dict(name=text, kind=kind, gpu=int(gpu), backend=more[0], env=env,
                counts=dict(prefill=1, decode=1, colocated=0),
                devices={"prefill": [f"cuda:{gpu}"], "decode": [f"cuda:{other}"]})


def measure(a, cfg: dict, rnd: int) -> dict:
    a.seed = rnd  # new prompts every round (no prefix-cache hits)
    # colocated workers never move KV: start them with the GPU backend all the same
    gpu = a.devices == "gpu"
    cluster = LocalCluster(a.model, kv_backend=cfg["backend"] or ("nccl" if gpu else "tcp"),
                           worker_args=tuple(dg.worker_args(a)),
                           devices=cfg["devices"] if gpu else None,
                           startup_timeout_s=a.startup_timeout, env={**a.worker_env,
                                                                     **cfg["env"]},
                           **cfg["counts"])
    t = time.monotonic()
    try:
        cluster.start()
        up = time.monotonic() - t
        for w in range(a.warmup_rounds):
            asyncio.run(dg.drive(cluster.address, warmup_items(a, w), rate=float("inf"),
                                 timeout_s=120.0))
        res, _, _ = asyncio.run(dg.drive(cluster.address, ttft_items(a), rate=None,
                                         timeout_s=a.timeout))
    finally:
        cluster.stop()
    ttfts = [round(1000 * r.ttft_s, 2) for r in res if r.ok]
    dg.log(f"{cfg['name']} round {rnd}: TTFT median {statistics.median(ttfts):.2f} ms "
           f"({len(ttfts)}/{len(res)} ok, up in {up:.1f} s)")
    return {"round": rnd, "ttft_ms_each": ttfts, "errors": dg.errors_of(res)}


def summarize(cfgs: list[dict], runs: dict[str, list[dict]]) -> dict:
    med = {}
    out: dict = {"setups": {}, "added": {}}
    for c in cfgs:
        each = [x for r in runs[c["name"]] for x in r["ttft_ms_each"]]
        if not each:
            continue
        med[c["name"]] = statistics.median(each)
        out["setups"][c["name"]] = {"n": len(each), "ttft_ms": metrics.dist_ms(
            [x / 1000 for x in each]), "round_medians": [
                round(statistics.median(r["ttft_ms_each"]), 2) for r in runs[c["name"]]
                if r["ttft_ms_each"]]}
    for c in cfgs:
        env = "".join(f":{k}={v}" for k, v in c["env"].items())
        base = f"coloc@{c['gpu']}{env}" if f"coloc@{c['gpu']}{env}" in med else f"coloc@{c['gpu']}"
        if c["kind"] == "1p1d" and c["name"] in med and base in med:
            added = med[c["name"]] - med[base]
            out["added"][c["name"]] = {"vs": base, "added_ms": round(added, 2),
                                       "added_pct": round(100 * added / med[base], 2)}
    pooled = {}
    for c in cfgs:
        if c["kind"] != "1p1d":
            continue
        key = ":".join(c["name"].split(":")[1:])  # backend + env, both GPUs together
        twin = c["name"].replace(f"@{c['gpu']}:", f"@{1 - c['gpu']}:", 1)
        if c["gpu"] == 0 and all(n in med for n in (c["name"], twin, "coloc@0", "coloc@1")):
            d = (med[c["name"]] + med[twin]) / 2
            co = (med["coloc@0"] + med["coloc@1"]) / 2
            pooled[key] = {"1p1d_ms": round(d, 2), "colocated_ms": round(co, 2),
                           "added_ms": round(d - co, 2), "added_pct": round(100 * (d / co - 1), 2)}
    out["pooled"] = pooled
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.ttft_gpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=12, help="TTFT prompts per set-up and round")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--devices", default="gpu", choices=["gpu", "cpu"],
                   help="cpu: a smoke run (the @G are ignored; use a CPU backend, e.g. tcp)")
    p.add_argument("--note", default="")
    harness.add_output_args(p, "ttft_gpu")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    cfgs = [parse_config(x.strip()) for x in a.configs.split(",") if x.strip()]
    cpu = ["--quick", "--devices", "cpu", "--dtype", "float32"] if a.devices == "cpu" else []
    d = dg.resolve(dg.build_parser().parse_args(cpu + [
        "--model", a.model, "--prompt-len", str(a.prompt_len), "--ttft-repeats",
        str(a.repeats), "--warmup-rounds", "1"]))
    runs: dict[str, list[dict]] = {c["name"]: [] for c in cfgs}
    out = harness.output_path(a, "ttft_gpu")
    doc = harness.header("ttft_gpu", a, argv=argv, about=__doc__, figures=FIGURES,
                         cuda=a.devices == "gpu")
    doc.update({"note": a.note, "prompt_len": a.prompt_len, "repeats": a.repeats,
                "rounds": a.rounds, "worker_args": dg.worker_args(d),
                "worker_env": d.worker_env, "runs": runs})

    def save():
        doc["summary"] = summarize(cfgs, runs)
        harness.write_json(out, doc)

    for rnd in range(a.rounds):
        for c in cfgs:
            try:
                runs[c["name"]].append(measure(d, c, rnd))
            except Exception as exc:  # noqa: BLE001 - keep the other set-ups' figures
                dg.log(f"{c['name']} round {rnd}: FAILED {exc!r}")
                runs[c["name"]].append({"round": rnd, "ttft_ms_each": [], "errors":
                                        {"exception": repr(exc)}})
            save()
    s = doc["summary"]
    for name, v in s["setups"].items():
        print(f"{name:40s} median {v['ttft_ms']['p50']:8.2f} ms  rounds {v['round_medians']}")
    for name, v in s["added"].items():
        print(f"{name:40s} {v['added_ms']:+.2f} ms = {v['added_pct']:+.2f}% vs {v['vs']}")
    for key, v in s["pooled"].items():
        print(f"pooled {key:33s} {v['added_ms']:+.2f} ms = {v['added_pct']:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
