"""The prefill servicer's _ChunkFeed: which blocks of the prompt each prefill chunk hands to
the KV stream as it is queued (full blocks only, the last chunk's partial block included,
after the decode worker's skipped prefix), with its events."""
from __future__ import annotations

import asyncio

import pytest

from engine.request import PrefillProgress
from prefill_worker.feed import ChunkFeed as _ChunkFeed


def drain(stream) -> list[tuple[list[int], object]]:
    async def go():
        out = []
        while stream._parts:  # noqa: SLF001 - what was handed over, part by part
            out.append(await stream.next_part())
        return out
    return asyncio.run(go())


def test_chunks_hand_over_full_blocks_after_the_skipped_prefix():
    table = [50, 51, 52, 53, 54, 55]  # a 90-token prompt in 16-token blocks
    feed = _ChunkFeed(total=4, skip=2, block_size=16, prompt_tokens=90)  # decode holds 0-1
    ev, ev2, layers = object(), object(), [object(), object()]
    feed.progress(PrefillProgress("r", 40, table[:3], ev))  # 2 full blocks: all skipped
    assert drain(feed.stream) == []
    feed.progress(PrefillProgress("r", 72, table[:5], ev))  # 4 full: blocks 2, 3
    assert drain(feed.stream) == [([52, 53], ev)]
    # the last chunk completes the prompt: its partial last block goes with it, with the
    # chunk's per-layer events
    feed.progress(PrefillProgress("r", 90, table, ev2, layer_ready=layers))
    part = asyncio.run(feed.stream.next_layered())
    assert (part.ids, part.event, part.layers) == ([54, 55], ev2, layers)
    feed.finish(table)  # the first token: nothing left to hand over
    assert drain(feed.stream) == []
    assert feed.stream.complete and feed.parts == 2


def test_finish_hands_over_what_no_chunk_reported():
    feed = _ChunkFeed(total=2, skip=0, block_size=16, prompt_tokens=20)
    feed.finish([3, 4])
    assert drain(feed.stream) == [([3, 4], None)]
    assert feed.stream.complete and feed.parts == 1


def test_merged_parts_keep_the_last_layer_events():
    feed = _ChunkFeed(total=3, skip=0, block_size=16, prompt_tokens=40)
    a, b = [object()], [object()]
    feed.progress(PrefillProgress("r", 32, [7, 8], "e1", layer_ready=a))
    feed.progress(PrefillProgress("r", 40, [7, 8, 9], "e2", layer_ready=b))
    part = asyncio.run(feed.stream.next_layered())  # both taken at once: one part
    assert (part.ids, part.event, part.layers) == ([7, 8, 9], "e2", b)


def test_reset_or_short_table_fails_the_stream():
    feed = _ChunkFeed(total=3, skip=0, block_size=16, prompt_tokens=48)
    feed.progress(PrefillProgress("r", 32, [7, 8], None))
    feed.progress(PrefillProgress("r", 0, [], reset=True))
    assert feed.stream.failed
    feed.progress(PrefillProgress("r", 48, [1, 2, 3], None))  # ignored once failed
    with pytest.raises(Exception, match="preempted"):
        drain(feed.stream)
        asyncio.run(feed.stream.next_part())
    short = _ChunkFeed(total=3, skip=0, block_size=16, prompt_tokens=48)
    short.finish([1, 2])
    assert short.stream.failed
