"""The prefill servicer's _ChunkFeed: which blocks of the prompt each finished prefill chunk
hands to the KV stream (full blocks only, after the decode worker's skipped prefix)."""
from __future__ import annotations

import asyncio

import pytest

from engine.request import PrefillProgress
from prefill_worker.servicer import _ChunkFeed


def drain(stream) -> list[tuple[list[int], object]]:
    async def go():
        out = []
        while stream._parts:  # noqa: SLF001 - what was handed over, part by part
            out.append(await stream.next_part())
        return out
    return asyncio.run(go())


def test_chunks_hand_over_full_blocks_after_the_skipped_prefix():
    table = [50, 51, 52, 53, 54, 55]  # a 90-token prompt in 16-token blocks
    feed = _ChunkFeed(total=4, skip=2, block_size=16)  # decode holds blocks 0-1 already
    ev = object()
    feed.progress(PrefillProgress("r", 40, table[:3], ev))  # 2 full blocks: all skipped
    assert drain(feed.stream) == []
    feed.progress(PrefillProgress("r", 72, table[:5], ev))  # 4 full: blocks 2, 3
    assert drain(feed.stream) == [([52, 53], ev)]
    feed.finish(table)  # the last (partial) block comes with the first token
    assert drain(feed.stream) == [([54, 55], None)]
    assert feed.stream.complete and feed.parts == 2


def test_reset_or_short_table_fails_the_stream():
    feed = _ChunkFeed(total=3, skip=0, block_size=16)
    feed.progress(PrefillProgress("r", 32, [7, 8], None))
    feed.progress(PrefillProgress("r", 0, [], reset=True))
    assert feed.stream.failed
    feed.progress(PrefillProgress("r", 48, [1, 2, 3], None))  # ignored once failed
    with pytest.raises(Exception, match="preempted"):
        drain(feed.stream)
        asyncio.run(feed.stream.next_part())
    short = _ChunkFeed(total=3, skip=0, block_size=16)
    short.finish([1, 2])
    assert short.stream.failed
