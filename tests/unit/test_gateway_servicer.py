"""GatewayServicer over real sockets against a scripted decode worker: the router's pending
prefill tokens are released at the first token, while the request is still streaming."""
from __future__ import annotations

import asyncio

import grpc

from gateway.router import Router
from gateway.server import GatewayServicer
from protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2_grpc
from pdcore.block_hash import BlockHasher

PREFILL = "127.0.0.1:1"  # never dialled: the scripted decode worker ignores it


class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Sends one token, waits for ``release``, sends the last; records what it saw."""

    def __init__(self, router: Router):
        self.router = router
        self.release = asyncio.Event()
        self.seen: dict = {}

    async def Generate(self, request, context):
        self.seen["prefill_address"] = request.prefill_address
        self.seen["pending"] = self.router.workers[PREFILL].pending_prefill_tokens
        yield common_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1])
        await self.release.wait()
        yield common_pb2.GenerateResponse(
            request_id=request.request_id, token_ids=[2], finish_reason="length",
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=2))


def test_first_token_releases_pending_prefill_tokens():
    async def go():
        decode_srv = grpc.aio.server()
        dport = decode_srv.add_insecure_port("127.0.0.1:0")
        router = Router(model="m", block_size=16, static_prefill=(PREFILL,),
                        static_decode=(f"127.0.0.1:{dport}",))
        decode = ScriptedDecode(router)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, decode_srv)
        gw = GatewayServicer(router, None, model="m", vocab_size=1000, max_model_len=4096,
                             hasher=BlockHasher("s", "m", 16), request_timeout_s=30)
        gw_srv = grpc.aio.server()
        gport = gw_srv.add_insecure_port("127.0.0.1:0")
        gateway_pb2_grpc.add_GatewayServicer_to_server(gw, gw_srv)
        await decode_srv.start()
        await gw_srv.start()
        p = router.workers[PREFILL]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gport}") as ch:
                call = gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
                    request_id="r1", prompt_token_ids=list(range(10, 50)),
                    sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=10)
                first = await call.read()
                assert list(first.token_ids) == [1]
                assert decode.seen == {"prefill_address": PREFILL, "pending": 40}
                # the prompt is computed, the request still streams
                assert p.pending_prefill_tokens == 0 and p.inflight == 1
                decode.release.set()
                last = await call.read()
                assert last.finish_reason == "length"
                assert await call.read() is grpc.aio.EOF
            for _ in range(100):  # the servicer's finally runs just after the stream ends
                if p.inflight == 0:
                    break
                await asyncio.sleep(0.01)
            assert p.pending_prefill_tokens == 0 and p.inflight == 0
        finally:
            await gw.close()
            await gw_srv.stop(0)
            await decode_srv.stop(0)
    asyncio.run(go())
