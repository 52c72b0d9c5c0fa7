"""Helpers for integration tests: a real cluster, a real gRPC client."""
from __future__ import annotations

import asyncio
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve import client
from pdserve.cluster import operator_channels
from protos.pdserve.v1 import common_pb2, gateway_pb2_grpc, worker_pb2_grpc

PROMPTS = [
    "The quick brown fox", "Write a haiku about the sea.", "def fibonacci(n):",
    "List three prime numbers:", "Translate 'good morning' to French:", "Once upon a time",
    "The capital of Japan is", "Explain gravity in one sentence.", "1, 2, 3, 4,",
    "What is 12 times 12?", "import numpy as np\n", "Dear hiring manager,",
    "The mitochondria is", "Roses are red,", "SELECT * FROM", "In 1969, humans",
]


async def gen_many(address: str, reqs, timeout=180.0):
    async with client.channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        return await asyncio.gather(*(client.generate(stub, r, timeout=timeout) for r in reqs))


def run(coro):
    return asyncio.run(coro)


async def worker_stats(address: str) -> common_pb2.StatsResponse:
    """Stats of a worker of a secure cluster (as an operator) or of an insecure one."""
    error = None
    for make in operator_channels(address):
        try:
            return await _stats(make())
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            error = e
    raise error


async def _stats(channel) -> common_pb2.StatsResponse:
    async with channel as ch:
        try:
            return await worker_pb2_grpc.DecodeWorkerStub(ch).Stats(common_pb2.StatsRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise
            return await worker_pb2_grpc.PrefillWorkerStub(ch).Stats(common_pb2.StatsRequest(), timeout=5)


async def wait_all_free(addresses, timeout_s=10.0):
    """Poll until every worker reports all KV blocks free of requests; returns final stats."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = [await worker_stats(a) for a in addresses]
        if all(s.num_running == 0 and s.num_waiting == 0 and s.active_transfers == 0 for s in stats):
            # blocks still cached for prefix reuse are free (evictable): used counts only live refs
            if all(s.kv_blocks_used == 0 for s in stats):
                return stats
        if loop.time() > deadline:
            return stats
        await asyncio.sleep(0.1)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted label items): value}`` from http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
