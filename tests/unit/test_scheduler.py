"""Scheduler: token budget, chunked prefill, FIFO admission, running cap, preemption, abort.
No model: tokens are 'sampled' by the test."""
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import FinishReason, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus
from pdcore.block_hash import BlockHasher

BS = 4


def make(num_blocks=16, budget=8, max_seqs=4):
    bm = BlockManager(num_blocks, BS, BlockHasher("t", "m", BS))
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=256), bm), bm


def seq(rid, n, start=0):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=8))


def step(s, token=7):
    out = s.schedule()
    s.update(out, {it.seq.request_id: token for it in out.scheduled if it.samples})
    return [(it.seq.request_id, it.num_new_tokens) for it in out.scheduled], out


def test_chunked_prefill_and_mixing_with_decode():
    s, bm = make(budget=8)
    s.add(seq("a", 3))
    assert step(s)[0] == [("a", 3)]  # prefill done, token sampled
    s.add(seq("b", 20, start=100))
    # a decodes 1 token; b gets the remaining 7 of the budget (a chunk)
    assert step(s)[0] == [("a", 1), ("b", 7)]
    assert s.requests["b"].num_computed_tokens == 7 and s.requests["b"].num_output_tokens == 0
    assert step(s)[0] == [("a", 1), ("b", 7)]
    assert step(s)[0] == [("a", 1), ("b", 6)]  # last chunk samples
    assert s.requests["b"].num_output_tokens == 1
    assert step(s)[0] == [("a", 1), ("b", 1)]


def test_fifo_and_running_cap():
    s, _ = make(budget=100, max_seqs=2)
    for r in "abc":
        s.add(seq(r, 2, start=ord(r) * 10))
    assert [r for r, _ in step(s)[0]] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"]
    s.finish(s.requests["a"], FinishReason.STOP)
    assert [r for r, _ in step(s)[0]] == ["b", "c"]


def test_preemption_newest_first_and_recompute():
    s, bm = make(num_blocks=4, budget=64)
    s.add(seq("a", 7))  # 2 blocks
    s.add(seq("b", 7, start=50))  # 2 blocks -> cache full
    step(s)
    assert step(s)[0] == [("a", 1), ("b", 1)]  # the 8th token still fits in 2 blocks
    assert bm.num_free_blocks == 0
    # both now hold 9 tokens; a's next step needs a third block: b (newest) is preempted
    sched, out = step(s)
    assert out.preempted == ["b"]
    assert sched == [("a", 1)]
    b = s.requests["b"]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_tokens == 9  # keeps its generated token; it is recomputed, not resampled
    s.finish(s.requests["a"], FinishReason.STOP)
    sched, _ = step(s)
    # b's head block survived in the prefix cache (its tail block was evicted for a)
    assert sched == [("b", 5)] and b.num_cached_tokens == 4


def test_abort_frees_blocks_at_once():
    s, bm = make(budget=64)
    s.add(seq("a", 9))
    step(s)
    assert bm.num_free_blocks == 16 - 3
    s.abort("a")
    assert bm.num_free_blocks == 16
    assert "a" not in s.requests and not s.running


def test_hold_and_release():
    s, bm = make(budget=64)
    s.add(seq("a", 9))
    step(s)
    s.finish(s.requests["a"], FinishReason.LENGTH, hold=True)
    assert bm.num_free_blocks == 13 and not s.running
    assert s.release("a")
    assert bm.num_free_blocks == 16
    assert not s.release("a")


def test_prefix_hit_counts_only_new_tokens():
    s, bm = make(budget=64)
    s.add(seq("a", 13))
    step(s)
    s.finish(s.requests["a"], FinishReason.STOP)
    s.add(seq("b", 14))  # shares the first 12 tokens (3 blocks)
    sched, _ = step(s)
    assert sched == [("b", 2)]
    assert s.requests["b"].num_cached_tokens == 12


def test_waiting_request_does_not_hold_its_cached_prefix():
    """A waiting request whose cached prefix is attached but whose remaining tokens do not
    fit gives the prefix blocks back: otherwise two requests that each hold part of a full
    cache wait for each other forever (seen with a preempted prefill, whose first chunks
    were still cached, and the running request that had preempted it)."""
    s, bm = make(num_blocks=8, budget=64)
    shared = list(range(100, 116))  # 4 full blocks
    a = Sequence("a", shared + [1], SamplingParams(max_tokens=8))
    s.add(a)
    step(s)
    bm.cache_full_blocks(a)
    s.finish(a, FinishReason.LENGTH)  # its 4 prefix blocks stay cached (evictable)
    big = Sequence("big", list(range(200, 208)), SamplingParams(max_tokens=12))  # 2 -> 5 blocks
    s.add(big)
    step(s)  # 2 blocks: 4 evictable cached blocks remain free
    queries, hits = bm.prefix_queries_tokens, bm.prefix_hit_tokens
    b = Sequence("b", shared + list(range(300, 312)), SamplingParams(max_tokens=2))
    s.add(b)  # 4 cached blocks + 3 more: 7 of 8, cannot fit beside "big"
    step(s)
    assert b.status is SeqStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0
    assert (bm.prefix_queries_tokens, bm.prefix_hit_tokens) == (queries, hits)
    for _ in range(40):  # "big" grows to 5 blocks and finishes, then "b" runs
        step(s)
        if big.status is SeqStatus.RUNNING and big.num_tokens >= 20:
            assert len(big.block_table) == 5  # never preempted: it got its blocks
            s.finish(big, FinishReason.LENGTH)
        if b.status is not SeqStatus.WAITING:
            break
    assert big.status is SeqStatus.FINISHED and big.num_preemptions == 0
    assert b.status is SeqStatus.RUNNING and len(b.block_table) == 7


def test_short_first_admits_the_fewest_tokens_left_unless_one_waited_too_long():
    import pytest

    def admitted(policy, aged=()):
        bm = BlockManager(64, BS, BlockHasher("t", "m", BS))
        s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                      max_model_len=256, schedule_policy=policy,
                                      schedule_max_wait_s=1.0), bm)
        for rid, n in (("long", 40), ("mid", 12), ("short", 5)):
            q = seq(rid, n, start=len(s.requests) * 100)
            if rid in aged:
                q.arrival_time -= 5.0
            s.add(q)
        order = []
        while s.has_work:  # one running at a time: each finishes after its prefill
            (rid, _), = step(s)[0]
            order.append(rid)
            s.finish(s.requests[rid], FinishReason.STOP)
        return order

    assert admitted("fcfs") == ["long", "mid", "short"]
    assert admitted("short_first") == ["short", "mid", "long"]
    # the long prompt waited past max_wait_s: it goes first, then the rest by size
    assert admitted("short_first", aged=("long",)) == ["long", "short", "mid"]
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(schedule_policy="lifo")


def test_short_first_resumes_a_preempted_request_first():
    bm = BlockManager(4, BS, BlockHasher("t", "m", BS))
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  schedule_policy="short_first"), bm)
    s.add(seq("a", 7))
    s.add(seq("b", 7, start=50))
    step(s)
    step(s)
    _, out = step(s)
    assert out.preempted == ["b"]
    s.add(seq("tiny", 1, start=90))  # shorter than b, but b was running before
    s.finish(s.requests["a"], FinishReason.STOP)
    assert [r for r, _ in step(s)[0]][0] == "b"
