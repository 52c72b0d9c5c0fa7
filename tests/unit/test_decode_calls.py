"""gateway/decode_calls.py against real gRPC servers on loopback: a worker that does not
serve GenerateMany (one built before it) gets Generate calls instead, with the same
responses; a worker that never answers a call on the stream still ends it at its deadline;
cancel() reaches the worker as a cancel entry and ends the caller's iteration; calls open on a
stream the worker ended while the gateway wrote to it fail with UNAVAILABLE."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.decode_calls import DecodeCalls
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.grpc_server import ChannelPool


def _req(rid: str) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                    sampling=common_pb2.SamplingParams(max_tokens=3))


class OlderWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """Serves Generate only (GenerateMany: the generated base answers UNIMPLEMENTED)."""

    def __init__(self):
        self.generate_calls = 0

    async def Generate(self, request, context):
        self.generate_calls += 1
        for t in (7, 8, 9):
            yield common_pb2.GenerateResponse(request_id=request.request_id, token_ids=[t])


class SilentWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """Takes GenerateMany calls and never answers them; records what the gateway sent."""

    def __init__(self):
        self.received: list[worker_pb2.DecodeStreamRequest] = []

    async def GenerateMany(self, request_iterator, context):
        async for msg in request_iterator:
            self.received.append(msg)
        return
        yield  # noqa: unreachable - makes this an async generator


class EchoWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """Answers each GenerateMany start with its prompt's first token, then an OK end."""

    async def GenerateMany(self, request_iterator, context):
        async for msg in request_iterator:
            if msg.WhichOneof("action") == "start":
                yield worker_pb2.DecodeStreamResponse(entries=[
                    worker_pb2.DecodeStreamEntry(call_id=msg.call_id, response=common_pb2.
                                                 GenerateResponse(token_ids=msg.start.
                                                                  prompt_token_ids[:1])),
                    worker_pb2.DecodeStreamEntry(call_id=msg.call_id, end=True)])


async def _serve(servicer):
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _tokens(call) -> list[int]:
    return [t async for resp in call for t in resp.token_ids]


def _calls() -> DecodeCalls:
    return DecodeCalls(ChannelPool(worker_pb2_grpc.DecodeWorkerStub), "many")


def test_a_worker_without_generate_many_gets_generate_calls(caplog):
    async def main():
        worker = OlderWorker()
        server, address = await _serve(worker)
        calls = _calls()
        try:
            first = await _tokens(calls.generate(address, _req("a"), 5))
            second = await _tokens(calls.generate(address, _req("b"), 5))
            return first, second, worker.generate_calls, calls._per_request == {address}
        finally:
            await calls.close()
            await server.stop(None)

    first, second, n, fell_back = asyncio.run(main())
    assert first == second == [7, 8, 9]
    assert n == 2 and fell_back  # the second call went straight to Generate
    assert "does not serve GenerateMany" in caplog.text


def test_a_silent_worker_ends_the_call_at_its_deadline_and_cancel_reaches_it():
    async def main():
        worker = SilentWorker()
        server, address = await _serve(worker)
        calls = _calls()
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(_tokens(calls.generate(address, _req("late"), 0.2)), 5)
            took = loop.time() - t0
            left = calls.generate(address, _req("left"), 30)
            assert left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await _tokens(left)
            for _ in range(50):  # the cancel entry is on its way
                if any(m.cancel for m in worker.received):
                    break
                await asyncio.sleep(0.05)
            return err.value.code(), took, [m.WhichOneof("action") for m in worker.received]
        finally:
            await calls.close()
            await server.stop(None)

    code, took, actions = asyncio.run(main())
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.2 <= took < 3.0  # the worker's own deadline plus the gateway's 1 s slack
    # "late" started, then cancelled when it expired; "left" started, then cancelled
    assert actions == ["start", "cancel", "start", "cancel"]


