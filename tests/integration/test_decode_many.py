"""DecodeWorker.GenerateMany (many calls on one stream, the gateway's default) against a real
worker process: the same tokens as Generate calls, in fewer messages; one call's error,
cancellation, deadline or abort ends that call only; a message that does not parse ends its
stream's calls and the stream with INVALID_ARGUMENT, and no other stream's; a worker that dies fails every call on
the stream with UNAVAILABLE; every KV block is free afterwards."""
from __future__ import annotations

import asyncio
import time

import grpc

from gateway.decode_calls import DecodeCalls
from pdserve.cluster import LocalCluster
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.grpc_server import ChannelPool
from tests.integration.helpers import run, wait_all_free


def _req(rid: str, ids, max_tokens: int, **sp) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=ids, model="dummy:tiny",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0,
                                           ignore_eos=True, **sp))


async def _collect(call):
    """(tokens, finish_reason, status name, message)."""
    tokens, finish = [], ""
    try:
        async for resp in call:
            tokens.extend(resp.token_ids)
            finish = resp.finish_reason or finish
        return tokens, finish, "OK", ""
    except grpc.aio.AioRpcError as e:
        return tokens, finish, e.code().name, e.details()


def _calls(mode: str) -> DecodeCalls:
    return DecodeCalls(ChannelPool(worker_pb2_grpc.DecodeWorkerStub), mode)


