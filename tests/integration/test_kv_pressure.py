"""A decode worker whose KV cache cannot hold every request the gateway sends it: requests
wait for blocks (as a colocated engine queues them) instead of failing.

On one 80 GB GPU, 1P1D at concurrency 512 (each worker a share of the card) failed 406 of
1000 requests with RESOURCE_EXHAUSTED "decode worker has no free KV blocks for this prompt"
(2026-12-06); the decode worker now waits for running requests to free blocks, in arrival
order, bounded by kv_blocks_wait_s (docs/configuration.md)."""
from __future__ import annotations

import time

from pdserve import client
from pdserve.cluster import LocalCluster
from tests.integration.helpers import gen_many, run, worker_stats


def test_requests_beyond_the_decode_kv_cache_wait_for_blocks_and_all_complete():
    # decode: 24 blocks of 16 tokens; each request needs 4-5 (50-token prompt + 24 tokens),
    # so at most ~5 fit while 16 arrive at once
    with LocalCluster("dummy:tiny", prefill=1, decode=1, secure=False,
                      role_args={"decode": ("--num-blocks", "24")}) as c:
        reqs = [client.make_request(f"request {i:02d}: " + "x" * 38, max_tokens=24,
                                    temperature=0.0, ignore_eos=True) for i in range(16)]
        outs = run(gen_many(c.address, reqs, timeout=120))
        assert [o.completion_tokens for o in outs] == [24] * 16
        decode = next(w for w in c.workers if w.kind == "decode")
        deadline = time.monotonic() + 10
        while True:  # every block free again once the last stream ended
            st = run(worker_stats(decode.address))
            if st.kv_blocks_free == st.kv_blocks_total or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert st.kv_blocks_total == 24
        assert st.kv_blocks_free == 24 and st.kv_blocks_stranded == 0
