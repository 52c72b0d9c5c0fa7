"""A small gRPC client of the gateway (used by the CLI, the tests and the benchmarks)."""
from __future__ import annotations

from dataclasses import dataclass, field
import time

import grpc

from protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival time of each message
    latency_s: float = 0.0


def make_request(prompt=None, *, token_ids=None, messages=None, request_id="", max_tokens=64,
                 temperature=0.0, top_p=None, top_k=0, seed=None, stop=(), ignore_eos=False,
                 logprobs=False, model="") -> gateway_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                   stop=list(stop), ignore_eos=ignore_eos, logprobs=logprobs)
    if top_p is not None:
        sp.top_p = top_p
    if seed is not None:
        sp.seed = seed
    req = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sp, model=model)
    if prompt is not None:
        req.prompt = prompt
    if token_ids is not None:
        req.prompt_token_ids.extend(token_ids)
    for m in messages or ():
        req.messages.add(role=m["role"], content=m["content"])
    return req


async def generate(stub: gateway_pb2_grpc.GatewayStub, req: gateway_pb2.GenerateRequest,
                   timeout: float | None = None, on_text=None) -> Completion:
    c = Completion(request_id=req.request_id)
    t0 = time.perf_counter()
    async for resp in stub.Generate(req, timeout=timeout):
        now = time.perf_counter()
        if not c.token_times:
            c.ttft_s = now - t0
        c.token_times.append(now - t0)
        c.token_ids.extend(resp.token_ids)
        c.text += resp.text
        if on_text and resp.text:
            on_text(resp.text)
        if resp.finish_reason:
            c.finish_reason = resp.finish_reason
            c.prompt_tokens = resp.usage.prompt_tokens
            c.completion_tokens = resp.usage.completion_tokens
            c.cached_tokens = resp.usage.cached_tokens
        c.request_id = resp.request_id
    c.latency_s = time.perf_counter() - t0
    return c


class _BearerKey:
    """Adds ``authorization: Bearer <key>`` to every call (services/auth.py checks it)."""

    def __init__(self, key: str):
        self._header = ("authorization", f"Bearer {key}")

    def _details(self, d):
        md = grpc.aio.Metadata(*(d.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials,
                                          d.wait_for_ready)


# grpc.aio files an interceptor under the first call kind it implements: one class per kind
class _BearerKeyUnaryStream(_BearerKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerKeyUnaryUnary(_BearerKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def channel(address: str, api_key: str | None = None) -> grpc.aio.Channel:
    """A channel to the gateway; ``api_key`` (default: the client setting api_key,
    $PDSERVE_API_KEY) is sent with each call."""
    if api_key is None:
        from services.config import client_settings
        api_key = client_settings().api_key
    key = api_key
    return grpc.aio.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
        interceptors=[_BearerKeyUnaryStream(key), _BearerKeyUnaryUnary(key)] if key else None)
