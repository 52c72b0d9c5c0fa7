"""pdcore.ids: call and transfer ids unique within a process (across threads) and across
processes, without a random read per id."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from pdcore.ids import IdSource, new_id


def test_ids_are_unique_across_threads_and_sources():
    src = IdSource()
    with ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(lambda _: src.next(), range(20_000)))
    assert len(set(ids)) == len(ids)
    other = IdSource()
    assert not set(ids) & {other.next() for _ in range(1000)}


def test_ids_differ_between_processes():
    code = "from pdcore.ids import new_id; print(new_id())"
    theirs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.strip() for _ in range(3)}
    assert len(theirs) == 3 and new_id() not in theirs
