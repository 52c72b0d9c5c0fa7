"""pdserve bench against a gateway with known, injected latencies.

A real ``grpc.aio`` Gateway server (tests/unit/injected_gateway.py) runs in its own process
and serves each request as its prompt says: ``ttft=MS itl=MS`` (sleep before the first
message, then between messages), ``fail=CODE`` (abort with that status), ``hang`` (never
answer). It streams ``max_tokens`` messages of one token each, and reports
``cached_tokens = prompt_tokens // 2`` in the usage.

Tolerance for timings: within 15% or 12 ms of the injected value, whichever is larger (the
dev machines are 2 shared cores; asyncio timers and the GIL add a few ms).
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.benchlib import metrics, workload
from pdserve.benchlib.cli import main as bench_main, parse_up, print_summary
from pdserve.benchlib.metrics import RequestResult
from pdserve.benchlib.runner import LoadSpec, poisson_times, run_load
from pdserve.benchlib.workload import Item, WorkloadSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def close(measured_ms, want_ms, rel=0.15, abs_ms=12.0):
    return abs(measured_ms - want_ms) <= max(rel * want_ms, abs_ms)


@pytest.fixture(scope="module")
def gateway():
    """The latency-injecting gateway in its own process, so its timing never shares a GIL with
    the client being measured (in a thread of the test process it added ~15 ms at random)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.injected_gateway"],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        address = f"127.0.0.1:{int(line.split()[1])}"
        run(address, items(["ttft=1"] * 4, max_tokens=2), concurrency=4)  # warm both sides up
        yield address
    finally:
        proc.kill()
        proc.wait(10)


def items(prompts, max_tokens=6):
    return [Item(f"r{i}", max_tokens, prompt=p) for i, p in enumerate(prompts)]


def run(address, its, **load):
    return asyncio.run(run_load(address, its, LoadSpec(**load), progress=False))


# ---- measurements against injected latencies ----------------------------------------------

def test_latencies_and_throughput_match_injected(gateway):
    rs = run(gateway, items(["ttft=50 itl=20 a b c d"] * 8, max_tokens=6), concurrency=4)
    s = metrics.summarize(rs)
    assert s["num_ok"] == 8 and s["errors_by_code"] == {}
    assert close(s["ttft_ms"]["p50"], 50), s["ttft_ms"]
    assert close(s["itl_ms"]["p50"], 20), s["itl_ms"]
    assert close(s["tpot_ms"]["mean"], 20), s["tpot_ms"]
    assert close(s["e2e_ms"]["p50"], 50 + 5 * 20), s["e2e_ms"]
    assert s["itl_ms"]["n"] == 8 * 5
    # closed loop, 4 clients, 150 ms per request: two rounds, 8 requests in ~0.3 s
    assert close(1000 * s["duration_s"], 300, rel=0.2, abs_ms=20), s["duration_s"]
    assert s["output_token_throughput"] == pytest.approx(6 * s["request_throughput"], rel=1e-3)
    assert s["request_throughput"] == pytest.approx(8 / s["duration_s"], rel=1e-3)
    assert s["prefix_cache_hit_rate"] == pytest.approx(3 / 6)  # the server caches half the words


def test_goodput_counts_requests_meeting_both_slos(gateway):
    fast, slow_ttft, slow_tpot = "ttft=10 itl=5", "ttft=150 itl=5", "ttft=10 itl=60"
    prompts = [fast] * 4 + [slow_ttft] * 2 + [slow_tpot] * 2
    rs = run(gateway, items(prompts, max_tokens=4), rate=float("inf"))
    s = metrics.summarize(rs, slo_ttft_s=0.080, slo_tpot_s=0.030)
    assert s["num_ok"] == 8
    assert s["num_good"] == 4  # exactly the fast half
    assert s["goodput"] == pytest.approx(4 / s["duration_s"], rel=1e-3)
    assert metrics.summarize(rs)["num_good"] == 8  # no SLO: every success counts


def test_errors_counted_by_status_code_never_raise(gateway):
    prompts = (["ttft=5 itl=1"] * 5 + ["fail=RESOURCE_EXHAUSTED"] * 3 + ["fail=UNAVAILABLE"]
               + ["hang"])
    rs = run(gateway, items(prompts, max_tokens=3), rate=float("inf"), timeout_s=0.5)
    s = metrics.summarize(rs)
    assert s["num_ok"] == 5 and s["num_errors"] == 5
    assert s["errors_by_code"] == {"DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 3,
                                   "UNAVAILABLE": 1}
    assert s["completion_tokens"] == 15  # failed requests add no tokens


