"""Drive an engine step by step while requests arrive mid-run (closed-loop serving in
miniature): the CPU and GPU tests of admission into steps launched ahead share it."""
from __future__ import annotations


def run_with_arrivals(eng, late: list[tuple]) -> dict[str, list[int]]:
    """Step ``eng`` until it is idle and ``late`` is empty; each of ``late`` (step, request
    id, prompt, SamplingParams), in step order, is added before that step. Returns each
    request's tokens and checks that every KV block is back in the pool."""
    late = list(late)
    outs: dict[str, list[int]] = {}
    step = 0
    while eng.has_work or late:
        while late and late[0][0] <= step:
            _, rid, prompt, sp = late.pop(0)
            eng.add_request(rid, prompt, sp)
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        step += 1
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.held_blocks
    return outs
