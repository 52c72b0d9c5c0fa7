"""Client side of the chaos scenarios: greedy streams whose progress a scenario watches, and
the workers' block accounting afterwards."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
import time

import grpc

from pdserve import client
from protos.pdserve.v1 import common_pb2, gateway_pb2_grpc, worker_pb2_grpc

PROMPTS = [
    "The history of the printing press begins", "Write a short story about a lighthouse",
    "Explain how a refrigerator works", "List the planets of the solar system and",
    "def merge_sort(items):", "A recipe for bread: first,", "The causes of the French Revolution",
    "Dear friend, I am writing to tell you", "In mathematics, a prime number",
    "The best way to learn a language is",
]


@dataclass
class Stream:
    """What one client saw of one request."""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    code: str = "OK"
    message: str = ""
    usage: tuple[int, int] = (0, 0)  # prompt, completion tokens
    gaps: list[float] = field(default_factory=list)  # seconds between messages
    done_s: float = 0.0


def greedy_requests(n: int, max_tokens: int, tag: str = "") -> list:
    return [client.make_request(f"{tag}{PROMPTS[i % len(PROMPTS)]} (#{i})",
                                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for i in range(n)]


async def _one(stub, req, out: Stream, timeout: float) -> None:
    t0 = last = time.monotonic()
    try:
        async for resp in stub.Generate(req, timeout=timeout):
            now = time.monotonic()
            out.gaps.append(now - last)
            last = now
            out.tokens.extend(resp.token_ids)
            out.text += resp.text
            if resp.finish_reason:
                out.finish_reason = resp.finish_reason
                out.usage = (resp.usage.prompt_tokens, resp.usage.completion_tokens)
    except grpc.aio.AioRpcError as e:
        out.code, out.message = e.code().name, e.details() or ""
    out.done_s = time.monotonic() - t0


async def run_streams(address: str, reqs, *, timeout: float = 180.0, during=None,
                      api_key: str | None = None) -> list[Stream]:
    """Run ``reqs`` concurrently; ``during(streams)`` (a coroutine function) runs alongside,
    e.g. to inject a fault once the streams are under way."""
    streams = [Stream() for _ in reqs]
    async with client.channel(address, api_key=api_key) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        tasks = [asyncio.ensure_future(_one(stub, r, s, timeout)) for r, s in zip(reqs, streams)]
        if during is not None:
            await during(streams)
        await asyncio.gather(*tasks)
    return streams


async def until(pred, timeout_s: float, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(poll_s)
    return pred()


async def stats(address: str, role: str, timeout: float = 3.0) -> common_pb2.StatsResponse:
    """A worker's Stats, as an operator of a secure local cluster (this process's cluster
    identity) or, where that is refused at the handshake, over plaintext (--insecure)."""
    from pdserve.cluster import operator_channels
    stub_cls = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill"
                else worker_pb2_grpc.DecodeWorkerStub)
    error = None
    for make in operator_channels(address):
        async with make() as ch:
            try:
                return await stub_cls(ch).Stats(common_pb2.StatsRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                error = e
    raise error


async def settle(workers, timeout_s: float = 20.0) -> dict[str, dict]:
    """Wait until every live worker is idle with no block in use and none stranded (the
    stranded audit runs about once a second); returns each worker's final figures."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = {}
        for w in workers:
            try:
                st = await stats(w.address, w.kind)
            except grpc.aio.AioRpcError as e:
                out[w.address] = {"error": e.code().name}
                continue
            out[w.address] = {"used": st.kv_blocks_used, "stranded": st.kv_blocks_stranded,
                              "running": st.num_running, "waiting": st.num_waiting,
                              "transfers": st.active_transfers}
        clean = all(v.get("used") == 0 and v.get("stranded") == 0 and v.get("running") == 0
                    and v.get("waiting") == 0 for v in out.values())
        if clean or time.monotonic() > deadline:
            return out
        await asyncio.sleep(0.25)