def test_many_calls_on_one_stream():
    prompts = [[5 + i, 17, 33 + 3 * i, 40, 41 + i] * (1 + i % 3) for i in range(8)]

    async def same_tokens(address):
        many, single = _calls("many"), _calls("per_request")
        try:
            got = await asyncio.gather(*(
                _collect(many.generate(address, _req(f"m{i}", p, 64), 30))
                for i, p in enumerate(prompts)))
            want = await asyncio.gather(*(
                _collect(single.generate(address, _req(f"s{i}", p, 64), 30))
                for i, p in enumerate(prompts)))
            stream = many._streams[address]
            return got, want, stream.messages, len(many._streams)
        finally:
            await many.close()
            await single.close()

    async def one_call_ends_alone(address):
        many = _calls("many")
        try:
            ok = many.generate(address, _req("ok", [9, 8, 7, 6], 40), 30)
            bad = many.generate(address, _req("bad", [10**6, 3], 4), 30)
            late = many.generate(address, _req("late", [4, 5, 6], 2000), 0.3)
            left = many.generate(address, _req("left", [4, 5, 6, 7], 2000), 30)
            it = left.__aiter__()
            first = [await it.__anext__(), await it.__anext__()]
            assert left.cancel()
            try:
                await it.__anext__()
                cancelled = "no"
            except asyncio.CancelledError:
                cancelled = "CancelledError"
            aborted = many.generate(address, _req("ab", [4, 5, 6, 8], 2000), 30)
            ait = aborted.__aiter__()
            await ait.__anext__()
            async with grpc.aio.insecure_channel(address) as ch:
                found = await worker_pb2_grpc.DecodeWorkerStub(ch).Abort(
                    common_pb2.AbortRequest(request_id="ab"), timeout=5)
            rest = await _collect(ait)
            results = await asyncio.gather(_collect(ok), _collect(bad), _collect(late))
            return results, first, cancelled, found.found, rest
        finally:
            await many.close()

    async def half_closed(address):
        """A caller that sends its calls and half-closes: the stream ends (OK) once the
        calls have ended, each with exactly one end entry and nothing after it. Among them
        a call with a negative timeout and a call_id started twice (caller errors)."""
        start = worker_pb2.DecodeStreamRequest
        async with grpc.aio.insecure_channel(address) as ch:
            stream = worker_pb2_grpc.DecodeWorkerStub(ch).GenerateMany(iter(
                [start(call_id=i, start=_req(f"h{i}", [6, 7, i], 5)) for i in (1, 2)]
                + [start(call_id=3, start=_req("h3", [6, 7], 5), timeout_s=-1),
                   start(call_id=4, start=_req("h4", [6, 7, 4], 2000)),
                   start(call_id=4, start=_req("h4b", [6, 7, 4], 5))]), timeout=20)
            entries = [e async for msg in stream for e in msg.entries]
            return entries, await stream.code()

    async def malformed(address):
        """A message that does not parse, while a call is open on the stream and another
        stream (as the gateway's) serves a call."""
        many = _calls("many")
        other = asyncio.ensure_future(_collect(many.generate(address, _req("z2", [5, 6], 40),
                                                             30)))
        async with grpc.aio.insecure_channel(address) as ch:
            raw = ch.stream_stream("/pdserve.v1.DecodeWorker/GenerateMany",
                                   request_serializer=lambda b: b,
                                   response_deserializer=worker_pb2.DecodeStreamResponse.FromString)

            async def requests():
                yield worker_pb2.DecodeStreamRequest(
                    call_id=1, start=_req("z1", [5, 6, 7], 2000)).SerializeToString()
                await asyncio.sleep(0.3)
                yield b"\xff\xff\xff\xff"  # not protobuf
                await asyncio.sleep(30)
            entries, code, details = [], "OK", ""
            try:
                async for msg in raw(requests(), timeout=20):
                    entries.extend(msg.entries)
            except grpc.aio.AioRpcError as e:
                code, details = e.code().name, e.details()
        try:
            return entries, code, details, await other
        finally:
            await many.close()

    with LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=1, secure=False,
                      redis=False) as c:
        address = c.workers[0].address
        entries, code = run(half_closed(address))
        assert code == grpc.StatusCode.OK
        ends = {e.call_id: (next(c.name for c in grpc.StatusCode
                                 if c.value[0] == e.status_code), e.status_message)
                for e in entries if e.end}
        assert sorted(e.call_id for e in entries if e.end) == [1, 2, 3, 4]  # one each
        assert ends[1] == ends[2] == ("OK", "")
        assert ends[3][0] == "INVALID_ARGUMENT" and "timeout_s" in ends[3][1], ends
        assert ends[4][0] == "INVALID_ARGUMENT" and "started again" in ends[4][1], ends
        last = {e.call_id: i for i, e in enumerate(entries)}
        assert all(entries[last[cid]].end for cid in ends)  # nothing after a call's end
        assert {i: sum(len(e.response.token_ids) for e in entries if e.call_id == i)
                for i in (1, 2)} == {1: 5, 2: 5}
        for stats in run(wait_all_free([address], timeout_s=15)):
            assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
        got, want, messages, streams = run(same_tokens(address))
        assert got == want
        assert all(len(t) == 64 and f == "length" for t, f, _, _ in got), got
        # one stream; its messages carry several calls' steps (8 calls x 64 tokens, one
        # response each per step, would be 512 messages on Generate calls; calls of 12
        # tokens did not always overlap on a loaded machine, each alone in its steps)
        assert streams == 1
        assert messages < 8 * 64, messages

        (ok, bad, late), first, cancelled, found, rest = run(one_call_ends_alone(address))
        assert ok[1:3] == ("length", "OK") and len(ok[0]) == 40
        assert bad[2] == "INVALID_ARGUMENT" and "vocabulary" in bad[3], bad
        assert late[2] == "DEADLINE_EXCEEDED", late[1:]
        assert all(r.token_ids for r in first) and cancelled == "CancelledError"
        assert found and rest[1:3] == ("abort", "OK"), rest[1:]
        for stats in run(wait_all_free([address], timeout_s=15)):
            assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)

        # a message that does not parse ends the open call, then the stream, with
        # INVALID_ARGUMENT (it ended OK, the call "cancelled by the caller"); another stream's
        # call is untouched
        entries, code, details, other = run(malformed(address))
        assert code == "INVALID_ARGUMENT" and "not a valid protobuf" in details, details
        ends = [e for e in entries if e.end]
        assert [e.call_id for e in ends] == [1] and "stream broke" in ends[0].status_message
        assert ends[0].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert other[1:3] == ("length", "OK") and len(other[0]) == 40, other[1:]
        for stats in run(wait_all_free([address], timeout_s=15)):
            assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_a_worker_that_dies_fails_every_call_on_its_stream():
    async def main(c, worker):
        many = _calls("many")
        try:
            calls = [many.generate(worker.address, _req(f"k{i}", [3 + i, 4, 5], 2000), 60)
                     for i in range(4)]
            its = [call.__aiter__() for call in calls]
            for it in its:
                await it.__anext__()
            t0 = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(None, c.kill, worker)
            ends = await asyncio.wait_for(asyncio.gather(*(_collect(it) for it in its)), 10)
            return ends, time.monotonic() - t0, many._streams
        finally:
            await many.close()

    with LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=1, secure=False,
                      redis=False) as c:
        ends, took, streams = run(main(c, c.workers[0]))
        assert [e[2] for e in ends] == ["UNAVAILABLE"] * 4, ends
        assert took < 10 and not streams  # the next call opens a new stream


