"""bench/disagg_gpu.py in its CPU smoke mode, end to end: two real local clusters (1P1D, then
two colocated workers; dummy:tiny fp32, KV over tcp), the real benchmark process, started as
a script with the repository root on PYTHONPATH (bench/__init__.py's second way)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.cluster import REPO


@pytest.mark.slow
def test_disagg_bench_quick_cpu(tmp_path):
    out = tmp_path / "disagg_cpu.json"
    cmd = [sys.executable, "bench/disagg_gpu.py", "--quick", "--devices", "cpu",
           "--model", "dummy:tiny", "--dtype", "float32", "--kv-backend", "tcp",
           # conditional disaggregation (off by default), scaled to the quick prompts, and a
           # prefill token budget: the flags reach the 1P1D gateway and workers only
           "--gateway-args", "--local-prefill-max-tokens 64 --local-prefill-queue-tokens 1024",
           "--decode-worker-args", "--max-num-batched-tokens 64",
           "--prefill-worker-args", "--max-num-batched-tokens 1024", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=480, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "TTFT added by disaggregation" in proc.stdout  # the human summary
    rep = json.loads(out.read_text())
    assert rep["complete"] and rep["command"].startswith("python3 bench/disagg_gpu.py --quick")
    assert rep["machine"]["python"] and rep["settings"]["rate_list"] == [2.0, 4.0]
    assert rep["benchmark"] == "disagg_gpu" and rep["commit"] and rep["date"]

    for name in ("1p1d", "colocated"):
        dep = rep["deployments"][name]
        assert dep["ttft"]["num_ok"] == rep["settings"]["ttft_repeats"]
        assert dep["ttft"]["ttft_ms"]["p50"] > 0
        assert [r["rate"] for r in dep["mixed"]] == [2.0, 4.0] and not dep["skipped_rates"]
        for run in dep["mixed"]:
            s = run["summary"]
            assert s["num_requests"] > 0 and s["num_errors"] == 0, run["errors"]
            assert s["itl_ms"]["p99"] > 0 and s["goodput"] > 0
            assert s["offered_prompt_tokens_per_s"] == round(s["prompt_tokens"] / 5.0)
            assert s["by_prompt"]["long"]["n"] + s["by_prompt"]["short"]["n"] == s["num_requests"]
            assert len(run["requests"]) == s["num_requests"]
    assert rep["deployments"]["1p1d"]["cluster"] == {"prefill": 1, "decode": 1, "colocated": 0}
    one, co = rep["deployments"]["1p1d"], rep["deployments"]["colocated"]
    assert one["gateway_args"] == ["--local-prefill-max-tokens", "64",
                                   "--local-prefill-queue-tokens", "1024"]
    assert one["role_args"] == {"prefill": ["--max-num-batched-tokens", "1024"],
                                "decode": ["--max-num-batched-tokens", "64"]}
    assert co["gateway_args"] == [] and co["role_args"] == {}
    assert rep["deployment_args"]["1p1d"]["gateway"] == one["gateway_args"]
    for dep in (one, co):
        for run in dep["mixed"]:  # every request routed once (no retries, no errors)
            assert sum(run["routes"].values()) == run["summary"]["num_requests"], run["routes"]
            # each worker's model runs in the window, from its /metrics: all eager on the CPU
            paths = run["step_paths"]
            assert len(paths) == sum(dep["cluster"].values()), paths
            assert all(set(p) <= {"eager"} for p in paths.values()), paths
            assert all(p.get("eager", 0) > 0 for p in paths.values()), paths
            # pieces per KV transfer come from the decode workers' /metrics, counted by the
            # GPU backends and nixl; tcp does not count them
            assert run["kv_pieces"] == {"transfers": 0}, run["kv_pieces"]
    assert set(co["mixed"][0]["routes"]) == {"colocated"}
    assert rep["deployments"]["colocated"]["cluster"] == {"prefill": 0, "decode": 0,
                                                          "colocated": 2}

    cmp_ = rep["comparison"]
    assert isinstance(cmp_["ttft"]["ttft_added_pct"], float)
    # fp32 on the CPU, requests one at a time: the disaggregated path is token-exact
    ex = cmp_["exact_sequential"]
    assert ex["total"] == rep["settings"]["exact_prompts"] and ex["mismatches"] == []
    assert ex["identical"] == ex["total"] and ex["all_identical"], ex
    assert max(ex["prompt_lens"]) == rep["settings"]["prompt_len"]
    assert ex["tokens_compared"] == ex["total"] * rep["settings"]["exact_max_tokens"]
    for row in cmp_["mixed"]:
        assert row["itl_p99_ratio"] > 0 and row["goodput_ratio"] > 0
        assert isinstance(row["itl_pass"], bool) and isinstance(row["goodput_pass"], bool)
    load = cmp_["agreement_under_load"]["total"]
    assert load["requests_compared"] > 0 and load["token_agreement"] is not None
    assert set(cmp_["pass"]) == {"ttft_added", "exact_sequential", "itl_p99_3x_at_rates",
                                 "goodput_1.3x_at_rates", "max_rate_at_slo_1.3x"}
    top = cmp_["max_rate_at_slo"]  # goodput as the highest rate kept at 90% within the SLO
    assert top["rates"] == [2.0, 4.0] and top["attainment"] == 0.9
    assert isinstance(top["pass"], bool)
