"""async_decode: the next decode step is launched before this step's tokens are read.

On the CPU the launch is synchronous (no speed-up), but the engine logic is the same as on
the GPU: which steps may run ahead, dropping rows whose request ended meanwhile, and keeping
freed blocks out of the pool while a launched step may still write into them."""
from __future__ import annotations

import pytest

from engine import LLM, Constraint, SamplingParams
from engine.request import FinishReason
from tests.arrivals import run_with_arrivals


def _llm(**kw):
    return LLM("dummy:tiny", **{"block_size": 4, "num_blocks": 256, "max_num_seqs": 8, **kw})


@pytest.fixture(scope="module")
def pair():
    return _llm(), _llm(async_decode=True)


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


def test_same_tokens_as_stepping_in_lockstep(pair):
    sync, ahead = pair
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (1, 2, 3, 9, 17)]
    prompts = [[3, 4, 5], list(range(10, 31)), [7] * 9, [40, 41], list(range(50, 63))]
    before = ahead.engine.chained_steps
    assert _run(ahead, prompts, greedy) == _run(sync, prompts, greedy)
    assert ahead.engine.chained_steps - before >= 8  # the tail of the 17-token request chains
    assert sync.engine.chained_steps == 0
    bm = ahead.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not ahead.engine.has_work


def test_stop_tokens_mid_chain_drop_the_extra_row(pair):
    sync, ahead = pair
    p = [21, 22, 23]
    free = sync.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = free.token_ids[6]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop,))
    other = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [p, [30, 31, 32, 33]]
    got = _run(ahead, prompts, [sp, other])
    assert got == _run(sync, prompts, [sp, other])
    assert got[0][1] is FinishReason.STOP and got[0][0][-1] == stop
    assert len(got[0][0]) == free.token_ids.index(stop) + 1


def test_sampled_rows_and_logprobs_chain_with_lockstep_tokens(pair):
    """Sampled rows (seeded), logprobs and top logprobs chain too: such a step is sampled
    once the step before it is read (pending), so each seeded request's random stream and
    every logprob are lockstep's; greedy rows beside them keep theirs."""
    sync, ahead = pair
    sps = [SamplingParams(max_tokens=14, temperature=0.8, seed=3, ignore_eos=True),
           SamplingParams(max_tokens=9, temperature=0, logprobs=True, top_logprobs=3,
                          ignore_eos=True),
           SamplingParams(max_tokens=12, temperature=1.1, top_p=0.9, seed=11, logprobs=True,
                          ignore_eos=True),
           SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
           SamplingParams(max_tokens=6, temperature=0.7, seed=5, n=2, ignore_eos=True)]
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], list(range(20, 31)), [40, 41, 42]]

    def run(llm):
        outs = llm.generate(prompts, sps)
        return [(o.token_ids, o.logprobs, o.top_logprobs,
                 [s.token_ids for s in o.samples or []]) for o in outs]

    before = ahead.engine.chained_steps
    want, got = run(sync), run(ahead)
    assert ahead.engine.chained_steps - before >= 10
    for (t1, l1, p1, s1), (t2, l2, p2, s2) in zip(want, got):
        assert t1 == t2 and s1 == s2
        assert (l1 is None) == (l2 is None) and (p1 is None) == (p2 is None)
        if l1 is not None:
            assert max(abs(x - y) for x, y in zip(l1, l2)) < 1e-5
        if p1 is not None:
            assert [[t for t, _ in row] for row in p1] == [[t for t, _ in row] for row in p2]


