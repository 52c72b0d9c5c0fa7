"""Corrupted KV is never decoded: real worker processes, real sockets, fault injection.

The prefill worker flips a byte of every second transfer it sends on each backend
(``PDSERVE_KV_CORRUPT_EVERY=2``, kvtransfer's fault injection); the decode worker's per-block
checksums fail those transfers, it retries on its next backend, and when that one is damaged
too it prefills locally. Every request still returns the engine's greedy tokens.
"""
from __future__ import annotations

import time

from engine import LLM, SamplingParams
from pdserve import client
from pdserve.cluster import LocalCluster
from tests.integration.helpers import gen_many, run, scrape


def test_corrupted_transfers_are_retried_or_prefilled_locally_never_decoded():
    prompts = [[10 + (i * 37 + j * 11) % 200 for j in range(100 + 7 * i)] for i in range(4)]
    ref = LLM("dummy:tiny").generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                             ignore_eos=True))
    def received(metrics, state):
        key = (("direction", "received"), ("state", state))
        return metrics.get(("pdserve_kv_transfers_total", key), 0)

    with LocalCluster("dummy:tiny", prefill=1, decode=1, metrics=True,
                      worker_args=("--kv-backend", "tcp,shm"),
                      env={"PDSERVE_KV_CORRUPT_EVERY": "2"}) as c:
        reqs = [client.make_request(token_ids=p, max_tokens=8, ignore_eos=True)
                for p in prompts]
        outs = run(gen_many(c.address, reqs))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        dec = next(w for w in c.workers if w.kind == "decode")
        deadline = time.monotonic() + 5
        while True:  # tcp: 4 transfers, 2 damaged -> 2 retries on shm, 1 of them damaged
            m = scrape(dec.metrics_port)
            done, failed = received(m, "done"), received(m, "failed")
            if (done, failed) == (3, 3) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert (done, failed) == (3, 3), (done, failed)
    served = {kind: m.get(("pdserve_worker_requests_total", (("kind", kind), ("outcome", "ok"))))
              for kind in ("decode_remote", "decode_local")}
    assert served == {"decode_remote": 3, "decode_local": 1}, served
