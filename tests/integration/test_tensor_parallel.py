"""Tensor-parallel workers in a real cluster (CPU, gloo): prefill and decode pools of
different TP sizes exchange KV over tcp and give colocated TP=1's tokens; a rank killed
mid-request ends the worker cleanly. Four processes per test at most (the rank processes
included): Redis only where the registry is what is checked."""
from __future__ import annotations

import asyncio
import glob
import os
import signal
import time

import grpc
import pytest
import redis as redis_sync

from engine import LLM, SamplingParams
from pdserve import client
from pdserve.cluster import LocalCluster
from protos.pdserve.v1 import gateway_pb2_grpc
from tests.integration.helpers import gen_many, run, wait_all_free

MODEL = "dummy:tiny"
PROMPTS = [[1] + [(7 * i + 3 * j) % 500 + 3 for j in range(20 + 3 * i)] for i in range(6)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    with LLM(MODEL, device="cpu", dtype="float32") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                    ignore_eos=True))
    return [o.token_ids for o in outs]


def _disagg(prefill_tp: int, decode_tp: int):
    return LocalCluster(MODEL, prefill=1, decode=1, redis=False, kv_backend="tcp",
                        worker_args=("--dtype", "float32"),
                        role_args={"prefill": ("--tensor-parallel-size", str(prefill_tp)),
                                   "decode": ("--tensor-parallel-size", str(decode_tp))})


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_disaggregated_across_tp_sizes_matches_colocated_tp1(reference, prefill_tp, decode_tp):
    with _disagg(prefill_tp, decode_tp) as c:
        reqs = [client.make_request(token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                    ignore_eos=True) for p in PROMPTS]
        outs = run(gen_many(c.address, reqs))
        assert [list(o.token_ids) for o in outs] == reference
        stats = run(wait_all_free([w.address for w in c.workers]))
        assert all(s.kv_blocks_used == 0 for s in stats)
        assert sum(s.transferred_bytes for s in stats) > 0  # the KV did move over tcp


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(f) as fh:
            kids += [int(x) for x in fh.read().split()]
    return kids


def _registered(url: str) -> set[str]:
    r = redis_sync.Redis.from_url(url)
    try:
        return {k.decode() for k in r.keys("pdserve:worker:*")}
    finally:
        r.close()


async def _stream_then_kill(address: str, rank_pid: int):
    """(status code, details, seconds from the kill to the status, tokens before it)."""
    req = client.make_request(token_ids=PROMPTS[0], max_tokens=1500, temperature=0.0,
                              ignore_eos=True)
    got, killed_at = 0, None
    async with client.channel(address) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)
        try:
            async for resp in call:
                got += len(resp.token_ids)
                if killed_at is None and got >= 3:
                    os.kill(rank_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), time.monotonic() - killed_at, got
    return grpc.StatusCode.OK, "", time.monotonic() - killed_at, got


def test_a_killed_rank_ends_the_request_with_a_status_and_the_worker_cleanly():
    with LocalCluster(MODEL, prefill=0, decode=0, colocated=1,
                      worker_args=("--tensor-parallel-size", "2", "--dtype", "float32",
                                   "--max-model-len", "2048")) as c:
        worker = c.workers[0]
        ranks = _children(worker.proc.pid)
        assert len(ranks) == 1, ranks
        assert any(worker.worker_id in k for k in _registered(c.redis_url))
        code, details, waited, got = asyncio.run(_stream_then_kill(c.address, ranks[0]))
        assert got >= 3
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        assert details
        assert waited < 10, waited
        # the worker ends (its rank 0 and the registry entry with it): nothing hangs
        worker.proc.wait(15)
        assert not any(worker.worker_id in k for k in _registered(c.redis_url))
        assert any("rank 1" in line and "exited" in line for line in worker.log), \
            worker.log[-20:]
