"""Block manager: exact block ids, reference counts, prefix hits and eviction order."""
import pytest

from engine.block_manager import BlockManager
from engine.request import SamplingParams
from engine.sequence import Sequence
from pdcore.block_hash import BlockHasher

BS = 4


def make_bm(n=8, caching=True):
    return BlockManager(n, BS, BlockHasher("t", "m", BS), caching)


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def run_prompt(bm, s):
    """Allocate and 'compute' a whole prompt, like a scheduler step followed by an update."""
    bm.allocate_cached_prefix(s)
    assert bm.allocate_slots(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocation_exact_ids_and_free_order():
    bm = make_bm()
    a = seq(range(10))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free_seq(a)
    assert bm.num_free_blocks == 8
    # freed tail first: next allocations reuse 3..7 first (never used), then 2, 1, 0; the
    # blocks of one allocation come in ascending order
    b = seq(range(100, 132), "b")
    assert bm.allocate_slots(b, 20)
    assert b.block_table == [3, 4, 5, 6, 7]
    b.num_computed_tokens = 20
    assert bm.allocate_slots(b, 4) and b.block_table[-1] == 2
    b.num_computed_tokens = 24
    assert bm.allocate_slots(b, 8) and b.block_table[-2:] == [0, 1]
    assert not bm.allocate_slots(seq(range(4), "c"), 4)


def test_prefix_hit_computes_only_new_tokens():
    bm = make_bm()
    a = seq(list(range(12)) + [50], "a")  # 3 full blocks + 1 token
    run_prompt(bm, a)
    assert a.block_table == [0, 1, 2, 3]
    ev = bm.drain_events()
    assert len(ev.stored) == 3 and ev.removed == []
    b = seq(list(range(12)) + [60, 61], "b")
    hit = bm.allocate_cached_prefix(b)
    assert hit == 12 and b.num_computed_tokens == 12
    assert b.block_table == [0, 1, 2]  # shared, not copied
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 2, 1]
    assert bm.allocate_slots(b, 2)
    assert b.block_table == [0, 1, 2, 4]


def test_full_prompt_hit_leaves_last_token_to_compute():
    bm = make_bm()
    a = seq(range(8), "a")
    run_prompt(bm, a)
    b = seq(range(8), "b")
    assert bm.allocate_cached_prefix(b) == 4  # not 8: the last token's logits are needed
    assert b.block_table == [0]


def test_hit_confirmed_by_token_ids_not_hash_alone():
    bm = make_bm()
    a = seq(range(8), "a")
    run_prompt(bm, a)
    # corrupt the stored tokens: a hash match without a token match must miss
    bm.blocks[0].token_ids = (9, 9, 9, 9)
    b = seq(range(9), "b")
    assert bm.allocate_cached_prefix(b) == 0


def test_freed_cached_blocks_hit_until_evicted_lru():
    bm = make_bm(n=4)
    a = seq(range(8), "a")
    run_prompt(bm, a)  # blocks 0,1 cached
    bm.free_seq(a)
    bm.drain_events()
    b = seq(range(9), "b")
    assert bm.allocate_cached_prefix(b) == 8  # both blocks hit while free
    bm.free_seq(b)
    # a different prompt needing 3 blocks: uses never-used blocks 2,3 first, then evicts the
    # tail block of the freed prefix (block 1) before its head (block 0)
    c = seq(range(100, 112), "c")
    assert bm.allocate_slots(c, 12)
    assert c.block_table == [1, 2, 3]  # ascending within one allocation
    ev = bm.drain_events()
    assert len(ev.removed) == 1
    d = seq(range(9), "d")
    assert bm.allocate_cached_prefix(d) == 4  # block 0 still cached


def test_caching_off():
    bm = make_bm(caching=False)
    a = seq(range(8), "a")
    run_prompt(bm, a)
    assert bm.allocate_cached_prefix(seq(range(9), "b")) == 0
    assert bm.drain_events().stored == []


def test_double_free_raises():
    bm = make_bm()
    a = seq(range(4), "a")
    bm.allocate_slots(a, 4)
    table = list(a.block_table)
    bm.free_seq(a)
    a.block_table = table
    with pytest.raises(RuntimeError):
        bm.free_seq(a)


def test_reset_prefix_cache_reports_removed():
    bm = make_bm()
    a = seq(range(8), "a")
    run_prompt(bm, a)
    bm.free_seq(a)
    bm.drain_events()
    bm.reset_prefix_cache()
    assert len(bm.drain_events().removed) == 2
    assert bm.allocate_cached_prefix(seq(range(9), "b")) == 0


