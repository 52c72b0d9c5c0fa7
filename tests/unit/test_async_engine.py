"""AsyncEngine (the engine thread of a worker) under callers that give up."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine


def test_a_cancelled_caller_does_not_kill_the_engine_thread():
    """A command whose caller was cancelled while it ran used to raise InvalidStateError in
    the engine thread (set_result on a cancelled future), killing it silently: every later
    request of that worker hung. The command still runs (its caller's clean-up is queued
    behind it), its result is dropped, and the engine keeps serving."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=64)

    async def main():
        ae = AsyncEngine(llm.engine)
        await ae.start()
        started, release = threading.Event(), threading.Event()
        ran = []

        def slow(eng):
            started.set()
            release.wait(5)
            ran.append(1)
            return "late"

        task = asyncio.create_task(ae.call(slow))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()  # the caller gives up while the command runs
        await asyncio.sleep(0.05)
        release.set()
        try:
            await task
        except asyncio.CancelledError:
            pass

        def boom(eng):
            raise RuntimeError("bad command")
        fail = asyncio.create_task(ae.call(boom))
        await asyncio.sleep(0)
        fail.cancel()  # cancelled before it ran: it still runs, its error is dropped
        await asyncio.sleep(0.1)
        assert ran == [1] and ae.dead is None and ae._thread.is_alive()
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outs = [o async for o in ae.generate("after", [5, 6, 7], sp)]
        assert sum(len(o.token_ids) for o in outs) == 4
        await ae.stop()

    asyncio.run(main())


def test_request_context_closed_from_another_context_does_not_raise():
    """Async generators closed by the loop's finalizer run in a new Context; restoring the
    logging context variables there used to raise ValueError (logged as a task error)."""
    import contextvars

    from services.logging_setup import current_request_id, request_context
    cm = request_context("rid-1", "trace")
    opened = contextvars.copy_context()  # the request's context (ours stays clean)
    opened.run(cm.__enter__)
    assert opened.run(current_request_id) == "rid-1"
    contextvars.Context().run(cm.__exit__, None, None, None)  # no ValueError
    assert current_request_id() == ""


def test_cancelled_preallocate_and_generate_leave_no_request_behind():
    """A decode worker whose caller is cancelled while its pre-allocation is queued used to
    keep that request AWAITING_KV with its blocks for good (seen in a chaos run: blocks in
    use and a waiting request after every client had gone)."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=64)
    eng = llm.engine

    async def main():
        ae = AsyncEngine(eng)
        await ae.start()
        gate = threading.Event()
        blocker = asyncio.create_task(ae.call(lambda e: gate.wait(5)))  # hold the thread
        await asyncio.sleep(0.05)
        sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        pre = asyncio.create_task(ae.preallocate("p", list(range(3, 20)), sp))
        gen = ae.generate("g", list(range(3, 20)), sp)
        first = asyncio.create_task(gen.__anext__())
        await asyncio.sleep(0.05)
        pre.cancel()
        first.cancel()
        gate.set()
        for t in (pre, first):
            try:
                await t
            except asyncio.CancelledError:
                pass
        await blocker
        st = await ae.stats()
        assert (st.num_awaiting_kv, st.num_running, st.num_waiting) == (0, 0, 0)
        assert st.kv_blocks_free == st.kv_blocks_total
        await ae.stop()

    asyncio.run(main())


def test_a_consumer_that_falls_behind_gets_the_queued_steps_merged():
    """Outputs that queued up while the stream's consumer was busy come out as one output
    per sample (tokens, text and logprobs in order); the tokens are the engine's, the
    last output still says finished; another sample's output is not merged in."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=64)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    want = llm.generate([list(range(3, 12))], sp)[0]

    async def main():
        ae = AsyncEngine(llm.engine)
        await ae.start()
        stream = ae.generate("slow", list(range(3, 12)), sp)
        first = await stream.__anext__()
        while ae.snapshot is None or ae.snapshot.num_running:  # every step queued meanwhile
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the last step's delivery is scheduled just after
        rest = [o async for o in stream]
        await ae.stop()
        return first, rest

    first, rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished and rest[0].finish_reason == want.finish_reason
    assert first.token_ids + rest[0].token_ids == want.token_ids
    assert len(first.logprobs) + len(rest[0].logprobs) == len(want.token_ids)


def test_merge_outputs_keeps_order_and_the_last_state():
    from engine.async_engine import merge_outputs
    from engine.request import FinishReason, RequestOutput
    a = RequestOutput("r", [], [5], "a", logprobs=[-0.5])
    b = RequestOutput("r", [], [6, 7], "bc", finished=True, finish_reason=FinishReason.STOP,
                      logprobs=[-0.1, -0.2], num_cached_tokens=4)
    m = merge_outputs(a, b)
    assert (m.token_ids, m.text, m.logprobs, m.finished, m.finish_reason,
            m.num_cached_tokens) == ([5, 6, 7], "abc", [-0.5, -0.1, -0.2], True,
                                     FinishReason.STOP, 4)
    assert a.token_ids == [5] and b.token_ids == [6, 7]  # inputs untouched
    assert merge_outputs(RequestOutput("r", [], [1]), RequestOutput("r", [], [2])).logprobs \
        is None