async def _read_all(call) -> list:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


def test_a_worker_shutting_down_says_so_on_every_stream_and_in_stats():
    """SIGTERM, with a 3 s drain delay: the stream open before it gets a draining message
    (with the worker's grace period) and its call goes on; a stream opened during the drain
    delay gets the message at once and its call is refused UNAVAILABLE (the gateway then
    closes such a stream: gateway/decode_calls.py); Stats says draining."""
    import signal

    async def main(worker):
        async with grpc.aio.insecure_channel(worker.address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            assert not (await stub.Stats(common_pb2.StatsRequest(), timeout=5)).draining
            sends: asyncio.Queue = asyncio.Queue()

            async def requests(q):
                while (m := await q.get()) is not None:
                    yield m
            old = stub.GenerateMany(requests(sends))
            sends.put_nowait(worker_pb2.DecodeStreamRequest(
                call_id=1, start=_req("old", [3, 4, 5], 1500)))
            first = await old.read()
            assert first.entries and not first.draining
            worker.proc.send_signal(signal.SIGTERM)
            draining = None
            while draining is None:
                msg = await asyncio.wait_for(old.read(), 10)
                if msg.draining:
                    draining = msg
            assert (await stub.Stats(common_pb2.StatsRequest(), timeout=5)).draining
            late_sends: asyncio.Queue = asyncio.Queue()
            late = stub.GenerateMany(requests(late_sends))
            late_sends.put_nowait(worker_pb2.DecodeStreamRequest(
                call_id=1, start=_req("late", [3, 4, 5], 5)))
            got = [await asyncio.wait_for(late.read(), 10) for _ in range(2)]
            late_sends.put_nowait(None)
            assert await _read_all(late) == []
            sends.put_nowait(None)
            rest = await _read_all(old)
            return draining, got, rest

    with LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=1, secure=False,
                      redis=False, worker_args=("--drain-delay-s", "3", "--grace-s", "30")
                      ) as c:
        draining, got, rest = run(asyncio.wait_for(main(c.workers[0]), 60))
        assert draining.grace_s == 30
        assert got[0].draining
        ends = [e for m in got for e in m.entries if e.end]
        assert len(ends) == 1 and ends[0].status_code == grpc.StatusCode.UNAVAILABLE.value[0]
        last = [e for m in rest for e in m.entries if e.end]
        assert len(last) == 1 and last[0].status_code == 0  # the old call finished
        c.workers[0].proc.wait(30)


def test_a_step_bigger_than_the_message_limit_goes_in_several_messages():
    """A worker with a small max_message_bytes: one step of 48 calls with 20 top logprobs
    each (~200 bytes an entry) does not fit one message of 4 KiB. The worker splits it; a
    message over the limit would end the stream and every call on it."""
    async def main(address):
        many = _calls("many")
        try:
            got = await asyncio.gather(*(
                _collect(many.generate(address, _req(f"b{i}", [5, 6, i], 16, logprobs=True,
                                                     top_logprobs=20), 30))
                for i in range(48)))
            return got, many._streams[address].messages
        finally:
            await many.close()

    with LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=1, secure=False,
                      redis=False, worker_args=("--max-message-bytes", "4096")) as c:
        got, messages = run(main(c.workers[0].address))
        assert [g[2] for g in got] == ["OK"] * 48, {g[2:] for g in got}
        assert all(len(g[0]) == 16 for g in got)
        assert messages > 16  # the steps went out in more than one message each
