"""A 10-minute soak at half the measured capacity (pdserve/chaos/soak.py), 1P1D on the
embedded model: every request succeeds, each process's resident memory drifts < 5% after a
1-minute warm-up (every KV block used once before it: CPU caches are backed lazily), no KV
block is left in use or stranded."""
from __future__ import annotations

import json
import os

import pytest

from pdserve.chaos.soak import capacity, fill_kv_caches, soak
from pdserve.chaos.streams import settle
from pdserve.cluster import LocalCluster
from tests.integration.helpers import run


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 1 min capacity + 1 min warm-up + 10 min soak + settling
def test_soak_at_half_capacity(tmp_path):
    with LocalCluster("smollm2-135m", prefill=1, decode=1) as c:
        cap = run(capacity(c.address, seconds=60))
        run(fill_kv_caches(c.address, c.workers))  # lazily backed CPU caches: see soak.py
        procs = {"gateway": c.gateway.proc.pid,
                 **{f"{w.kind}": w.proc.pid for w in c.workers}}
        rep = run(soak(c.address, procs, rate=cap / 2, duration_s=600, warmup_s=60))
        after = run(settle(c.workers, timeout_s=60))
        out = {"capacity_req_s": cap, **rep.to_dict(), "workers_after": after}
        path = os.environ.get("PDSERVE_SOAK_OUT") or tmp_path / "soak.json"
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        assert set(rep.codes) == {"OK"}, rep.codes
        assert all(d < 0.05 for d in rep.drift().values()), rep.drift()  # growth: a leak
        assert all(v["used"] == 0 and v["stranded"] == 0 for v in after.values()), after