def test_unreachable_gateway_is_an_error_not_a_crash():
    from pdserve.cluster import free_port
    rs = run(f"127.0.0.1:{free_port()}", items(["x"] * 2), concurrency=2, timeout_s=2)
    assert [r.code for r in rs] == ["UNAVAILABLE"] * 2


def test_poisson_arrivals_have_the_right_rate():
    n, rate = 4000, 8.0
    t = poisson_times(n, rate, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    # mean of n exponential gaps: std 1/(rate*sqrt(n)) -> 4 sigma is ~6%
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=4 / n ** 0.5)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.1)  # exponential: sd = mean
    assert t == poisson_times(n, rate, seed=1) and t != poisson_times(n, rate, seed=2)
    assert poisson_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_requests_are_sent_at_their_scheduled_times(gateway):
    n, rate = 30, 40.0
    rs = run(gateway, items(["ttft=1"] * n, max_tokens=1), rate=rate, seed=3)
    want = poisson_times(n, rate, seed=3)
    got = sorted(r.start_s for r in rs)
    lateness = [1000 * (g - w) for g, w in zip(got, want)]
    assert statistics.median(lateness) < 8 and min(lateness) > -1, lateness


def test_duration_stops_sending():
    its = items(["ttft=1"] * 100, max_tokens=1)
    t = poisson_times(100, 50.0, seed=0)
    expected = sum(x < 0.3 for x in t)
    assert 5 < expected < 30
    # a gateway is not needed to count what is sent: every send to a closed port fails fast
    from pdserve.cluster import free_port
    rs = run(f"127.0.0.1:{free_port()}", its, rate=50.0, duration_s=0.3, timeout_s=1)
    assert len(rs) == expected


# ---- figures from hand-made records -------------------------------------------------------

def test_summary_exact_values():
    a = RequestResult("a", 0.0, ok=True, ttft_s=0.1, latency_s=0.5, completion_tokens=5,
                      token_times=[0.1, 0.2, 0.3, 0.4, 0.5], prompt_tokens=10, cached_tokens=4)
    b = RequestResult("b", 0.5, ok=True, ttft_s=0.3, latency_s=0.5, completion_tokens=3,
                      token_times=[0.3, 0.4, 0.5], prompt_tokens=10, cached_tokens=0)
    c = RequestResult("c", 0.2, code="RESOURCE_EXHAUSTED", latency_s=0.01)
    s = metrics.summarize([a, b, c], slo_ttft_s=0.2)
    assert s["duration_s"] == 1.0  # 0.0 .. b ends at 1.0
    assert s["request_throughput"] == 2.0 and s["output_token_throughput"] == 8.0
    assert s["goodput"] == 1.0 and s["num_good"] == 1
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (0.5-0.3)/2
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["n"] == 6 and s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["prefix_cache_hit_rate"] == 0.2
    assert s["errors_by_code"] == {"RESOURCE_EXHAUSTED": 1}


def test_summary_keeps_each_error_codes_first_message(capsys):
    """A run that failed says why, once per status code: the first request's message."""
    rs = [RequestResult(str(i), 0.1 * i, code="INVALID_ARGUMENT", error=f"unknown model {i}")
          for i in range(3)] + [RequestResult("x", 0.5, code="UNAVAILABLE")]
    s = metrics.summarize(rs)
    assert s["first_error_by_code"] == {"INVALID_ARGUMENT": "unknown model 0",
                                        "UNAVAILABLE": ""}
    print_summary("run", s)
    out = capsys.readouterr().out
    assert "INVALID_ARGUMENT, first: unknown model 0" in out
    assert "UNAVAILABLE, first: (no message)" in out


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.5, 2.2]
    for q in (0, 50, 90, 99, 100):
        assert metrics.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert metrics.percentile([], 50) is None


def test_compare_ratios():
    a = {"request_throughput": 2.0, "ttft_ms": {"p50": 100.0}}
    b = {"request_throughput": 3.0, "ttft_ms": {"p50": 50.0}}
    rows = {r["metric"]: r for r in metrics.compare(a, b)}
    assert rows["request throughput (req/s)"]["b_over_a"] == 1.5
    assert rows["TTFT p50 (ms)"]["b_over_a"] == 0.5
    assert rows["goodput (req/s)"]["b_over_a"] is None


