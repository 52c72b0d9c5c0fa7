"""``pdserve bench``: the serving benchmark.

    pdserve bench --address HOST:PORT --rate 2 --num-requests 100
    pdserve bench --up --prefill 1 --decode 1 --model dummy:tiny --rates 1,2,4
    pdserve bench --workload-kind prefix --num-prefixes 4 --num-users 8 --concurrency 4 ...
    pdserve bench --compare HOST_A:PORT HOST_B:PORT --rate 1
    pdserve bench --compare-up "prefill=1,decode=1" "colocated=2" --model smollm2-135m
    pdserve bench --up --colocated 1 --prefill 0 --decode 0 --apis grpc,openai --concurrency 16

Warm-up requests (``--warmup N``) are the workload's first N items, sent before the measured
runs (closed loop, ``--concurrency`` or 2 clients) and left out of every figure. A sweep
(``--rates``) runs the same measured items once per rate, in order, against each deployment;
``--compare`` runs deployments one after another (never at the same time), so they do not
share the machine. ``--api openai`` drives the gateway's OpenAI-compatible HTTP API instead of
gRPC (``--address`` is then its HTTP host:port); ``--apis grpc,openai`` runs both against each
deployment, one after the other, on the same items. Figures are defined in
:mod:`pdserve.benchlib.metrics`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time

from pdserve.benchlib import harness, metrics, workload
from pdserve.benchlib.runner import LoadSpec, cycle_items, run_load

UP_KEYS = ("prefill", "decode", "colocated")


def parse_up(text: str) -> dict:
    """``"prefill=1,decode=1"`` -> ``{"prefill": 1, "decode": 1, "colocated": 0}``."""
    cfg = dict.fromkeys(UP_KEYS, 0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, _, v = part.partition("=")
        if k not in cfg or not v.isdigit():
            raise ValueError(f"bad deployment {text!r}: want e.g. 'prefill=1,decode=1'")
        cfg[k] = int(v)
    if sum(cfg.values()) == 0 or (cfg["prefill"] and not cfg["decode"]):
        raise ValueError(f"bad deployment {text!r}: need decode with prefill, or colocated")
    return cfg


def up_label(cfg: dict) -> str:
    return "+".join(f"{v}{k[0].upper()}" for k, v in cfg.items() if v)  # e.g. 1P+1D, 2C


def build_parser() -> argparse.ArgumentParser:
    from pdserve.argtypes import Parser, address, int_range, integer, number, output_file
    from services.config import backend_devices
    from pdcore.settings import MAX_SECONDS
    pos, nonneg, workers = integer(1, 10_000_000), integer(0), integer(0, 64)
    p = Parser(prog="pdserve bench", description="serving benchmark",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = p.add_argument_group("deployment (one of)")
    d.add_argument("--address", type=address, default=None, help="gateway HOST:PORT")
    d.add_argument("--http-address", type=address, default=None,
                   help="with --address: the gateway's HTTP HOST:PORT, for --api(s) openai")
    d.add_argument("--up", action="store_true", help="start a LocalCluster for the run")
    d.add_argument("--compare", nargs=2, type=address, metavar="ADDR",
                   help="two gateways, same workload")
    d.add_argument("--compare-up", nargs=2, metavar="CFG",
                   help="two local clusters, e.g. 'prefill=1,decode=1' 'colocated=2'")
    d.add_argument("--prefill", type=workers, default=1)
    d.add_argument("--decode", type=workers, default=1)
    d.add_argument("--colocated", type=workers, default=0)
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--kv-backend", default=None, choices=sorted(backend_devices()),
                   help="default: the workers' (tcp on the CPU)")
    d.add_argument("--device", default=None,
                   help="--up / --compare-up: every worker's device (cpu, cuda, cuda:N; "
                        "workers sharing a GPU split its memory); default: the workers'")
    lo = p.add_argument_group("load")
    lo.add_argument("--rate", type=number(gt=0.0, allow_inf=True), default=None,
                    help="Poisson req/s ('inf': burst)")
    lo.add_argument("--rates", type=_rates, default=None, help="sweep, e.g. 1,2,4")
    lo.add_argument("--concurrency", type=pos, default=None,
                    help="max in flight (alone: closed loop with this many clients)")
    lo.add_argument("--num-requests", type=pos, default=None, help="measured requests [100]")
    lo.add_argument("--duration", type=number(gt=0.0, hi=MAX_SECONDS), default=None,
                    help="stop sending after S seconds")
    lo.add_argument("--warmup", type=nonneg, default=0, help="requests excluded from stats")
    lo.add_argument("--timeout", type=number(gt=0.0, hi=MAX_SECONDS), default=300.0,
                    help="per request (s)")
    lo.add_argument("--temperature", type=number(0.0), default=0.0)
    lo.add_argument("--api", default="grpc", choices=["grpc", "openai"],
                    help="the gateway's gRPC API or its OpenAI-compatible HTTP API")
    lo.add_argument("--apis", default=None, type=_apis,
                    help="several, run one after the other: grpc,openai")
    w = p.add_argument_group("workload")
    w.add_argument("--workload-kind", default="random",
                   choices=["random", "prefix", "multiturn", "longmix"])
    w.add_argument("--seed", type=nonneg, default=0)
    w.add_argument("--prompt-format", default="text", choices=["text", "tokens"])
    w.add_argument("--vocab-size", type=integer(2), default=32000,
                   help="for --prompt-format tokens")
    w.add_argument("--input-len", type=int_range, default="32:128", help="prompt units LO:HI")
    w.add_argument("--output-len", type=int_range, default="32:32",
                   help="generated tokens LO:HI")
    w.add_argument("--num-prefixes", type=pos, default=4)
    w.add_argument("--num-users", type=pos, default=8)
    w.add_argument("--prefix-len", type=nonneg, default=256)
    w.add_argument("--num-turns", type=pos, default=4)
    w.add_argument("--reply-len", type=pos, default=32)
    w.add_argument("--long-frac", type=number(0.0, 1.0), default=0.2)
    w.add_argument("--long-len", type=pos, default=1024)
    w.add_argument("--workload", default=None, help="replay items from a .jsonl")
    w.add_argument("--save-workload", default=None, help="write the items to a .jsonl")
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft-ms", type=number(gt=0.0), default=None)
    r.add_argument("--slo-tpot-ms", type=number(gt=0.0), default=None)
    r.add_argument("--out", default=None, type=output_file,
                   help="JSON report; PNG plots are written beside it")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--note", default="", help="free text stored in the JSON (machine load, ...)")
    return p


def _apis(text: str) -> tuple[str, ...]:
    apis = tuple(x.strip() for x in text.split(",") if x.strip())
    if not apis or any(x not in ("grpc", "openai") for x in apis):
        raise argparse.ArgumentTypeError(f"expected apis like grpc,openai, got {text!r}")
    return apis


def _rates(text: str) -> str:
    """``1,2,4``: positive rates (inf allowed), kept as the text loads() splits."""
    from pdserve.argtypes import number
    parse = number(gt=0.0, allow_inf=True)
    if not [parse(x) for x in text.split(",")]:
        raise argparse.ArgumentTypeError(f"expected rates like 1,2,4, got {text!r}")
    return text


def _range(value) -> tuple[int, int]:
    """``--input-len`` / ``--output-len``: parsed by argparse (argtypes.int_range), or the
    LO:HI text of a namespace built by hand."""
    if isinstance(value, tuple):
        return value
    from pdserve.argtypes import int_range
    return int_range(value)


def make_items(a) -> tuple[list[workload.Item], dict]:
    n = a.num_requests or 100
    if a.workload:
        items = workload.load(a.workload)
        return items, {"replayed_from": a.workload, "items": len(items)}
    spec = workload.WorkloadSpec(
        kind=a.workload_kind, num_requests=n + a.warmup, seed=a.seed, fmt=a.prompt_format,
        vocab_size=a.vocab_size, input_len=_range(a.input_len), output_len=_range(a.output_len),
        num_prefixes=a.num_prefixes, num_users=a.num_users, prefix_len=a.prefix_len,
        num_turns=a.num_turns, reply_len=a.reply_len, long_frac=a.long_frac,
        long_len=a.long_len)
    return workload.generate(spec), {k: v for k, v in spec.__dict__.items()}


class UsageError(SystemExit):
    """Flags that do not make a run: one line, exit status 2 (argparse's rule)."""

    def __init__(self, message: str):
        print(f"pdserve bench: error: {message} (see --help)", file=sys.stderr)
        super().__init__(2)


def apis(a) -> tuple[str, ...]:
    return getattr(a, "apis", None) or (getattr(a, "api", "grpc"),)


def loads(a, api: str = "grpc") -> list[LoadSpec]:
    common = dict(concurrency=a.concurrency, duration_s=a.duration, timeout_s=a.timeout,
                  temperature=a.temperature, seed=a.seed, api=api)
    if a.rates:
        return [LoadSpec(rate=float(x), **common) for x in a.rates.split(",")]
    if a.rate is None and a.concurrency is None:
        raise UsageError("give --rate, --rates or --concurrency")
    return [LoadSpec(rate=a.rate, **common)]


def deployments(a) -> list[tuple[str, str | None, dict | None]]:
    """(label, address or None, LocalCluster counts or None)"""
    if a.compare:
        return [(f"A {a.compare[0]}", a.compare[0], None), (f"B {a.compare[1]}", a.compare[1], None)]
    if a.compare_up:
        cfgs = [parse_up(t) for t in a.compare_up]
        return [(up_label(c), None, c) for c in cfgs]
    if a.up:
        cfg = parse_up(f"prefill={a.prefill},decode={a.decode},colocated={a.colocated}")
        return [(up_label(cfg), None, cfg)]
    if not a.address:
        raise UsageError("give --address, --up, --compare or --compare-up")
    return [(a.address, a.address, None)]


@contextlib.contextmanager
def open_deployment(address, cfg, a):
    """Yields {api: the address that api is served on}."""
    if cfg is None:
        http = getattr(a, "http_address", None) or address
        yield {"grpc": address, "openai": http if "grpc" in apis(a) else address}
        return
    from pdserve.cluster import LocalCluster
    print(f"starting a local cluster {cfg} (model {a.model}) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    devices = None
    if getattr(a, "device", None):
        devices = {role: [a.device] for role in UP_KEYS}
    http = 0 if "openai" in apis(a) else None
    with LocalCluster(a.model, kv_backend=a.kv_backend, devices=devices, http_port=http,
                      **cfg) as cluster:
        print(f"up in {time.monotonic() - t0:.0f}s at {cluster.address}", file=sys.stderr)
        yield {"grpc": cluster.address, "openai": cluster.http_address}


def load_x(load: LoadSpec) -> float:
    return load.rate if load.rate is not None else float(load.concurrency)


def _split(a, items) -> tuple[list, list]:
    """(warm-up items, measured items)."""
    warm, measured = items[:a.warmup], items[a.warmup:]
    if a.num_requests and len(measured) > a.num_requests:
        measured = measured[:a.num_requests]
    top = max((ld.rate or 0.0) for ld in loads(a))
    if a.duration and a.num_requests is None and 0 < top < math.inf:
        measured = cycle_items(measured, max(int(top * a.duration * 1.5) + 10, len(measured)))
    return warm, measured


def _items_for_api(a, k: int, items):
    """The k-th API's items on a shared deployment: a generated workload's k-th seed (the
    same distribution; the earlier APIs' prompts are in the prefix cache), or the replay."""
    if k == 0 or a.workload:
        return items
    return make_items(argparse.Namespace(**{**vars(a), "seed": a.seed + k}))[0]


def run_all(a, items, meta) -> dict:
    warm, measured = _split(a, items)
    slo_ttft = a.slo_ttft_ms / 1000 if a.slo_ttft_ms is not None else None
    slo_tpot = a.slo_tpot_ms / 1000 if a.slo_tpot_ms is not None else None
    config = {k: v for k, v in vars(a).items() if k != "argv"}
    report = {**harness.header("pdserve_bench", config, argv=a.argv, prog="pdserve bench",
                               about=__doc__),
              "note": a.note, "model": a.model if (a.up or a.compare_up) else None,
              "workload": meta, "warmup": len(warm), "measured_requests": len(measured),
              "deployments": []}
    raw = []  # (deployment label, load, summary, results) for plots
    for label, address, cfg in deployments(a):
        with open_deployment(address, cfg, a) as addrs:
            for k, api in enumerate(apis(a)):
                name = f"{label} {api}" if len(apis(a)) > 1 else label
                dep = {"label": name, "address": addrs[api], "cluster": cfg, "api": api,
                       "seed": a.seed + (k if not a.workload else 0), "runs": []}
                w, m = _split(a, _items_for_api(a, k, items)) if k else (warm, measured)
                _run_deployment(a, dep, w, m, slo_ttft, slo_tpot, raw)
                report["deployments"].append(dep)
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if len(report["deployments"]) == 2:
        a_runs, b_runs = (d["runs"] for d in report["deployments"])
        report["compare"] = [{"rate": ra["rate"], "concurrency": ra["concurrency"],
                              "rows": metrics.compare(ra["summary"], rb["summary"])}
                             for ra, rb in zip(a_runs, b_runs)]
        names = [d["label"] for d in report["deployments"]]
        for c in report["compare"]:
            print_compare(names, c)
    report["_raw"] = raw
    return report


def _run_deployment(a, dep, warm, measured, slo_ttft, slo_tpot, raw) -> None:
    label, addr, api = dep["label"], dep["address"], dep["api"]
    progress = False if a.no_progress else None
    if warm:
        wl = LoadSpec(concurrency=a.concurrency or 2, timeout_s=a.timeout,
                      temperature=a.temperature, api=api)
        asyncio.run(run_load(addr, warm, wl, desc=f"{label} warmup", progress=progress))
    for ld in loads(a, api):
        desc = f"{label} " + (f"rate {ld.rate:g}" if ld.rate else f"conc {ld.concurrency}")
        results = asyncio.run(run_load(addr, measured, ld, desc=desc, progress=progress))
        s = metrics.summarize(results, slo_ttft, slo_tpot)
        dep["runs"].append({"rate": _json_rate(ld.rate), "concurrency": ld.concurrency,
                            "summary": s, "requests": [_compact(r) for r in results]})
        raw.append((label, ld, s, results))
        print_summary(desc, s)


def _json_rate(rate):
    return "inf" if rate is not None and math.isinf(rate) else rate


def _compact(r: metrics.RequestResult) -> dict:
    d = {"id": r.id, "start_s": round(r.start_s, 4), "code": r.code,
         "latency_ms": round(1000 * r.latency_s, 2)}
    if r.ok:
        d.update(ttft_ms=round(1000 * r.ttft_s, 2), tokens=r.completion_tokens,
                 prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                 messages=len(r.token_times))
    return d


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_summary(desc: str, s: dict) -> None:
    print(f"\n== {desc}: {s['num_ok']}/{s['num_requests']} ok in {s['duration_s']:.1f}s; "
          f"{s['request_throughput']:.3g} req/s, {s['output_token_throughput']:.4g} tok/s, "
          f"goodput {s['goodput']:.3g} req/s; prefix hit {_fmt(s['prefix_cache_hit_rate'])}")
    print(f"   {'ms':6s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}")
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[k]
        print(f"   {k[:-3].upper():6s} " + " ".join(f"{_fmt(d[q]):>9s}"
                                                 for q in ("mean", "p50", "p90", "p99")))
    if s["errors_by_code"]:
        print(f"   errors: {s['errors_by_code']}")
        for code, msg in s.get("first_error_by_code", {}).items():
            print(f"     {code}, first: {msg or '(no message)'}")


def print_compare(names, c: dict) -> None:
    load = f"rate {c['rate']}" if c["rate"] else f"concurrency {c['concurrency']}"
    print(f"\n== compare at {load}: A = {names[0]}, B = {names[1]}")
    print(f"   {'metric':28s} {'A':>10s} {'B':>10s} {'B/A':>8s}")
    for row in c["rows"]:
        print(f"   {row['metric']:28s} {_fmt(row['a']):>10s} {_fmt(row['b']):>10s} "
              f"{_fmt(row['b_over_a']):>8s}")


def write_outputs(a, report: dict) -> list[str]:
    raw = report.pop("_raw")
    written = []
    if a.out:
        stem = a.out[:-5] if a.out.endswith(".json") else a.out
        if not a.no_plots and raw:
            from pdserve.benchlib import plots
            many = len({id(ld) for _, ld, _, _ in raw}) > len({lb for lb, _, _, _ in raw})
            runs = [(f"{lb} @ {load_x(ld):g}" if many else lb, load_x(ld), s, rs)
                    for lb, ld, s, rs in raw]
            series: dict = {}
            for lb, ld, s, _ in raw:
                series.setdefault(lb, []).append((load_x(ld), s))
            xlabel = "offered rate (req/s)" if raw[0][1].rate else "concurrency"
            written.append(plots.latency_cdfs(runs, stem + "_cdf.png"))
            written.append(plots.throughput_vs_load(series, stem + "_throughput.png", xlabel))
            report["plots"] = [os.path.basename(x) for x in written]
        with open(stem + ".json", "w") as f:
            json.dump(report, f, indent=1)
        written.insert(0, stem + ".json")
    return written


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    a.argv = argv
    if a.device is not None:
        from engine.config import EngineConfig
        try:
            EngineConfig(device=a.device)
        except ValueError as e:
            p.error(str(e))
    from services.config import ConfigError, client_settings
    try:
        # the client's gRPC completion thread hands each message to the event loop; with
        # Python's 5 ms switch interval that handoff waits (docs/performance.md)
        sys.setswitchinterval(client_settings().gil_switch_interval_us / 1e6)
    except ConfigError as e:
        p.error(str(e))
    try:
        items, meta = make_items(a)
        if a.save_workload:
            workload.save(items, a.save_workload)
            print(f"wrote {len(items)} items to {a.save_workload}", file=sys.stderr)
        if len(items) <= a.warmup:
            p.error(f"the workload has {len(items)} items, not more than --warmup {a.warmup}")
        report = run_all(a, items, meta)
    except ValueError as e:
        p.error(str(e))
    for path in write_outputs(a, report):
        print(f"wrote {path}", file=sys.stderr)
    bad = sum(r["summary"]["num_ok"] == 0 for d in report["deployments"] for r in d["runs"])
    return 1 if bad else 0
