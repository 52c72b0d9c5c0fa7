"""An outside OpenAI benchmark client against the gateway's HTTP API, next to ``pdserve
bench --api openai`` on the same workload: NVIDIA's aiperf (PyPI ``aiperf``: no torch; it may
live in a virtual environment of its own, named by ``--aiperf``).

    python3 -m bench.openai_outside_cpu --aiperf /tmp/obench/bin/aiperf --set cpu-2core
    python3 -m bench.openai_outside_cpu --aiperf /tmp/obench/bin/aiperf --rounds 1 \\
        --requests 16 --out /tmp/outside.json                          (quick)

One colocated cluster (real processes, real Redis); rounds alternate aiperf and pdserve
bench's runner (pdserve.benchlib.runner, ``api="openai"``), each at --concurrency closed-loop
clients sending --requests streamed completions of --isl-token prompts (aiperf's synthetic
text; pdserve's runner replays the text aiperf sent, or random token ids with
--no-replay) and exactly --osl output tokens (``ignore_eos``), token
counts from the server's usage. aiperf reads the model's tokenizer from a local folder this
driver writes (tokenizer.json from the engine's tokenizer: no network). Reported per round:
output tok/s, request/s, TTFT p50 and ITL p50 from each client, and the medians' ratio
aiperf / pdserve (target: within 10%).

Fairness on a small machine (--pin, on by default): the serving processes (gateway, worker,
redis-server, every thread) run on all CPUs but the last and each client on the last one,
so neither client's own CPU (aiperf's process tree uses ~60x our runner's) is taken from
the server; aiperf runs with one worker and one record processor (--aiperf-args).
--no-prefix-caching turns the worker's prefix cache off: aiperf's synthetic prompts share
their first blocks, the runner's random ids do not.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.benchlib import affinity, harness, metrics, workload
from pdserve.benchlib.runner import LoadSpec, run_load

FIGURES = [
    harness.Figure("aiperf / pdserve bench: output tok/s (median of rounds)", "",
                   ("summary", "output_tok_s_ratio"), format=".3f"),
    harness.Figure("aiperf / pdserve bench: TTFT p50", "", ("summary", "ttft_p50_ratio"),
                   format=".3f"),
]


def tokenizer_dir(model: str, root: Path) -> Path:
    from engine.loader import load_tokenizer
    tok = load_tokenizer(model)
    d = root / "tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
           "bos_token": tok.bos_token, "eos_token": tok.eos_token,
           "chat_template": tok.chat_template}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def aiperf_round(a, http: str, tok: Path, work: Path, i: int) -> dict:
    art = work / f"aiperf{i}"
    cmd = [a.aiperf, "profile", "--model", a.model, "--url", f"http://{http}",
           "--endpoint-type", "completions", "--streaming", "--tokenizer", str(tok),
           "--concurrency", str(a.concurrency), "--request-count", str(a.requests),
           "--warmup-request-count", str(a.concurrency), "--isl", str(a.isl),
           "--isl-stddev", "0", "--osl", str(a.osl), "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", f"max_tokens:{a.osl}", "--use-server-token-count",
           "--random-seed", str(i), "--output-artifact-dir", str(art), "--ui-type", "none",
           *shlex.split(a.aiperf_args)]
    pin = (lambda: os.sched_setaffinity(0, a.client_cpus)) if a.client_cpus else None
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, preexec_fn=pin)
    if p.returncode != 0:
        raise RuntimeError(f"aiperf failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    found = sorted(art.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"no aiperf export under {art}:\n{p.stdout[-2000:]}")
    m = json.loads(found[0].read_text())

    def val(key, stat="avg"):
        x = m.get(key) or {}
        return x.get(stat) if isinstance(x, dict) else x
    return {"output_tok_s": val("output_token_throughput"),
            "request_s": val("request_throughput"), "ttft_p50_ms": val("time_to_first_token", "p50"),
            "itl_p50_ms": val("inter_token_latency", "p50"),
            "requests": val("request_count"), "prompt_tokens_mean": val("usage_prompt_tokens"),
            "output_tokens_mean": val("output_sequence_length"),
            "aiperf_export": {k: m[k] for k in ("output_token_throughput", "request_throughput",
                                                "time_to_first_token", "inter_token_latency",
                                                "request_latency", "benchmark_duration",
                                                "effective_concurrency",
                                                "credit_to_start_latency",
                                                "usage_prompt_cache_read_tokens")
                              if k in m}}


def aiperf_prompts(work: Path, osl: int) -> list[workload.Item]:
    """The completion prompts of the latest aiperf round (its inputs.json), as items."""
    found = sorted(work.rglob("inputs.json"), key=lambda f: f.stat().st_mtime)
    if not found:
        return []
    data = json.loads(found[-1].read_text()).get("data", [])
    prompts = [p["prompt"] for d in data for p in d.get("payloads", [])
               if isinstance(p.get("prompt"), str)]
    return [workload.Item(id=f"aiperf-{k}", max_tokens=osl, prompt=t)
            for k, t in enumerate(prompts)]


def pdserve_round(a, http: str, vocab: int, i: int, work: Path) -> dict:
    """One round of pdserve bench's runner: aiperf's own text prompts (``--replay``, from
    the latest aiperf round, cycled to the request count), else random token ids."""
    its = aiperf_prompts(work, a.osl) if a.replay else []
    if its:
        its = [its[k % len(its)] for k in range(a.requests + a.concurrency)]
    else:
        its = workload.generate(workload.WorkloadSpec(
            kind="random", num_requests=a.requests + a.concurrency, seed=100 + i,
            fmt="tokens", vocab_size=vocab, input_len=(a.isl, a.isl),
            output_len=(a.osl, a.osl)))
    load = LoadSpec(concurrency=a.concurrency, api="openai")
    asyncio.run(run_load(http, its[:a.concurrency], load, progress=False))  # warm-up
    res = asyncio.run(run_load(http, its[a.concurrency:], load, progress=False))
    s = metrics.summarize(res)
    ok = [r for r in res if r.ok] or [None]
    return {"output_tok_s": s["output_token_throughput"], "request_s": s["request_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "itl_p50_ms": s["itl_ms"]["p50"],
            "requests": s["num_ok"], "errors": s["errors_by_code"],
            "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in ok) if ok[0] else 0,
            "output_tokens_mean": statistics.mean(r.completion_tokens for r in ok) if ok[0]
            else 0}


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_marks(servers: list[int]) -> tuple:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.process_time(), kids.ru_utime + kids.ru_stime,
            [_proc_cpu_s(p) for p in servers], time.perf_counter())


def _cpu_spent(marks: tuple, servers: list[int]) -> dict:
    """CPU seconds a round cost: the client (this process for pdserve bench's runner, the
    waited-for aiperf process tree for aiperf) and the serving processes, and the wall
    time; on a 2-core machine a client's CPU is taken from the CPU-bound server."""
    own, kids, srv, wall = marks
    k = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"client": round(time.process_time() - own + (k.ru_utime + k.ru_stime - kids), 2),
            "servers": round(sum(_proc_cpu_s(p) for p in servers) - sum(srv), 2),
            "wall": round(time.perf_counter() - wall, 2)}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.openai_outside_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--isl", type=int, default=64, help="prompt tokens")
    ap.add_argument("--osl", type=int, default=32, help="output tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0, help="per aiperf run (s)")
    ap.add_argument("--aiperf-args", default="--workers-max 1 --record-processors 1",
                    help="more aiperf flags: by default one worker and one record processor "
                         "(on 2 cores aiperf's own processes otherwise take the CPU-bound "
                         "server's time)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="the serving processes on every CPU but the last, each client (this "
                         "process's runner, the aiperf process tree) on the last: on a small "
                         "machine the clients' CPU then never comes out of the server's")
    ap.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                    help="pdserve bench's rounds send the text prompts aiperf sent in its "
                         "latest round (so both clients run the same workload: the gateway "
                         "tokenizes the same text); off, or before any aiperf round: random "
                         "token ids of --isl tokens")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="the worker's prefix cache (off: aiperf's synthetic prompts, which "
                         "share their first blocks, get no advantage over random ids)")
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    harness.add_output_args(ap, "openai_outside_cpu")
    a = ap.parse_args(argv)
    from engine.loader import load_config
    from pdserve.cluster import LocalCluster
    rec = harness.Recorder.start("openai_outside_cpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    rec["note"] = a.note
    ver = subprocess.run([a.aiperf, "--version"], capture_output=True, text=True)
    rec["aiperf_version"] = (ver.stdout or ver.stderr).strip()[:200]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(a.model, prefill=0, decode=0, colocated=1, http_port=0,
                         worker_args=() if a.prefix_caching
                         else ("--no-enable-prefix-caching",)) as c:
        tok = tokenizer_dir(a.model, Path(tmp))
        vocab = load_config(a.model).vocab_size
        servers = [c.gateway.proc.pid] + [w.proc.pid for w in c.workers]
        split = affinity.split_cluster(c) if a.pin else None
        a.client_cpus = set(split["client"]) if split else None  # aiperf's too
        rec["cpus"] = split or {"server": "all", "client": "all"}
        for i in range(a.rounds):  # aiperf first in round 0, so --replay has its prompts
            order = ("aiperf", "pdserve") if i % 2 == 0 else ("pdserve", "aiperf")
            r = {}
            for who in order:
                cpu = _cpu_marks(servers)
                r[who] = aiperf_round(a, c.http_address, tok, Path(tmp), i) if who == "aiperf" \
                    else pdserve_round(a, c.http_address, vocab, i, Path(tmp))
                r[who]["cpu_s"] = _cpu_spent(cpu, servers)
            print(f"round {i}: " + ", ".join(
                f"{w} {r[w]['output_tok_s']:.1f} tok/s TTFT p50 {r[w]['ttft_p50_ms']:.1f} ms"
                for w in order), flush=True)
            rounds.append(r)
            rec["rounds"] = rounds
            rec.save()

    def med(who, key):
        return statistics.median(r[who][key] for r in rounds)
    rec["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    rec["summary"] = {
        "output_tok_s_aiperf": med("aiperf", "output_tok_s"),
        "output_tok_s_pdserve": med("pdserve", "output_tok_s"),
        "output_tok_s_ratio": med("aiperf", "output_tok_s") / med("pdserve", "output_tok_s"),
        "ttft_p50_ratio": med("aiperf", "ttft_p50_ms") / med("pdserve", "ttft_p50_ms"),
        "itl_p50_ratio": med("aiperf", "itl_p50_ms") / med("pdserve", "itl_p50_ms"),
        "client_cpu_s_aiperf": statistics.median(r["aiperf"]["cpu_s"]["client"]
                                                 for r in rounds),
        "client_cpu_s_pdserve": statistics.median(r["pdserve"]["cpu_s"]["client"]
                                                  for r in rounds),
        "target": "output_tok_s_ratio within [0.9, 1.1]"}
    print(rec["summary"])
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
