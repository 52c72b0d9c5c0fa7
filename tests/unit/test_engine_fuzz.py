"""Random engine operations in every role, with the block accounting checked after each one.

Colocated requests, prefill-role requests (HELD until released), decode-role pre-allocations
(AWAITING_KV, then committed), aborts at any time, few blocks (so requests are preempted and
pre-allocations refused), greedy and sampled, with and without async_decode. After every
operation: each block's reference count equals the number of live block tables holding it
(plus the blocks held back while a launched step may write), and free + referenced = total.
At the end every block is free and no request is left.
"""
from __future__ import annotations

from collections import Counter
import random

import pytest

from engine import LLM, SamplingParams
from engine.sequence import SeqStatus


def check(eng):
    bm = eng.block_manager
    refs = Counter()
    for seq in eng.scheduler.requests.values():
        if seq.status is not SeqStatus.FINISHED:
            refs.update(seq.block_table)
    held = Counter(bm.held_blocks)
    for blk in bm.blocks:
        want = refs[blk.block_id] + held[blk.block_id]
        assert blk.ref_count == want, (blk.block_id, blk.ref_count, want)
        assert (blk.ref_count == 0) == (blk.block_id in bm.free), blk.block_id
    assert bm.num_free_blocks + sum(1 for b in bm.blocks if b.ref_count) == bm.num_blocks


@pytest.mark.parametrize("seed,async_decode", [(0, False), (1, True), (2, True), (3, False)])
def test_random_operations_keep_the_block_accounting_exact(seed, async_decode):
    random_operations(seed, async_decode=async_decode)


def random_operations(seed: int, **engine_kw):
    """The run above; the GPU tests reuse it with CUDA graphs (tests/gpu). Returns the
    engine, drained."""
    llm = LLM("dummy:tiny", **{"block_size": 4, "num_blocks": 48, "max_num_seqs": 6,
                               "max_num_batched_tokens": 24, **engine_kw})
    eng = llm.engine
    async_decode = eng.config.async_decode
    rng = random.Random(seed)
    held, awaiting, live = set(), set(), set()

    def sp():
        return SamplingParams(max_tokens=rng.randrange(1, 25), ignore_eos=True,
                              temperature=rng.choice([0, 0, 0.8]))

    def prompt():
        base = rng.choice([[7, 8, 9, 10, 11, 12, 13, 14], []])  # shared prefix sometimes
        return base + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]

    for i in range(700):
        r = rng.random()
        if r < 0.10:
            eng.add_request(f"c{i}", prompt(), sp())
            live.add(f"c{i}")
        elif r < 0.15:
            eng.add_request(f"p{i}", prompt(), sp(), prefill_only=True)
            live.add(f"p{i}")
        elif r < 0.20:
            if eng.preallocate(f"d{i}", prompt(), sp()) is not None:
                awaiting.add(f"d{i}")
        elif r < 0.25 and awaiting:
            rid = rng.choice(sorted(awaiting))
            awaiting.discard(rid)
            if not eng.commit_transferred(rid, rng.randrange(3, 500)).finished:
                live.add(rid)
        elif r < 0.30 and (live or held or awaiting):
            rid = rng.choice(sorted(live | held | awaiting))
            eng.abort(rid)
            live.discard(rid), held.discard(rid), awaiting.discard(rid)
        elif r < 0.34 and held:
            rid = rng.choice(sorted(held))
            assert eng.release(rid)
            held.discard(rid)
        elif eng.has_work:
            for out in eng.step():
                if out.finished and out.request_id in live:
                    live.discard(out.request_id)
                    if out.request_id.startswith("p"):
                        held.add(out.request_id)
        check(eng)
    for rid in sorted(held | awaiting):
        eng.abort(rid)
    n = 0
    while eng.has_work:
        for out in eng.step():  # a prefill-role request still running at the drain ends
            if out.finished and out.request_id.startswith("p"):  # HELD: its caller
                eng.release(out.request_id)  # releases it once its transfer is done
        check(eng)
        n += 1
        assert n < 5000, "the engine does not drain"
    assert not eng.scheduler.requests
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.num_preemptions > 0  # the run did squeeze the cache
    if async_decode:
        assert eng.chained_steps > 0
    return eng
