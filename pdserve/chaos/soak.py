"""A soak: open-loop traffic at a fixed rate for a long time, watching every process's
resident memory and the workers' KV blocks.

:func:`capacity` measures what the cluster sustains (closed loop, ``concurrency`` streams);
:func:`soak` then sends Poisson arrivals at a given rate for ``duration_s``, samples each
process's RSS every ``sample_s``, and reports the drift of each process between the end of
the warm-up and the end of the run, with every request's outcome.

A CPU worker's KV cache is backed lazily (engine.model_runner._zeros): its pages become
resident as blocks are first used, so a worker's RSS climbs until every block has been used
once (1 GiB by default; the allocator takes never-used blocks before evicting cached ones).
That is the cache coming into use, not a leak. :func:`fill_kv_caches` uses every block
of every worker before the soak starts, so the drift it reports is what keeps growing.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
import random
import time

import grpc

from pdserve import client
from pdserve.chaos.fuzz import rss_bytes
from pdserve.chaos.streams import PROMPTS, stats
from protos.pdserve.v1 import gateway_pb2_grpc


def _request(rng: random.Random, max_tokens: int):
    prompt = " ".join(rng.choice(PROMPTS) for _ in range(rng.randrange(1, 6)))
    return client.make_request(prompt, max_tokens=rng.randrange(8, max_tokens + 1),
                               temperature=rng.choice([0.0, 0.8]), ignore_eos=True)


async def _one(stub, req, codes: Counter, timeout: float, tokens: list[int]) -> None:
    try:
        async for resp in stub.Generate(req, timeout=timeout):
            tokens[0] += len(resp.token_ids)
        codes["OK"] += 1
    except grpc.aio.AioRpcError as e:
        codes[e.code().name] += 1


async def fill_kv_caches(address: str, workers, *, concurrency: int = 4,
                         prompt_tokens: int = 128, seed: int = 7, vocab: int = 20000) -> int:
    """Send prompts of distinct random tokens (no prefix shared, one output token each)
    until their blocks cover every KV block of the largest worker's cache, 1.2 times over.
    Prompts stay short, like the soak's own: long ones grow the heap with activations that
    the allocator gives back later, which reads as the RSS shrinking. Returns the prompt
    tokens sent. Token ids are drawn from [100, ``vocab``) (``vocab`` at most the model's
    vocabulary size)."""
    sizes = [await stats(w.address, w.kind) for w in workers]
    need = int(1.2 * max(st.kv_blocks_total * st.block_size for st in sizes))
    limit = min(st.max_model_len for st in sizes if st.max_model_len) or prompt_tokens + 1
    n = max(16, min(prompt_tokens, limit - 2))
    rng = random.Random(seed)
    sent = [0]
    codes: Counter = Counter()
    async with client.channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def lane():
            while sent[0] < need:
                sent[0] += n
                req = client.make_request(token_ids=[rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)],
                                          max_tokens=1, ignore_eos=True)
                await _one(stub, req, codes, 300, [0])

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    if set(codes) != {"OK"}:
        raise RuntimeError(f"filling the KV caches failed: {dict(codes)}")
    return sent[0]


async def capacity(address: str, *, seconds: float = 60.0, concurrency: int = 16,
                   max_tokens: int = 64, seed: int = 0) -> float:
    """Requests per second the cluster completes with ``concurrency`` streams always open."""
    rng, codes, done, tokens = random.Random(seed), Counter(), 0, [0]
    deadline = time.monotonic() + seconds
    async with client.channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def loop():
            nonlocal done
            while time.monotonic() < deadline:
                await _one(stub, _request(rng, max_tokens), codes, 120, tokens)
                done += 1
        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.monotonic() - t0)


@dataclass
class SoakReport:
    rate: float
    duration_s: float
    warmup_s: float
    codes: Counter = field(default_factory=Counter)
    tokens: int = 0
    rss: dict = field(default_factory=dict)  # name -> [(t, bytes), ...]

    def drift(self) -> dict[str, float]:
        """Each process's RSS change from the end of the warm-up to the end, relative."""
        out = {}
        for name, samples in self.rss.items():
            base = [b for t, b in samples if t >= self.warmup_s]
            if base:
                out[name] = (samples[-1][1] - base[0]) / base[0]
        return out

    def to_dict(self) -> dict:
        return {"rate_req_s": self.rate, "duration_s": self.duration_s,
                "warmup_s": self.warmup_s, "codes": dict(self.codes), "tokens": self.tokens,
                "rss_mib": {n: [(round(t), b >> 20) for t, b in s] for n, s in self.rss.items()},
                "drift": {n: round(d, 4) for n, d in self.drift().items()}}


async def soak(address: str, procs: dict[str, int], *, rate: float, duration_s: float,
               warmup_s: float = 60.0, sample_s: float = 10.0, max_tokens: int = 64,
               seed: int = 1) -> SoakReport:
    """``procs``: name -> pid of the processes whose memory to watch."""
    rng = random.Random(seed)
    rep = SoakReport(rate, duration_s, warmup_s)
    rep.rss = {name: [] for name in procs}
    tokens = [0]
    t0 = time.monotonic()
    async with client.channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        tasks: set[asyncio.Task] = set()
        next_sample = 0.0
        while (now := time.monotonic() - t0) < duration_s:
            if now >= next_sample:
                for name, pid in procs.items():
                    rep.rss[name].append((now, rss_bytes(pid)))
                next_sample += sample_s
            t = asyncio.ensure_future(_one(stub, _request(rng, max_tokens), rep.codes, 120,
                                           tokens))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        rep.tokens = tokens[0]
    await asyncio.sleep(sample_s)
    for name, pid in procs.items():
        rep.rss[name].append((time.monotonic() - t0, rss_bytes(pid)))
    return rep