# ---- workloads ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["random", "prefix", "multiturn", "longmix"])
@pytest.mark.parametrize("fmt", ["text", "tokens"])
def test_workloads_are_deterministic_and_round_trip(kind, fmt, tmp_path):
    spec = WorkloadSpec(kind=kind, fmt=fmt, num_requests=40, seed=7, input_len=(4, 12),
                        output_len=(2, 9), prefix_len=20, long_len=64, vocab_size=500)
    a, b = workload.generate(spec), workload.generate(spec)
    assert a == b
    other = workload.generate(WorkloadSpec(**{**spec.__dict__, "seed": 8}))
    assert a != other
    path = tmp_path / "w.jsonl"
    workload.save(a, str(path))
    assert workload.load(str(path)) == a
    assert len(a) == 40 and len({it.id for it in a}) == 40
    assert all(2 <= it.max_tokens <= 9 for it in a)


def test_prefix_workload_shares_system_prompts():
    spec = WorkloadSpec(kind="prefix", fmt="tokens", num_requests=60, num_prefixes=3,
                        num_users=4, prefix_len=32, input_len=(5, 5), seed=1)
    its = workload.generate(spec)
    groups = {}
    for it in its:
        groups.setdefault(it.group, set()).add(tuple(it.token_ids[:32]))
    assert len(groups) == 3 and all(len(v) == 1 for v in groups.values())
    assert len({tuple(it.token_ids) for it in its}) <= 12  # 3 system prompts x 4 users


def test_multiturn_turns_extend_the_conversation():
    spec = WorkloadSpec(kind="multiturn", num_requests=12, num_turns=3, seed=2)
    its = workload.generate(spec)
    last = {}
    for it in its:
        prev = last.get(it.group)
        if prev is not None:
            assert it.extra["turn"] == prev.extra["turn"] + 1
            assert it.messages[:len(prev.messages)] == prev.messages
            assert it.messages[len(prev.messages)]["role"] == "assistant"
        else:
            assert it.extra["turn"] == 0 and len(it.messages) == 1
        last[it.group] = it
    assert all(it.extra["turn"] == 2 for it in last.values())


def test_longmix_has_long_prompts():
    spec = WorkloadSpec(kind="longmix", num_requests=400, long_frac=0.25, long_len=100,
                        input_len=(5, 10), seed=3)
    n_long = sum(it.prompt_units == 100 for it in workload.generate(spec))
    assert 60 < n_long < 140


def test_parse_up():
    assert parse_up("prefill=1,decode=2") == {"prefill": 1, "decode": 2, "colocated": 0}
    for bad in ("prefill=1", "", "gpu=2", "colocated=x"):
        with pytest.raises(ValueError):
            parse_up(bad)


# ---- the command line, end to end ---------------------------------------------------------

