"""The engine side of reliability: abort ends streams, resumed requests continue exactly,
seeded sampling is the same wherever a request's tokens were sampled, stranded blocks are
counted."""
from __future__ import annotations

import asyncio

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.request import FinishReason

PROMPT = [5, 9, 17, 33, 65, 129, 200, 7, 8, 9, 10, 11]


def _llm():
    return LLM("dummy:tiny", block_size=4, num_blocks=128)


def test_abort_ends_the_open_stream_with_finish_reason_abort_and_frees_blocks():
    """The Abort RPC used to free the request but leave its stream waiting for ever."""
    llm = _llm()

    async def main():
        ae = AsyncEngine(llm.engine)
        await ae.start()
        try:
            stream = ae.generate("r", PROMPT, SamplingParams(max_tokens=10_000, ignore_eos=True,
                                                             temperature=0))
            first = await stream.__anext__()
            assert first.token_ids and not first.finished
            assert await ae.abort("r")
            last = None
            async with asyncio.timeout(5):
                async for out in stream:
                    last = out
            assert last is not None and last.finished and last.finish_reason is FinishReason.ABORT
            st = await ae.stats()
            assert st.kv_blocks_free == st.kv_blocks_total
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_resumed_request_continues_exactly_as_if_uninterrupted():
    """Greedy and seeded: tokens k.. of a request resumed from its first k tokens (on a
    fresh engine, as after a migration) equal those of an uninterrupted run."""
    for sp in (SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
               SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=1234,
                              ignore_eos=True)):
        whole = _llm().generate([PROMPT], sp)[0].token_ids
        for k in (1, 7, 23):
            eng = _llm().engine
            eng.add_request("r", PROMPT, sp, output_token_ids=whole[:k])
            got = []
            while eng.has_work:
                for out in eng.step():
                    got += out.token_ids
            assert whole[:k] + got == whole, (sp.seed, k)


def test_a_seed_gives_the_same_tokens_disaggregated_as_colocated():
    """The prefill worker samples the first token; the decode worker continues the same
    random stream (it used to draw the first token's randomness again)."""
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    colocated = _llm().generate([PROMPT], sp)[0].token_ids
    pre = _llm().engine
    pre.add_request("p", PROMPT, sp, prefill_only=True)
    first = []
    while pre.has_work:
        for out in pre.step():
            first += out.token_ids
    dec = _llm().engine
    # a decode worker's continuation is a request resumed after the prefill's first token
    dec.add_request("d", PROMPT, sp, output_token_ids=first)
    rest = []
    while dec.has_work:
        for out in dec.step():
            rest += out.token_ids
    assert first + rest == colocated


def test_stranded_counts_blocks_nobody_owns():
    llm = _llm()

    async def main():
        ae = AsyncEngine(llm.engine)
        await ae.start()
        try:
            sp = SamplingParams(max_tokens=4)
            blocks = await ae.preallocate("owned", PROMPT, sp)
            assert blocks
            await ae.refresh_audit()
            assert ae.stranded() == 0  # its caller holds it
            # a request put into the engine behind every caller's back holds stranded blocks
            await ae.call(lambda e: e.preallocate("leak", PROMPT, sp))
            await asyncio.sleep(1.1)
            await ae.refresh_audit()
            assert ae.stranded() == len(blocks)
            await ae.abort("leak")
            await ae.abort("owned")
            await asyncio.sleep(1.1)
            await ae.refresh_audit()
            assert ae.stranded() == 0
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), 30))
