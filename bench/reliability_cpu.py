"""Faults and hostile input against real local clusters (CPU): the chaos scenarios, the gRPC
fuzzer and the soak of pdserve/chaos, with what each checked.

    python3 -m bench.reliability_cpu --part chaos --set cpu-mycommit   (~12 min, 7 scenarios)
    python3 -m bench.reliability_cpu --part fuzz --requests 10000 --set cpu-mycommit
    python3 -m bench.reliability_cpu --part soak --duration 600 --set cpu-mycommit (~12 min)

chaos: every scenario of ``pdserve chaos`` on the embedded model (pass/fail per check,
figures such as the longest pause a client saw). fuzz: random and mutated GenerateRequests
against a 1P1D dummy:tiny cluster (status codes, any UNKNOWN / INTERNAL / UNAVAILABLE, RSS
of each process before and after, blocks left). soak: 1P1D on the embedded model, its
capacity measured closed-loop, then Poisson arrivals at half of it (each process's RSS drift
after the warm-up, outcomes, blocks left).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from pdserve.benchlib import harness
from pdserve.chaos.fuzz import rss_bytes, run_fuzz
from pdserve.chaos.scenarios import SCENARIOS
from pdserve.chaos.soak import capacity, fill_kv_caches, soak
from pdserve.chaos.streams import settle
from pdserve.cluster import LocalCluster

FIGURES = {
    "chaos": [harness.Figure("chaos scenarios passed", "", ("summary", "passed")),
              harness.Figure("chaos scenarios run", "", ("summary", "scenarios"))],
    "fuzz": [harness.Figure("fuzzed requests", "", ("fuzz", "sent")),
             harness.Figure("answers with UNKNOWN / INTERNAL / UNAVAILABLE", "",
                            ("summary", "bad"))],
    "soak": [harness.Figure("soak: largest RSS growth after warm-up", "",
                            ("summary", "max_growth"), format=".4f"),
             harness.Figure("soak: largest RSS change either way", "",
                            ("summary", "max_abs_drift"), format=".4f")],
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python3 -m bench.reliability_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("chaos", "fuzz", "soak"), required=True)
    p.add_argument("--model", default="smollm2-135m", help="chaos and soak clusters' model")
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                   help="chaos: scenario (repeatable; default all)")
    p.add_argument("--requests", type=int, default=10_000, help="fuzz: requests")
    p.add_argument("--duration", type=float, default=600.0, help="soak: seconds of traffic")
    p.add_argument("--warmup", type=float, default=60.0, help="soak: seconds before drift")
    harness.add_output_args(p, "reliability_cpu")
    return p.parse_args(argv)


def chaos(a, rec) -> None:
    rec["scenarios"] = []
    for name in a.scenario or list(SCENARIOS):
        t0 = time.monotonic()
        res = SCENARIOS[name](a.model).to_dict()
        res["seconds"] = round(time.monotonic() - t0, 1)
        rec["scenarios"].append(res)
        print(name, "passed" if res["passed"] else "FAILED", flush=True)
        rec.save()
    rec["summary"] = {"passed": sum(r["passed"] for r in rec["scenarios"]),
                      "scenarios": len(rec["scenarios"])}


def fuzz(a, rec) -> None:
    # as tests/integration/test_fuzz.py: a small KV cache, every block used once first
    with LocalCluster("dummy:tiny", prefill=1, decode=1,
                      worker_args=("--max-model-len", "256", "--num-blocks", "2048")) as c:
        procs = {"gateway": c.gateway, **{w.kind: w for w in c.workers}}
        rec["kv_fill_prompt_tokens"] = asyncio.run(fill_kv_caches(c.address, c.workers,
                                                                  vocab=259))
        asyncio.run(run_fuzz(c.address, 320, seed=1000))  # warm-up: the same mix
        time.sleep(11)
        before = {n: rss_bytes(s.proc.pid) for n, s in procs.items()}
        report = asyncio.run(run_fuzz(c.address, a.requests, seed=2))
        after_blocks = asyncio.run(settle(c.workers, timeout_s=60))
        time.sleep(11)
        after = {n: rss_bytes(s.proc.pid) for n, s in procs.items()}
        rec["fuzz"] = report.to_dict()
        rec["rss_mib"] = {n: {"before": before[n] >> 20, "after": after[n] >> 20}
                          for n in procs}
        rec["workers_after"] = after_blocks
        rec["summary"] = {"bad": len(report.bad), "alive": all(s.alive for s in procs.values())}


def soak_part(a, rec) -> None:
    with LocalCluster(a.model, prefill=1, decode=1) as c:
        cap = asyncio.run(capacity(c.address, seconds=60))
        rec["capacity_req_s"] = cap
        rec["kv_fill_prompt_tokens"] = asyncio.run(fill_kv_caches(c.address, c.workers))
        procs = {"gateway": c.gateway.proc.pid, **{w.kind: w.proc.pid for w in c.workers}}
        rep = asyncio.run(soak(c.address, procs, rate=cap / 2, duration_s=a.duration,
                               warmup_s=a.warmup))
        rec["soak"] = rep.to_dict()
        rec["workers_after"] = asyncio.run(settle(c.workers, timeout_s=60))
        drift = rep.drift()
        rec["summary"] = {"max_abs_drift": max(abs(d) for d in drift.values()),
                          "max_growth": max(drift.values()),
                          "codes": dict(rep.codes)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    rec = harness.Recorder.start("reliability_cpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES[a.part], filename=f"{a.part}.json")
    {"chaos": chaos, "fuzz": fuzz, "soak": soak_part}[a.part](a, rec)
    print(f"wrote {rec.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
