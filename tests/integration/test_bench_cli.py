"""`pdserve bench --up` end to end: a real local cluster (dummy:tiny), the real CLI process."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.cluster import REPO


def test_bench_up_prefix_workload_reports_cache_hits(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--up", "--prefill", "1",
           "--decode", "1", "--model", "dummy:tiny", "--workload-kind", "prefix",
           "--num-prefixes", "1", "--num-users", "3", "--prefix-len", "40", "--input-len", "3:5",
           "--output-len", "4:4", "--num-requests", "6", "--warmup", "1", "--rate", "4",
           "--timeout", "60", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    s = rep["deployments"][0]["runs"][0]["summary"]
    assert rep["deployments"][0]["cluster"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert s["num_ok"] == 6 and s["errors_by_code"] == {}
    assert s["completion_tokens"] == 24
    assert s["prefix_cache_hit_rate"] > 0.3  # the 40-word system prompt is shared
    assert (tmp_path / "r_cdf.png").exists() and (tmp_path / "r_throughput.png").exists()


def test_bench_drives_grpc_and_the_openai_http_api_side_by_side(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--up", "--prefill", "0",
           "--decode", "0", "--colocated", "1", "--model", "dummy:tiny", "--apis",
           "grpc,openai", "--input-len", "8:16", "--output-len", "5:5", "--num-requests", "6",
           "--concurrency", "3", "--timeout", "60", "--no-progress", "--no-plots",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    grpc_dep, http_dep = rep["deployments"]
    assert (grpc_dep["api"], http_dep["api"]) == ("grpc", "openai")
    assert http_dep["address"] != grpc_dep["address"]
    for dep in rep["deployments"]:
        s = dep["runs"][0]["summary"]
        assert s["num_ok"] == 6 and s["errors_by_code"] == {}, dep["label"]
        assert s["completion_tokens"] == 30  # counted from the stream's usage
        assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0
    assert rep["compare"][0]["rows"][0]["metric"] == "request throughput (req/s)"
    assert "compare at concurrency 3" in proc.stdout
