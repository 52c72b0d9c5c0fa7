"""Drive a workload against a gateway: open-loop Poisson arrivals or a fixed concurrency.

Open loop (``rate``): send times are drawn up front, ``t_i = sum of Exp(rate) gaps`` from a
seeded generator, and each request is sent at its time whatever the earlier ones are doing
(an infinite rate sends everything at once). With ``concurrency`` as well, a request waits for
a free slot, so the cap can delay sends. Without a rate, ``concurrency`` clients each send
their next request as soon as the previous one ends (closed loop).

Every request has a deadline (``timeout_s``); a failed request is recorded with its gRPC
status code name (``DEADLINE_EXCEEDED``, ``RESOURCE_EXHAUSTED``, ...), ``HTTP_<status>`` (the
OpenAI API), or ``CLIENT_<Type>`` for an exception on our side, and never stops the run.

``api``: ``grpc`` drives the gateway's Generate RPC, ``openai`` its OpenAI-compatible HTTP API
(pdserve.benchlib.openai_client; the address is then the HTTP host:port).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
import itertools
import logging
import math
import random
import sys
import time
import uuid

import grpc

from pdserve import client
from pdserve.benchlib.metrics import RequestResult
from pdserve.benchlib.openai_client import HttpStatusError, OpenAIClient
from pdserve.benchlib.workload import Item
from protos.pdserve.v1 import gateway_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    rate: float | None = None  # requests/s (Poisson); math.inf: all at once
    concurrency: int | None = None  # max requests in flight
    duration_s: float | None = None  # stop sending after this long
    timeout_s: float = 300.0  # per request deadline
    temperature: float = 0.0
    seed: int = 0  # arrival times
    api: str = "grpc"  # or "openai": the HTTP API

    def __post_init__(self):
        if self.api not in ("grpc", "openai"):
            raise ValueError("api must be grpc or openai")
        if self.rate is None and not self.concurrency:
            raise ValueError("give a rate, a concurrency, or both")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")


def poisson_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of n Poisson arrivals at ``rate``; the first is at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def to_request(item: Item, tag: str, temperature: float):
    return client.make_request(item.prompt, token_ids=item.token_ids, messages=item.messages,
                               request_id=f"{tag}-{item.id}", max_tokens=item.max_tokens,
                               temperature=temperature, ignore_eos=True)


class _Progress:
    """tqdm on stderr when it is a terminal (or forced); otherwise silent."""

    def __init__(self, total: int, desc: str, enabled: bool | None):
        self.bar = None
        if enabled is False:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is normally installed
            return
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="req", leave=True,
                        disable=None if enabled is None else False, dynamic_ncols=True)

    def update(self, r: RequestResult) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if not r.ok:
                self.bar.set_postfix_str(f"last error {r.code}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.asynccontextmanager
async def _sender(address: str, load: LoadSpec):
    """``send(item, tag)`` -> a finished stream (pdserve.client.Completion or
    openai_client.Streamed: the same timing and usage fields), over ``load.api``."""
    if load.api == "openai":
        http = OpenAIClient(address)
        try:
            yield lambda item, tag: asyncio.wait_for(http.stream(item, load.temperature),
                                                     load.timeout_s)
        finally:
            await http.close()
        return
    async with client.channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        try:  # connect first: connection setup is not the first request's TTFT
            await asyncio.wait_for(ch.channel_ready(), min(load.timeout_s, 10.0))
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            pass  # unreachable: every request will fail and say why
        yield lambda item, tag: client.generate(stub, to_request(item, tag, load.temperature),
                                                timeout=load.timeout_s)


async def _one(send, item: Item, load: LoadSpec, tag: str, t0: float,
               tokens: dict[str, list[int]] | None = None) -> RequestResult:
    res = RequestResult(id=item.id, start_s=time.perf_counter() - t0)
    try:
        c = await send(item, tag)
    except grpc.aio.AioRpcError as e:
        res.code, res.error = e.code().name, (e.details() or "")[:200]
    except HttpStatusError as e:
        res.code, res.error = f"HTTP_{e.status}", e.body[:200]
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a benchmark records failures, it does not crash
        res.code, res.error = f"CLIENT_{type(e).__name__}", str(e)[:200]
    else:
        res.ok = True
        res.ttft_s, res.latency_s, res.token_times = c.ttft_s, c.latency_s, c.token_times
        res.prompt_tokens, res.cached_tokens = c.prompt_tokens, c.cached_tokens
        res.completion_tokens = c.completion_tokens or len(c.token_ids)
        res.finish_reason = c.finish_reason
        if tokens is not None:
            tokens[item.id] = list(c.token_ids)
    if not res.ok:
        res.latency_s = time.perf_counter() - t0 - res.start_s
        logger.debug("request %s failed: %s %s", item.id, res.code, res.error)
    return res


async def run_load(address: str, items: list[Item], load: LoadSpec, *, desc: str = "bench",
                   progress: bool | None = None,
                   tokens: dict[str, list[int]] | None = None) -> list[RequestResult]:
    """Send ``items`` to the gateway at ``address`` as ``load`` says; one result per sent item,
    in send order. With ``tokens``, each successful item's generated ids land there by id."""
    tag = uuid.uuid4().hex[:8]
    bar = _Progress(len(items), desc, progress)
    results: list[RequestResult] = []
    async with _sender(address, load) as send:
        t0 = time.perf_counter()

        async def tracked(item, slot=None):
            try:
                r = await _one(send, item, load, tag, t0, tokens)
            finally:
                if slot is not None:
                    slot.release()
            results.append(r)
            bar.update(r)

        def expired() -> bool:
            return load.duration_s is not None and time.perf_counter() - t0 >= load.duration_s

        try:
            if load.rate is None:  # closed loop: `concurrency` clients
                it = iter(items)

                async def user():
                    for item in it:
                        if expired():
                            return
                        await tracked(item)
                await asyncio.gather(*(user() for _ in range(load.concurrency)))
            else:
                slot = asyncio.Semaphore(load.concurrency) if load.concurrency else None
                tasks = []
                for item, at in zip(items, poisson_times(len(items), load.rate, load.seed)):
                    if load.duration_s is not None and at >= load.duration_s:
                        break
                    delay = t0 + at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if slot is not None:
                        await slot.acquire()
                    tasks.append(asyncio.create_task(tracked(item, slot)))
                await asyncio.gather(*tasks)
        finally:
            bar.close()
    results.sort(key=lambda r: r.start_s)
    return results


def cycle_items(items: list[Item], n: int) -> list[Item]:
    """The first n items of the workload repeated (ids made unique) — for --duration runs."""
    out = []
    for k, item in zip(range(n), itertools.cycle(items)):
        rep = k // len(items)
        out.append(item if rep == 0 else Item(**{**item.__dict__, "id": f"{item.id}.{rep}"}))
    return out