def test_a_request_over_the_message_limit_fails_alone():
    """The worker would refuse such a message and end the stream with every call on it:
    the gateway fails that call before sending it."""
    async def main():
        server, address = await _serve(EchoWorker())
        calls = DecodeCalls(ChannelPool(worker_pb2_grpc.DecodeWorkerStub,
                                        max_message_bytes=4096), "many")
        try:
            big = worker_pb2.DecodeRequest(request_id="big", prompt_token_ids=[100] * 5000)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _tokens(calls.generate(address, big, 5))
            small = await _tokens(calls.generate(address, _req("small"), 5))
            return err.value, small, len(calls._streams)
        finally:
            await calls.close()
            await server.stop(None)

    err, small, streams = asyncio.run(main())
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "message limit" in err.details()
    assert small == [1] and streams == 1


class EndingWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """Ends the stream after its first message, as a worker whose shutdown ended its stream
    while the gateway was still sending."""

    async def GenerateMany(self, request_iterator, context):
        async for _ in request_iterator:
            return
        yield  # noqa: unreachable - makes this an async generator


def test_calls_open_on_a_stream_the_worker_ended_fail_as_unavailable():
    """The worker ends its stream while the gateway is still writing starts to it: grpc's
    asyncio client reports its failed write as INTERNAL (grpc/grpc#36066); the calls left
    open fail with UNAVAILABLE, which the request path resumes elsewhere, never INTERNAL."""
    async def main():
        server, address = await _serve(EndingWorker())
        calls = _calls()
        try:
            codes = []
            for _ in range(10):
                big = [worker_pb2.DecodeRequest(request_id=f"r{i}",
                                                prompt_token_ids=list(range(20_000)))
                       for i in range(32)]
                its = [calls.generate(address, r, 10) for r in big]

                async def code(call):
                    try:
                        await _tokens(call)
                        return "OK"
                    except grpc.aio.AioRpcError as e:
                        return e.code().name
                codes += await asyncio.wait_for(asyncio.gather(*(code(c) for c in its)), 20)
            return codes
        finally:
            await calls.close()
            await server.stop(None)

    codes = asyncio.run(main())
    assert set(codes) == {"UNAVAILABLE"}, {c: codes.count(c) for c in set(codes)}


class DrainingWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """Says it is draining on each stream, then answers each start as EchoWorker does;
    counts the streams opened and those the caller ended."""

    def __init__(self):
        self.opened = self.ended = 0

    async def GenerateMany(self, request_iterator, context):
        self.opened += 1
        yield worker_pb2.DecodeStreamResponse(draining=True, grace_s=7.0)
        async for msg in request_iterator:
            if msg.WhichOneof("action") == "start":
                yield worker_pb2.DecodeStreamResponse(entries=[
                    worker_pb2.DecodeStreamEntry(call_id=msg.call_id, response=common_pb2.
                                                 GenerateResponse(token_ids=[5])),
                    worker_pb2.DecodeStreamEntry(call_id=msg.call_id, end=True)])
        self.ended += 1


def test_a_worker_that_says_it_is_draining_is_reported_and_its_calls_go_on():
    """The draining message reaches on_draining with the worker's grace period; the call
    open on that stream goes on; the stream is retired (it ends once its calls did), so
    the next call opens a new one (to whatever serves the address by then)."""
    async def main():
        worker = DrainingWorker()
        server, address = await _serve(worker)
        told: list[tuple[str, float]] = []
        calls = DecodeCalls(ChannelPool(worker_pb2_grpc.DecodeWorkerStub), "many",
                            on_draining=lambda a, g: told.append((a, g)))
        try:
            assert await _tokens(calls.generate(address, _req("a"), timeout=10)) == [5]
            assert told == [(address, 7.0)]
            for _ in range(100):
                if worker.ended == 1:
                    break
                await asyncio.sleep(0.02)
            assert worker.ended == 1  # the caller half-closed the retired stream
            assert await _tokens(calls.generate(address, _req("b"), timeout=10)) == [5]
            assert worker.opened == 2 and len(told) == 2
        finally:
            await calls.close()
            await server.stop(0)
    asyncio.run(main())
