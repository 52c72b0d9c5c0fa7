"""engine.model_runner.BlockTableRows: the CUDA-graph input fill's per-request table cache."""
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
