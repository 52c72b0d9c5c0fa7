"""Gateway servicer: the gRPC front door. Thin by design: it translates a GenerateRequest
into the gateway's ClientRequest, streams what the shared request path
(gateway.pipeline) yields, and turns its errors into gRPC statuses. Imports no torch."""
from __future__ import annotations

from gateway.admission import key_id
from gateway.pipeline import ClientRequest, GatewayEnv, GatewayRequest, RequestError
from protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from services import telemetry
from services.auth import presented_key


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, env: GatewayEnv, *, request_timeout_s: float):
        self.env = env
        self.request_timeout_s = request_timeout_s

    async def close(self) -> None:
        await self.env.decode.close()
        self.env.tokenizer.close()

    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        span = telemetry.server_span("gateway.Generate", context,
                                     {"pdserve.request_id": request.request_id[:256]})
        left = context.time_remaining()
        timeout = min(left, self.request_timeout_s) if left is not None \
            else self.request_timeout_s
        creq = ClientRequest(
            label=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, messages=request.messages,
            model=request.model, sampling=request.sampling,
            api_key=key_id(presented_key(context.invocation_metadata())), timeout_s=timeout)
        req = GatewayRequest(self.env, creq, span, context)
        # the RPC ended (the client left): the decode call in flight goes too, even if this
        # generator is never resumed. The callback holds the request through a list that
        # whichever ends first empties: left in place, the reference would close a cycle
        # (context -> callback -> request -> context) that keeps a megabyte prompt alive
        # until the collector's next full pass
        held = [req]
        context.add_done_callback(lambda _ctx: held and held.pop().cut("client gone"))
        try:
            async for resp in req.run():
                yield resp
        except RequestError as e:
            await context.abort(e.code, e.message)
        finally:
            held.clear()
