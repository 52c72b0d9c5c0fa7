"""The CUDA-graph paths' host side (engine.graph_inputs), checked on the
CPU: the per-request block-table rows and the static-input fills against the eager path's
inputs."""
from __future__ import annotations

import pytest


def test_block_table_rows_convert_only_new_blocks():
    import numpy as np

    from engine.graph_inputs import BlockTableRows
    rows = BlockTableRows(width=8)
    t = [5, 9]
    assert rows.get("a", t).tolist() == [5, 9]
    first = rows.get("a", t)
    t.append(2)  # the request grew a block
    got = rows.get("a", t)
    assert got.tolist() == [5, 9, 2] and np.shares_memory(got, first)
    t2 = [7]  # preempted and rescheduled: a new table, converted afresh
    assert rows.get("a", t2).tolist() == [7]
    assert rows.get("b", [1, 1, 1]).tolist() == [1, 1, 1] and len(rows) == 2
    rows.drop("a")
    assert len(rows) == 1
    with pytest.raises(ValueError, match="exceeds width"):
        rows.get("c", list(range(9)))


def test_graph_decode_inputs_match_the_eager_inputs():
    """fill_decode_inputs (the CUDA-graph path's host side) writes the same ids, positions,
    slots, lengths and tables as the eager path's prepare() for a decode step, and for a
    chained step the positions one further on (ids then come from the device)."""
    import numpy as np

    from engine.graph_inputs import BlockTableRows, fill_decode_inputs
    eng = _decoding_engine("r", steps=6, max_num_seqs=8)
    sched = eng.scheduler.schedule()
    assert all(item.num_new_tokens == 1 for item in sched.scheduled)
    n, b, width = len(sched.scheduled), 4, 16
    i64 = np.full((3, 8), 99, np.int64)
    lens = np.full(8, 99, np.int32)
    tables = np.full((8, width), 99, np.int32)
    rows = BlockTableRows(width)
    ids, pos, meta, sample_rows = eng.runner.prepare(sched)
    fill_decode_inputs(sched, b, 4, i64, lens, tables, rows)
    assert i64[0, :n].tolist() == ids.tolist() and i64[1, :n].tolist() == pos.tolist()
    assert i64[2, :n].tolist() == meta.slot_mapping.tolist()
    assert lens[:n].tolist() == meta.seq_lens.tolist()
    for i, item in enumerate(sched.scheduled):
        assert tables[i, :len(item.seq.block_table)].tolist() == item.seq.block_table
    assert i64[2, n:b].tolist() == [-1] * (b - n) and lens[n:b].tolist() == [0] * (b - n)
    assert (i64[:, b:] == 99).all()  # rows past the bucket untouched
    # chained: the next position (its block must exist, as the engine allocates it first)
    for item in sched.scheduled:
        assert eng.block_manager.allocate_slots(item.seq, 2)
        item.ahead = 1  # the step before (not read yet) computes one token of each
    fill_decode_inputs(sched, b, 4, i64, lens, tables, rows, chained=n)
    _, pos2, meta2, _ = eng.runner.prepare(sched, next_ids=[0] * n)
    assert i64[1, :n].tolist() == pos2.tolist() == (pos + 1).tolist()
    assert i64[2, :n].tolist() == meta2.slot_mapping.tolist()
    assert lens[:n].tolist() == meta2.seq_lens.tolist()
    assert i64[0, :n].tolist() == [0] * n  # left for the device copy
    # a sequence that joined since the chained rows' step: only the first n - 1 rows chain
    sched.scheduled[-1].ahead = 0
    fill_decode_inputs(sched, b, 4, i64, lens, tables, rows, chained=n - 1)
    ids3, pos3, meta3, _ = eng.runner.prepare(sched, next_ids=[0] * (n - 1))
    assert i64[1, :n].tolist() == pos3.tolist() == (pos + 1).tolist()[:n - 1] + [pos[-1]]
    assert i64[2, :n].tolist() == meta3.slot_mapping.tolist()
    assert i64[0, :n].tolist() == [0] * (n - 1) + [ids[-1].item()] == ids3.tolist()


def _decoding_engine(prefix: str, steps: int, **opts):
    """A dummy:tiny engine with three requests (3, 9, 14 prompt tokens) run ``steps`` steps."""
    from engine import LLM
    eng = LLM("dummy:tiny", block_size=4, num_blocks=256, **opts).engine
    for i, n in enumerate((3, 9, 14)):
        eng.add_request(f"{prefix}{i}", list(range(5, 5 + n)), _greedy())
    for _ in range(steps):
        eng.step()
    return eng


def _greedy():
    from engine import SamplingParams
    return SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def _mixed_engine():
    eng = _decoding_engine("d", steps=3, max_num_seqs=16, max_num_batched_tokens=24)
    eng.add_request("p0", list(range(40, 70)), _greedy())  # 30 tokens: chunked under the budget
    eng.add_request("p1", list(range(80, 85)), _greedy())
    return eng


