"""gRPC fuzzing of the gateway (pdserve/chaos/fuzz.py) against a real 1P1D cluster: no
UNKNOWN, no crash, no leaked or stranded block, memory back near its baseline. A few hundred
requests here; 10,000 in the slow test."""
from __future__ import annotations

import time

import pytest

from pdserve.chaos.fuzz import rss_bytes, run_fuzz
from pdserve.chaos.soak import fill_kv_caches
from pdserve.chaos.streams import greedy_requests, run_streams, settle
from pdserve.cluster import LocalCluster
from tests.integration.helpers import run


@pytest.fixture(scope="module")
def cluster():
    # a small KV cache, every block of it used once before any baseline: CPU caches are
    # backed lazily (pdserve/chaos/soak.py), so a fresh block read as a leak would
    with LocalCluster("dummy:tiny", prefill=1, decode=1,
                      worker_args=("--max-model-len", "256", "--num-blocks", "2048")) as c:
        run(fill_kv_caches(c.address, c.workers, vocab=259))
        yield c


def _fuzz(cluster, n, seed):
    procs = [cluster.gateway] + cluster.workers
    run(run_fuzz(cluster.address, 320, seed=seed + 1000))  # the same mix, to warm up
    time.sleep(11)  # one heap trim of the gateway (services/memory.py)
    before = [rss_bytes(p.proc.pid) for p in procs]
    report = run(run_fuzz(cluster.address, n, seed=seed))
    assert not report.bad, report.to_dict()
    assert report.codes["OK"] > 0 and report.codes["INVALID_ARGUMENT"] > 0, report.codes
    assert all(p.alive for p in procs)
    after = run(settle(cluster.workers, timeout_s=60))
    assert all(v["used"] == 0 and v["stranded"] == 0 for v in after.values()), after
    # the cluster still serves
    assert all(s.code == "OK" for s in run(run_streams(cluster.address, greedy_requests(2, 4))))
    # the lowest of three readings a heap trim apart: a leak stays, a transient peak of the
    # allocator (one reading of five in 1000-request steps went +22 MiB and back) does not
    now = [rss_bytes(p.proc.pid) for p in procs]
    for _ in range(2):
        time.sleep(11)
        now = [min(n, rss_bytes(p.proc.pid)) for n, p in zip(now, procs)]
    grown = [(a - b) for a, b in zip(now, before)]
    return report, [g / b for g, b in zip(grown, before)], grown


def _bounded(rel, grown):
    """Back near the warmed-up baseline: within 20% or 24 MiB (allocator noise)."""
    return all(r < 0.20 or g < 24 << 20 for r, g in zip(rel, grown))


def test_fuzz_a_few_hundred(cluster):
    report, rel, grown = _fuzz(cluster, 320, seed=1)
    assert _bounded(rel, grown), (rel, grown)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~10 min of fuzzing on 2 busy cores, the KV fill and three trims
def test_fuzz_ten_thousand(cluster):
    report, rel, grown = _fuzz(cluster, 10_000, seed=2)
    assert _bounded(rel, grown), (rel, grown)
