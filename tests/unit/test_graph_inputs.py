"""The CUDA-graph decode path's host side (engine.model_runner), checked on the CPU: the per-request
block-table rows and the static-input fill against the eager path's inputs."""
from __future__ import annotations

import pytest


def test_block_table_rows_convert_only_new_blocks():
    import numpy as np

    from engine.model_runner import BlockTableRows
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

    from engine import LLM, SamplingParams
    from engine.model_runner import BlockTableRows, fill_decode_inputs
    llm = LLM("dummy:tiny", block_size=4, num_blocks=256, max_num_seqs=8)
    eng = llm.engine
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, n in enumerate((3, 9, 14)):
        eng.add_request(f"r{i}", list(range(5, 5 + n)), sp)
    for _ in range(6):
        eng.step()
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
    fill_decode_inputs(sched, b, 4, i64, lens, tables, rows, chained=n)
    _, pos2, meta2, _ = eng.runner.prepare(sched, next_ids=[0] * n)
    assert i64[1, :n].tolist() == pos2.tolist() == (pos + 1).tolist()
    assert i64[2, :n].tolist() == meta2.slot_mapping.tolist()
    assert lens[:n].tolist() == meta2.seq_lens.tolist()
    assert i64[0, :n].tolist() == [0] * n  # left for the device copy
    # a sequence that joined since the chained rows' step: only the first n - 1 rows chain
    fill_decode_inputs(sched, b, 4, i64, lens, tables, rows, chained=n - 1)
    ids3, pos3, meta3, _ = eng.runner.prepare(sched, next_ids=[0] * (n - 1))
    assert i64[1, :n].tolist() == pos3.tolist() == (pos + 1).tolist()[:n - 1] + [pos[-1]]
    assert i64[2, :n].tolist() == meta3.slot_mapping.tolist()
    assert i64[0, :n].tolist() == [0] * (n - 1) + [ids[-1].item()] == ids3.tolist()