def test_commands_during_and_after_stop_fail_instead_of_waiting_forever():
    """A worker stopping under load: callers that queue a command (an abort from a
    cancelled call's clean-up) while or after the engine thread stops get EngineDeadError
    at once; before, their futures were never resolved and the worker's shutdown waited on
    them forever (SIGTERM with streams in flight never exited). A stream still open ends
    with the same error."""
    from engine.async_engine import EngineDeadError
    llm = LLM("dummy:tiny", block_size=4, num_blocks=64)

    async def main():
        ae = AsyncEngine(llm.engine)
        await ae.start()
        sp = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        stream = ae.generate("long", [3, 4, 5], sp)
        await stream.__anext__()  # running

        async def hammer():
            out = []
            for i in range(200):
                try:
                    out.append(await asyncio.wait_for(ae.abort(f"x{i}"), 5))
                except EngineDeadError:
                    out.append("dead")
                await asyncio.sleep(0)
            return out

        h = asyncio.create_task(hammer())
        await asyncio.sleep(0.01)
        await asyncio.wait_for(ae.stop(), 10)
        res = await asyncio.wait_for(h, 10)  # every call answered, none hung
        assert len(res) == 200 and res[-1] == "dead"
        with pytest.raises(EngineDeadError, match="stopped"):
            await asyncio.wait_for(ae.abort("after"), 2)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
    asyncio.run(main())


def test_a_prompt_waiting_for_blocks_held_by_transfers_waits_without_spinning(caplog):
    """Prefill role: finished prompts HOLD their blocks until their KV transfer ends. A
    prompt that does not fit meanwhile waits: the engine thread sleeps until a command (the
    release) instead of stepping in a loop (a hung decode worker's transfers made it spin a
    core and log 'needs more KV blocks than exist' 20,000 times a second), and it is
    admitted as soon as the blocks come back."""
    import logging
    llm = LLM("dummy:tiny", block_size=4, num_blocks=24, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=4, temperature=0)

    async def main():
        ae = AsyncEngine(llm.engine)
        tried = []
        ae.step_listeners.append(lambda outs: tried.append(1))
        await ae.start()
        held = await ae.prefill("held", list(range(1, 61)), sp)  # 61 tokens: 16 blocks
        assert len(held.held_block_ids) >= 15
        task = asyncio.create_task(ae.prefill("next", list(range(2, 42)), sp))  # 11 blocks
        await asyncio.sleep(0.1)
        steps = len(tried)
        await asyncio.sleep(0.5)
        spun = len(tried) - steps
        assert spun <= 30, f"{spun} empty steps in 0.5 s"  # ~10 at one per 50 ms
        assert not task.done() and llm.engine.stalled
        assert await ae.release("held")
        out = await asyncio.wait_for(task, 5)
        assert len(out.token_ids) == 1
        assert await ae.release("next")
        await ae.stop()

    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        asyncio.run(main())
    assert "more KV blocks than exist" not in caplog.text


def test_a_preallocation_waits_for_free_kv_blocks_in_arrival_order():
    """Decode role with its KV cache full: a prompt's pre-allocation waits for running
    requests to free blocks (it used to fail at once: RESOURCE_EXHAUSTED for 406 of 1000
    requests of 1P1D on one 80 GB GPU at concurrency 512), in arrival order: a small one
    that would fit in what is left waits behind a larger one that came first."""
    llm = LLM("dummy:tiny", block_size=4, num_blocks=8)
    sp = SamplingParams(max_tokens=4)

    async def main():
        ae = AsyncEngine(llm.engine)
        await ae.start()
        try:
            a = await ae.preallocate("a", list(range(3, 31)), sp)  # 28 tokens: 7 of 8 blocks
            assert a is not None and len(a) == 7
            order = []

            async def wait(rid, n, wait_s):
                blocks = await ae.preallocate(rid, list(range(3, 3 + n)), sp, wait_s=wait_s)
                order.append(rid)
                return blocks

            async def waiters(n):  # queued in that order (not by sleeping: a loaded machine)
                for _ in range(500):
                    if ae.kv_block_waiters == n:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"{ae.kv_block_waiters} waiters, not {n}")

            b = asyncio.create_task(wait("b", 28, 10))  # 7 blocks: waits
            await waiters(1)
            c = asyncio.create_task(wait("c", 4, 10))  # 1 block is free, but b came first
            await waiters(2)
            await asyncio.sleep(0.3)
            assert not b.done() and not c.done()
            assert ae.kv_block_waiters == 2  # counted as waiting (queue depth, load)
            # a full cache that stays full: None after wait_s; more than the cache: at once
            assert await ae.preallocate("d", list(range(3, 31)), sp, wait_s=0.2) is None
            assert await ae.preallocate("e", list(range(3, 60)), sp, wait_s=10) is None
            assert await ae.abort("a")  # frees a's 7 blocks
            got_b, got_c = await asyncio.wait_for(asyncio.gather(b, c), 5)
            assert order == ["b", "c"] and len(got_b) == 7 and len(got_c) == 1
            # a waiter that gives up (its client went away) lets the next one through
            f = asyncio.create_task(ae.preallocate("f", list(range(3, 31)), sp, wait_s=10))
            await waiters(1)
            g = asyncio.create_task(ae.preallocate("g", [5], sp, wait_s=10))
            await waiters(2)
            f.cancel()
            with pytest.raises(asyncio.CancelledError):
                await f
            assert await ae.abort("c")  # one block free: g's
            assert len(await asyncio.wait_for(g, 5)) == 1
            assert not ae._kv_waiters
        finally:
            await ae.stop()

    asyncio.run(main())
