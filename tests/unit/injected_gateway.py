"""A Gateway that answers with known, injected latencies (for tests of `pdserve bench`).

A prompt's words set its behaviour: ``ttft=MS`` (delay before the first token), ``itl=MS``
(gap between tokens), ``fail=CODE`` (abort with that gRPC status), ``hang``. It reports
``cached_tokens`` as half the prompt's words. ``python -m tests.unit.injected_gateway`` serves
on a free port and prints ``PORT <n>``.
"""
from __future__ import annotations

import asyncio

import grpc

from protos.pdserve.v1 import common_pb2, gateway_pb2_grpc


class InjectedGateway(gateway_pb2_grpc.GatewayServicer):
    async def Generate(self, request, context):
        opts = dict(w.partition("=")[::2] for w in request.prompt.split())
        if "fail" in opts:
            await context.abort(grpc.StatusCode[opts["fail"]], "injected failure")
        if "hang" in opts:
            await asyncio.sleep(3600)
        await asyncio.sleep(float(opts.get("ttft", 0)) / 1000)
        n = request.sampling.max_tokens
        prompt_tokens = len(request.prompt.split())
        for i in range(n):
            if i:
                await asyncio.sleep(float(opts.get("itl", 0)) / 1000)
            last = i == n - 1
            yield common_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=[i], text="x",
                finish_reason="length" if last else "",
                usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=n,
                                       cached_tokens=prompt_tokens // 2) if last else None)


async def _serve() -> None:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(InjectedGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_serve())