def test_greedy_rows_with_processed_logits_chain_with_lockstep_tokens(pair):
    """Greedy rows whose logits are processed (a grammar's mask, penalties, logit_bias,
    min_tokens) chain too (issue 25: a constrained row used to stop the chain for its whole
    batch): the launched step is sampled once the step before it is read, so a mask follows
    the token its matcher just consumed, and a row its grammar ends mid-chain is dropped."""
    sync, ahead = pair
    words = Constraint("regex", "[a-z]{2,5}( [a-z]{2,5}){1,2}\\.")
    digits = Constraint("regex", "[0-9]{40,60}")
    sps = [SamplingParams(max_tokens=30, temperature=0, constraint=words),
           SamplingParams(max_tokens=22, temperature=0, ignore_eos=True, constraint=digits),
           SamplingParams(max_tokens=14, temperature=0, ignore_eos=True,
                          repetition_penalty=1.5, presence_penalty=0.7),
           SamplingParams(max_tokens=12, temperature=0, min_tokens=9, logit_bias=((65, 3.0),)),
           SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)]
    prompts = [[3, 4, 5], [9, 8, 7, 6], [11, 12], [40, 41, 42], [60, 61]]
    before = ahead.engine.chained_steps
    got = _run(ahead, prompts, sps)
    assert got == _run(sync, prompts, sps)
    assert got[0][1] is FinishReason.STOP and got[0][2].endswith(".")  # the grammar ended it
    assert got[1][2].isdigit() and len(got[1][0]) == 22
    assert ahead.engine.chained_steps - before >= 15
    bm = ahead.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not ahead.engine.has_work


def test_abort_while_a_step_is_in_flight_holds_its_blocks_until_read():
    llm = _llm(async_decode=True)
    eng, bm = llm.engine, llm.engine.block_manager
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    eng.add_request("a", list(range(3, 12)), sp)
    eng.add_request("b", list(range(20, 27)), sp)
    outs = {"a": [], "b": []}
    while eng._ahead is None:
        for o in eng.step():
            outs[o.request_id] += o.token_ids
    free_before = bm.num_free_blocks
    a_blocks = set(eng.scheduler.requests["a"].block_table)
    held = len(a_blocks)
    assert eng.abort("a")
    # "a"'s blocks may still be written by the launched step: not free yet
    assert bm.num_free_blocks == free_before
    # a decode worker's pre-allocation meanwhile cannot get them
    assert eng.preallocate("c", list(range(40, 44)), sp) is not None
    assert not set(eng.scheduler.requests["c"].block_table) & a_blocks
    assert eng.abort("c")
    while eng.has_work:
        for o in eng.step():
            assert o.request_id == "b"
            outs["b"] += o.token_ids
    assert bm.num_free_blocks == bm.num_blocks and held > 0
    solo = _llm().generate([list(range(20, 27))], sp)[0].token_ids
    assert outs["b"] == solo


def _arrivals(async_decode: bool, late: list[tuple], **kw) -> tuple[dict, object]:
    """One request decoding; each of ``late`` (step, id, prompt, params) added before that
    step: a request arriving while steps are launched ahead, as in closed-loop serving."""
    eng = _llm(async_decode=async_decode, **kw).engine
    eng.add_request("a", [3, 4, 5], SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True))
    return run_with_arrivals(eng, late), eng


def test_arriving_requests_join_the_chain_with_lockstep_tokens():
    """A waiting request whose whole prompt fits the step is admitted into the step launched
    ahead (Scheduler.admit_ahead): the chain does not break for it, its first decode step
    is chained too, and every token equals stepping in lockstep. Arrivals: one, then two
    at once, one whose prompt is in the prefix cache, one with a single new token."""
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def late():
        return [(3, "b", [8, 9, 10, 11], sp), (6, "c", list(range(20, 33)), sp),
                (6, "d", [40, 41, 42], sp), (9, "e", list(range(20, 33)) + [7], sp),
                (12, "f", [50], sp)]

    want, _ = _arrivals(False, late())
    got, eng = _arrivals(True, late())
    assert got == want and all(len(v) == 10 for k, v in got.items() if k != "a")
    assert eng.steps - eng.chained_steps <= 2  # the first prefill and its first decode
    assert eng.block_manager.prefix_hit_tokens > 0  # "e" hit "c"'s blocks