def test_decode_steps_register_each_block_once_as_it_fills():
    """Token by token, as decode does: a block is registered (one `stored` event) the step it
    becomes full, earlier blocks are not looked at again, and a freed-then-rescheduled
    sequence starts over."""
    bm = make_bm(n=16)
    s = seq(range(5))
    run_prompt(bm, s)
    assert len(bm.drain_events().stored) == 1  # tokens 0-3
    for t in range(5, 5 + 4 * 3):
        s.token_ids.append(100 + t)
        assert bm.allocate_slots(s, 1)
        s.num_computed_tokens += 1
        bm.cache_full_blocks(s)
        ev = bm.drain_events().stored
        assert len(ev) == (1 if s.num_computed_tokens % BS == 0 else 0), t
    assert s.num_hashed_blocks == s.num_computed_tokens // BS == 4
    bm.free_seq(s)
    assert s.num_hashed_blocks == 0
    again = seq(s.token_ids, rid="again")
    hits = bm.prefix_hit_tokens
    run_prompt(bm, again)  # its 4 full blocks are hits; the 17th token is computed
    assert bm.prefix_hit_tokens - hits == 16 and again.num_computed_tokens == 17
    assert again.num_hashed_blocks == 4


def _fragmented(n_blocks: int, order: list[int]) -> BlockManager:
    """A manager whose free queue (eviction order) is ``order``, every block cached."""
    from collections import OrderedDict

    bm = BlockManager(n_blocks, BS, BlockHasher("t", "m", BS))
    for bid in order:
        blk = bm.blocks[bid]
        blk.block_hash, blk.token_ids = bid.to_bytes(8, "little"), (bid,) * BS
        bm.hash_to_block[blk.block_hash] = bid
    bm.free = OrderedDict((bid, None) for bid in order)
    return bm


def test_large_allocations_take_whole_runs_from_the_oldest_free_blocks():
    """A cache used through hands out its free blocks interleaved (here: two runs freed in
    turns, tail first). An allocation of >= RUN_MIN_BLOCKS blocks takes whole runs of
    consecutive ids from the RUN_WINDOW x n oldest free blocks, the longest first, and hands
    them out ascending; every block it evicts is reported, the others stay cached."""
    from engine import block_manager as mod
    from kvtransfer.blocks import segments

    n = mod.RUN_MIN_BLOCKS
    interleaved = [x for pair in zip(range(2 * n - 1, n - 1, -1), range(n - 1, -1, -1))
                   for x in pair]  # 2n-1, n-1, 2n-2, n-2, ...: strict order gives no runs
    young = list(range(2 * n, 2 * n + 8 * n))  # freed later, one long run
    bm = _fragmented(10 * n, interleaved + young)
    got = bm.allocate_blocks(n)
    assert got == sorted(got) and len(segments(got, got)) == 1
    assert set(got) <= set(interleaved)  # within the oldest RUN_WINDOW * n
    assert got in (list(range(n)), list(range(n, 2 * n)))
    ev = bm.drain_events()
    assert sorted(int.from_bytes(h, "little") for h in ev.removed) == got
    assert all(bm.blocks[b].block_hash is not None for b in bm.free)
    assert bm.num_free_blocks == 9 * n

    # a run of the window longer than needed: only its head is taken
    bm = _fragmented(10 * n, list(range(3 * n, 0, -1)) + [0])
    got = bm.allocate_blocks(n)
    assert got == list(range(0, n))

    # small allocations keep strict eviction order
    bm = _fragmented(10 * n, interleaved + young)
    assert bm.allocate_blocks(2) == sorted(interleaved[:2])


def test_transfers_of_a_used_through_cache_move_few_pieces():
    """bench/kv_block_runs.py's replay of the 1P1D mix through two real managers, at a small
    scale: after both caches wrapped, a 4096-token prompt's transfer is a few large pieces
    (taking blocks in strict eviction order: ~216 pieces of ~1.2 blocks)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from kv_block_runs import parse_args, simulate, summarize

    a = parse_args(["--rate", "12", "--duration", "50", "--settle", "25",
                    "--prefill-blocks", "6144", "--decode-blocks", "12288"])
    res = simulate(a)
    summary = summarize(res["transfers"], a.settle)["long_prompts"]
    assert res["refused"] == 0 and summary["transfers"] > 50
    assert summary["segments_mean"] < 24 and summary["blocks_per_segment"] > 10, summary