def test_mixed_graph_inputs_match_the_eager_inputs():
    """fill_mixed_inputs (the mixed CUDA graphs' host side) writes the eager path's ids,
    positions, slots, lengths, tables and chunk offsets, with the chunks moved to row b and
    padding behind each part, and maps every sampling item to the row of its logits."""
    import numpy as np

    from engine.graph_inputs import MAX_PREFILL_SEQS as K, fill_mixed_inputs, plan_mixed
    from engine.graph_inputs import BlockTableRows
    eng = _mixed_engine()
    sched = eng.scheduler.schedule()
    kinds = [item.num_new_tokens == 1 for item in sched.scheduled]
    assert any(kinds) and not all(kinds)
    width = 16
    plan = plan_mixed(sched, [1, 2, 4, 8], [16, 32], width)
    assert plan is not None
    dec, pre, b, p = plan
    nd, npre = len(dec), sum(sched.scheduled[i].num_new_tokens for i in pre)
    assert b == 4 and nd == 3 and p == 32 and npre <= p
    i64 = np.full((4, 64), 99, np.int64)
    i32 = {name: np.full(shape, 99, np.int32) for name, shape in (
        ("dl", 8), ("dt", (8, width)), ("qsl", K + 1), ("pl", K), ("pt", (K, width)))}
    rows = fill_mixed_inputs(sched, dec, pre, b, p, 4, i64, i32["dl"], i32["dt"], i32["qsl"],
                             i32["pl"], i32["pt"], BlockTableRows(width))
    ids, pos, meta, sample_rows = eng.runner.prepare(sched)
    assert meta.num_decode == nd
    for r in range(3):  # ids, positions, slots: decode rows, padding, chunks, padding
        want = meta.slot_mapping if r == 2 else (ids, pos)[r]
        assert i64[r, :nd].tolist() == want[:nd].tolist()
        assert i64[r, b:b + npre].tolist() == want[nd:].tolist()
    assert i64[2, nd:b].tolist() == [-1] * (b - nd)
    assert i64[2, b + npre:b + p].tolist() == [-1] * (p - npre)
    assert (i64[:, b + p:] == 99).all()
    assert i32["dl"][:nd].tolist() == meta.seq_lens[:nd].tolist()
    assert i32["dl"][nd:b].tolist() == [0] * (b - nd)
    rest = meta.rest
    assert i32["qsl"][:len(pre) + 1].tolist() == rest.query_start_loc.tolist()
    assert i32["qsl"][len(pre) + 1:].tolist() == [npre] * (K - len(pre))
    assert i32["pl"].tolist() == rest.seq_lens.tolist() + [0] * (K - len(pre))
    for j, i in enumerate(pre):
        bt = sched.scheduled[i].seq.block_table
        assert i32["pt"][j, :len(bt)].tolist() == bt
    # each sampling item's logit row reads the token row the eager path samples
    to_graph = lambda t: t if t < nd else b + (t - nd)  # noqa: E731
    assert [int(i64[3, r]) for r in rows] == [to_graph(t) for t in sample_rows]


def test_plan_mixed_leaves_other_steps_to_the_other_paths():
    from engine.graph_inputs import MAX_PREFILL_SEQS, plan_mixed, token_buckets
    from engine.scheduler import ScheduledSeq, SchedulerOutput
    from engine.sequence import Sequence
    from engine.request import SamplingParams
    assert token_buckets(512) == [128, 256, 512] and token_buckets(300) == [128, 256, 300]
    assert token_buckets(0) == []
    sp = SamplingParams()

    def item(n, blocks=1):
        s = Sequence("x", list(range(1, 2 + n)), sp)
        s.block_table = list(range(blocks))
        return ScheduledSeq(s, n)

    buckets, toks = [1, 2, 4], [128, 256]
    assert plan_mixed(SchedulerOutput([item(1), item(1)]), buckets, toks, 8) is None  # decode
    assert plan_mixed(SchedulerOutput([item(1), item(300)]), buckets, toks, 8) is None
    assert plan_mixed(SchedulerOutput([item(1), item(5, blocks=9)]), buckets, toks, 8) is None
    assert plan_mixed(SchedulerOutput([item(1)] * 5 + [item(5)]), buckets, toks, 8) is None
    many = [item(2)] * (MAX_PREFILL_SEQS + 1)
    assert plan_mixed(SchedulerOutput(many), buckets, toks, 8) is None
    assert plan_mixed(SchedulerOutput([item(1), item(1), item(1), item(200)]), buckets, toks,
                      8)[2:] == (4, 256)
    assert plan_mixed(SchedulerOutput([item(7)]), buckets, toks, 8)[2:] == (1, 128)
    assert plan_mixed(SchedulerOutput([item(7)]), buckets, [], 8) is None