def test_a_prompt_that_needs_chunks_stops_the_chain_and_a_sampled_one_joins_it():
    """A prompt longer than the step's token budget is chunked by a scheduled step: it waits
    for the chain to end and is scheduled next. A sampled (seeded) arrival is admitted
    ahead like a greedy one. Tokens equal lockstep's, the seeded sample's too."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)

    def late():
        return [(3, "long", list(range(60, 90)), greedy), (12, "s", [9, 9, 9], seeded)]

    want, _ = _arrivals(False, late(), max_num_batched_tokens=16)
    got, eng = _arrivals(True, late(), max_num_batched_tokens=16)
    assert got == want
    # the first prefill and the long prompt's chunks (and the step after them) in lockstep
    assert 2 <= eng.steps - eng.chained_steps <= 4


def _transfer_and_decode(async_decode: bool, n_steps_before: int):
    """A decode-role engine running one request when a second one's prompt KV "lands"
    (copied from a prefill-role engine with the same weights) and is committed mid-run."""
    pre = _llm()
    dec = _llm(async_decode=async_decode)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    dec.engine.add_request("a", [3, 4, 5, 6, 7], sp)
    for _ in range(n_steps_before):
        dec.engine.step()
    prompt = list(range(20, 33))
    pre.engine.add_request("x", prompt, sp, prefill_only=True)
    first = []
    while not first:
        first = pre.engine.step()
    src = first[0].held_block_ids
    dst = dec.engine.preallocate("x", prompt, sp)
    dec.engine.runner.kv_cache[dst] = pre.engine.runner.kv_cache[src]
    chained_before = dec.engine.chained_steps
    outs = {"x": list(first[0].token_ids)}
    out = dec.engine.commit_transferred("x", first[0].token_ids[0])
    assert out.token_ids == first[0].token_ids
    outs.setdefault("a", [])
    if async_decode:  # the step launched before the join is read; the next one has "x" too
        assert dec.engine._ahead is not None
        for o in dec.engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        ahead = dec.engine._ahead
        assert ahead is not None and ahead.chained
        assert [i.seq.request_id for i in ahead.sched.scheduled] == ["a", "x"]
    while dec.engine.has_work:
        for o in dec.engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    bm = dec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return outs, dec.engine.chained_steps - chained_before


def test_a_transferred_request_joins_the_chain_with_the_same_tokens():
    """Decode role: a request whose KV arrived joins while a step is launched ahead; the
    next step is launched ahead with it appended (no lockstep step for the join), and
    every token equals stepping in lockstep."""
    for before in (2, 4):
        want, _ = _transfer_and_decode(False, before)
        got, chained = _transfer_and_decode(True, before)
        assert got == want
        assert chained >= 8  # the join did not end the chain
        assert len(want["x"]) == 12 and len(want["a"]) >= 12 - before


def test_requests_ending_do_not_end_the_chain(pair):
    """Rows of requests that reached their length limit (or EOS) are left out of the next
    step launched ahead; every decode step after the first is launched ahead, and the
    tokens are lockstep's."""
    sync, ahead = pair
    sp = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 7, 12)]
    prompts = [[3, 4, 5], [9, 8, 7, 6], [11, 12]]
    eng = ahead.engine
    steps, chained = eng.steps, eng.chained_steps
    assert _run(ahead, prompts, sp) == _run(sync, prompts, sp)
    # a prefill step, then 11 launched ahead, the first right after the whole prompts (a
    # request whose last token the step before computes gets no row)
    assert (eng.steps - steps, eng.chained_steps - chained) == (12, 11)


def test_a_chain_that_never_breaks_does_not_keep_freed_blocks():
    """Decode role under steady load: a request joins every step and another ends, so the
    chain of steps launched ahead never breaks. Blocks freed while a step was in flight
    must return to the pool once that step is read (two steps later at most), not when the
    chain ends: here the held blocks stay under a few requests' worth."""
    eng = _llm(async_decode=True).engine
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    eng.add_request("seed", prompt, SamplingParams(max_tokens=80, temperature=0,
                                                   ignore_eos=True))
    eng.step()
    eng.step()
    most_held = 0
    for i in range(60):
        ids = eng.preallocate(f"j{i}", prompt, sp)
        assert ids is not None
        eng.commit_transferred(f"j{i}", 3)
        eng.step()
        most_held = max(most_held, len(eng.block_manager.held_blocks))
    assert eng.chained_steps >= 55  # joins and ends did not break the chain
    assert most_held <= 3 * 3  # blocks of the requests that ended in the last two steps
    while eng.has_work:
        eng.step()
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.held_blocks


