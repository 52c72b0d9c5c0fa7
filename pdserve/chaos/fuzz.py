"""A gRPC fuzzer of Gateway.Generate: random GenerateRequests (every field, legal values and
hostile ones), half of them mutated on the wire (bit flips, cut, spliced, duplicated bytes),
sent raw over real sockets. What must hold: no UNKNOWN / INTERNAL / UNAVAILABLE answer, no
crash, no KV block left in use or stranded, memory back near where it was.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
import random
import time

import grpc

from protos.pdserve.v1 import common_pb2, gateway_pb2

ALLOWED = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
           "UNAUTHENTICATED"}
WORDS = ["hello", "<|im_start|>", "<|im_end|>", "system", "\n", "日本語", "🙂", "\x00", "{{", "}}",
         "{% for %}", "\\u0000", " ", "a" * 50]


@dataclass
class FuzzReport:
    sent: int = 0
    codes: Counter = field(default_factory=Counter)
    bad: list = field(default_factory=list)  # (code, details, request bytes[:64].hex())
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"sent": self.sent, "codes": dict(self.codes), "bad": self.bad[:20],
                "seconds": round(self.seconds, 1)}


def _text(rng: random.Random, big: bool = False) -> str:
    if big and rng.random() < 0.05:
        return rng.choice(WORDS) * rng.randrange(1000, 300_000)
    return "".join(rng.choice(WORDS) if rng.random() < 0.5 else chr(rng.randrange(32, 0x2FFF))
                   for _ in range(rng.randrange(0, 40)))


def _int(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 15, 16, 255, 256, 4095, 4096, 65535, 2**31 - 1, 2**32 - 1,
                       rng.randrange(0, 600)])


def random_request(rng: random.Random, vocab: int) -> gateway_pb2.GenerateRequest:
    r = gateway_pb2.GenerateRequest()
    if rng.random() < 0.3:
        r.request_id = _text(rng, big=True)[: rng.choice([8, 300, 100_000])]
    kind = rng.random()
    if kind < 0.35:
        r.prompt = _text(rng, big=True)
    elif kind < 0.7:
        n = rng.choice([0, 1, 5, 50, 500, 5000, 70_000])
        r.prompt_token_ids.extend(rng.choice([rng.randrange(vocab), vocab, 2**32 - 1])
                                  if rng.random() < 0.02 else rng.randrange(vocab)
                                  for _ in range(n))
    elif kind < 0.95:
        for _ in range(rng.choice([0, 1, 3, 2000])):
            r.messages.add(role=rng.choice(["system", "user", "assistant", "tool", ""]),
                           content=_text(rng, big=True))
    if rng.random() < 0.1:
        r.prompt = r.prompt or _text(rng)  # two kinds of prompt at once
    if rng.random() < 0.2:
        r.model = rng.choice(["", "smollm2-135m", "dummy:tiny", _text(rng, big=True)])
    _sampling(rng, r.sampling)
    return r


def _sampling(rng: random.Random, sp: common_pb2.SamplingParams) -> None:
    if rng.random() < 0.8:
        sp.max_tokens = rng.choice([0, 1, 2, 8, 32, 2**32 - 1])
    if rng.random() < 0.6:
        sp.temperature = rng.choice([0.0, 0.7, 1.0, -1.0, 1e308, float("nan"), float("inf")])
    if rng.random() < 0.3:
        sp.top_p = rng.choice([0.0, 0.5, 1.0, 1.5, float("nan")])
    if rng.random() < 0.3:
        sp.top_k = rng.choice([-5, -1, 0, 1, 40, 2**31 - 1])
    if rng.random() < 0.3:
        sp.seed = rng.choice([0, 1, 2**63 - 1, 2**64 - 1])
    if rng.random() < 0.2:
        sp.stop.extend(_text(rng, big=rng.random() < 0.3) for _ in range(rng.choice([1, 3, 40])))
    if rng.random() < 0.2:
        sp.stop_token_ids.extend(_int(rng) for _ in range(rng.choice([1, 10, 300, 5000])))
    sp.ignore_eos = rng.random() < 0.3
    sp.logprobs = rng.random() < 0.3


def mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randrange(1, 6)):
        op = rng.random()
        if not b or op < 0.3:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        elif op < 0.6:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op < 0.75:
            del b[rng.randrange(len(b)):]
        elif op < 0.9:
            i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
            b[i:i] = b[i:j]
        else:
            b[rng.randrange(len(b))] = rng.choice([0x00, 0x80, 0xff, 0xed, 0xc0])
    return bytes(b)


async def run_fuzz(address: str, n: int, *, seed: int = 0, vocab: int = 259,
                   concurrency: int = 16, api_key: str = "",
                   timeout_s: float = 20.0) -> FuzzReport:
    rng = random.Random(seed)
    report = FuzzReport()
    md = (("authorization", f"Bearer {api_key}"),) if api_key else None
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = ch.unary_stream("/pdserve.v1.Gateway/Generate", request_serializer=None,
                               response_deserializer=None)

        async def one(raw: bytes) -> None:
            try:
                async for _ in call(raw, timeout=timeout_s, metadata=md):
                    pass
                code, details = "OK", ""
            except grpc.aio.AioRpcError as e:
                code, details = e.code().name, e.details() or ""
            report.codes[code] += 1
            if code not in ALLOWED:
                report.bad.append((code, details[:200], raw[:64].hex()))

        def requests():  # drawn in order, so a seed gives the same requests at any concurrency
            for _ in range(n):
                raw = random_request(rng, vocab).SerializeToString()
                yield mutate(rng, raw) if rng.random() < 0.5 else raw

        todo = requests()

        async def lane() -> None:  # a sliding window: no lane waits for another's slow stream
            for raw in todo:
                report.sent += 1
                await one(raw)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    report.seconds = time.monotonic() - t0
    return report


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its children (the service runs in a session)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
