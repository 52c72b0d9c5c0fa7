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