def test_a_chunked_prefill_with_one_token_to_make_is_not_left_behind():
    """A request still in chunked prefill whose only token its last chunk will sample
    (max_tokens=1) is not a row that "ends in the previous step": while its chunks remain,
    no decode step is launched ahead without it (its next chunk waits for a schedule)."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=8, async_decode=True)
    eng = llm.engine
    eng.add_request("long", list(range(3, 60)),
                    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    while eng.scheduler.requests["long"].num_output_tokens < 2:
        eng.step()
    eng.add_request("one", list(range(100, 130)), SamplingParams(max_tokens=1, temperature=0))
    done = None
    for _ in range(30):
        for out in eng.step():
            if out.request_id == "one" and out.finished:
                done = out
        if done is not None:
            break
        one = eng.scheduler.requests["one"]
        if one.num_computed_tokens < one.num_tokens:  # still in prefill: nothing ahead
            assert eng._ahead is None, [i.seq.request_id for i in eng._ahead.sched.scheduled]
    assert done is not None and len(done.token_ids) == 1
    while eng.has_work:
        eng.step()


@pytest.mark.parametrize("async_decode", [False, True])
def test_landed_kv_waits_for_a_seat(async_decode):
    """A decode worker's transferred prompts never run more than max_num_seqs at once: the
    ones past the cap wait READY (holding their landed blocks, counted as waiting) and take
    seats as running requests end, before any waiting prompt; an abort of a READY request
    frees its blocks; every request's tokens equal a lone run's."""
    from engine.sequence import SeqStatus
    pre = _llm()
    dec = _llm(async_decode=async_decode, max_num_seqs=2)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": list(range(20 + i, 33 + i)) for i in range(5)}
    outs: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        pre.engine.add_request(rid, prompt, sp, prefill_only=True)
        first = []
        while not first:
            first = pre.engine.step()
        dst = dec.engine.preallocate(rid, prompt, sp)
        dec.engine.runner.kv_cache[dst] = pre.engine.runner.kv_cache[first[0].held_block_ids]
        pre.engine.release(rid)
        outs[rid] = list(dec.engine.commit_transferred(rid, first[0].token_ids[0]).token_ids)
    sc = dec.engine.scheduler
    assert len(sc.running) == 2 and [s.request_id for s in sc.ready] == ["r2", "r3", "r4"]
    assert all(s.status is SeqStatus.READY for s in sc.ready)
    assert dec.engine.stats().num_waiting == 3
    r4_blocks = len(sc.requests["r4"].block_table)
    free = dec.engine.block_manager.num_free_blocks
    assert dec.engine.abort("r4")  # a READY request: its landed blocks go back
    assert dec.engine.block_manager.num_free_blocks == free + r4_blocks
    del prompts["r4"], outs["r4"]
    dec.engine.add_request("late", [7, 8, 9], sp)  # a new prompt queues behind READY ones
    outs["late"] = []
    most, order = 0, []
    while dec.engine.has_work:
        most = max(most, len(sc.running))
        for o in dec.engine.step():
            if not outs[o.request_id]:
                order.append(o.request_id)
            outs[o.request_id] += o.token_ids
        if dec.engine._ahead is not None:
            most = max(most, len(dec.engine._ahead.sched.scheduled))
    assert most <= 2
    assert order == ["late"]  # the only one without a first token before the loop
    bm = dec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for rid, prompt in {**prompts, "late": [7, 8, 9]}.items():
        assert outs[rid] == _llm().generate([prompt], sp)[0].token_ids, rid