def test_cli_compare_writes_json_and_plots(gateway, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    wl = tmp_path / "w.jsonl"
    workload.save(items(["ttft=20 itl=5"] * 6, max_tokens=3), str(wl))
    out = tmp_path / "r.json"
    rc = bench_main(["--compare", gateway, gateway, "--workload", str(wl), "--warmup", "1",
                     "--rates", "50,inf", "--no-progress", "--slo-ttft-ms", "200",
                     "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["command"].startswith("pdserve bench --compare")
    assert len(rep["deployments"]) == 2 and len(rep["compare"]) == 2
    for d in rep["deployments"]:
        assert [r["rate"] for r in d["runs"]] == [50.0, "inf"]
        assert all(r["summary"]["num_ok"] == 5 for r in d["runs"])  # 6 items - 1 warm-up
    assert (tmp_path / "r_cdf.png").stat().st_size > 1000
    assert (tmp_path / "r_throughput.png").stat().st_size > 1000
    assert "B/A" in capsys.readouterr().out


def test_max_rate_at_slo_is_the_last_rate_of_the_unbroken_run():
    """Goodput as DistServe defines it: the highest rate of the sweep up to which every rate
    kept 90% of its requests within the SLO; a later recovery does not count."""
    from bench.disagg_report import max_rate_at_slo

    def rows(*pairs):
        return [{"rate": r, "summary": {"slo_attainment": a}} for r, a in pairs]

    assert max_rate_at_slo(rows((16, 0.95), (4, 1.0), (8, 0.99), (24, 0.5))) == 16
    assert max_rate_at_slo(rows((4, 1.0), (8, 0.7), (16, 0.95))) == 4
    assert max_rate_at_slo(rows((4, 0.89))) is None
    assert max_rate_at_slo(rows((4, 0.9), (8, None))) == 4


def test_disagg_rate_samples_follow_the_rate_not_its_place_in_the_list():
    """bench/disagg_gpu.py: a rate label carries the same prompts and arrival seed whatever
    the other rates of the run, and different rates carry different samples."""
    import argparse
    from bench.disagg_workload import rate_items, rate_seed
    a = argparse.Namespace(seed=0, num_requests=6, duration=1.0, vocab_size=500,
                           short=(4, 8), out_range=(2, 3), long_frac=0.25, prompt_len=16)
    first = rate_items(a, 0, 26.0)
    assert [it.token_ids for it in rate_items(a, 3, 26.0)] == [it.token_ids for it in first]
    assert [it.token_ids for it in rate_items(a, 0, 27.0)] != [it.token_ids for it in first]
    assert rate_seed(a, 26.0, 200) == rate_seed(a, 26.0, 200) != rate_seed(a, 26.0, 100)


def test_slo_limits_pool_the_samples_of_a_rate_across_runs():
    """disagg_report --limits: a rate's samples from several runs are pooled (21 req/s: one
    sample at 92%, one at 27% -> 60%, failed); the token-rate limit is the highest offered
    prompt tok/s that passed below the lowest that failed."""
    from bench.disagg_report import limits

    def run(dep, *rows):
        return {"deployments": {dep: {"mixed": [
            {"rate": r, "summary": {"slo_attainment": g / n, "num_good": g, "num_requests": n,
                                    "offered_prompt_tokens_per_s": t}}
            for r, g, n, t in rows]}}}

    docs = [run("colocated", (20, 97, 100, 25500), (21, 27, 100, 27900)),
            run("colocated", (21, 92, 100, 27400), (19, 99, 100, 24800)),
            run("1p1d", (26, 95, 100, 34400), (28, 21, 100, 35400), (27, 65, 100, 36200))]
    out = limits(docs)
    col, pd = out["deployments"]["colocated"], out["deployments"]["1p1d"]
    assert (col["rate"], col["prompt_tokens_per_s"]) == (20, 27400)
    assert col["pooled_attainment"][21] == 0.595
    assert (pd["rate"], pd["prompt_tokens_per_s"]) == (26, 34400)
    assert out["ratio"] == {"rate": 1.3, "prompt_tokens_per_s": round(34400 / 27400, 4)}
    assert limits([run("1p1d", (4, 80, 100, 1000))])["deployments"]["1p1d"]["rate"] is None


def test_limits_rescore_requests_against_another_slo():
    """disagg_report --limits --slo-ttft-ms/--slo-tpot-ms: every request of every rate is
    re-scored from its record; against the run's own SLO it gives the run's own count (a
    committed GPU run), and a tighter TPOT SLO drops exactly the slow decoders."""
    from bench.disagg_report import limits, rescore

    doc = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" / "disagg_gpu" /
                      "h200-s11" / "colocated.json").read_text())
    for row in doc["deployments"]["colocated"]["mixed"]:
        s = row["summary"]
        assert rescore(row, 1000, 50) == (s["num_good"], s["num_requests"])
    fields = ["id", "long", "start_s", "code", "e2e_ms", "ttft_ms", "prompt_tokens",
              "completion_tokens", "cached_tokens", "max_gap_ms"]
    reqs = [["a", False, 0.0, "OK", 1100.0, 100.0, 10, 41, 0, 30.0],    # TPOT 25 ms
            ["b", False, 0.1, "OK", 1300.0, 100.0, 10, 41, 0, 40.0],    # TPOT 30 ms
            ["c", True, 0.2, "OK", 1280.0, 1200.0, 10, 5, 0, 20.0],     # TTFT 1.2 s, TPOT 20
            ["d", False, 0.3, "UNAVAILABLE", 5.0, None, 10, 0, 0, None],
            ["e", False, 0.4, "OK", 300.0, 300.0, 10, 1, 0, None]]      # one token: no TPOT
    row = {"rate": 4.0, "request_fields": fields, "requests": reqs,
           "summary": {"slo_attainment": 0.6, "num_good": 3, "num_requests": 5,
                       "offered_prompt_tokens_per_s": 50}}
    assert rescore(row, 1000, 50) == (3, 5)
    assert rescore(row, 1000, 25) == (2, 5)
    assert rescore(row, None, 25) == (3, 5)  # TTFT left out: not checked
    out = limits([{"deployments": {"1p1d": {"mixed": [row]}}}], attainment=0.5, slo=(1000, 25))
    assert out["slo"] == {"ttft_ms": 1000, "tpot_ms": 25}
    assert out["deployments"]["1p1d"]["samples"][0]["slo_attainment"] == 0.4
    assert out["deployments"]["1p1d"]["rate"] is None
