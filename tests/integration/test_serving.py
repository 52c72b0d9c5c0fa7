"""Disaggregated serving end to end: real processes, real Redis, real gRPC and KV transfer."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve import client
from pdserve.cluster import LocalCluster
from protos.pdserve.v1 import gateway_pb2_grpc
from tests.integration.helpers import PROMPTS, gen_many, run, scrape, wait_all_free

MAX_TOKENS = 24
PROMPTS32 = PROMPTS + [p + " Tell me more." for p in PROMPTS]


@pytest.fixture(scope="module")
def reference():
    llm = LLM("smollm2-135m")
    outs = llm.generate(PROMPTS32, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def cluster_2p2d():
    with LocalCluster("smollm2-135m", prefill=2, decode=2, metrics=True) as c:
        yield c


def _reqs(prompts):
    return [client.make_request(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in prompts]


def test_1p1d_matches_engine(reference):
    with LocalCluster("smollm2-135m", prefill=1, decode=1) as c:
        outs = run(gen_many(c.address, _reqs(PROMPTS32)))
        assert [o.token_ids for o in outs] == reference
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        stats = run(wait_all_free([w.address for w in c.workers]))
        assert all(s.kv_blocks_used == 0 for s in stats)
        assert stats[1].transferred_bytes > 0 or stats[0].transferred_bytes > 0


def test_2p2d_matches_engine(cluster_2p2d, reference):
    outs = run(gen_many(cluster_2p2d.address, _reqs(PROMPTS32)))
    assert [o.token_ids for o in outs] == reference
    # both pools were used
    stats = run(wait_all_free([w.address for w in cluster_2p2d.workers]))
    assert all(s.transferred_bytes > 0 for s in stats), [s.transferred_bytes for s in stats]


def test_prefix_aware_routing(cluster_2p2d):
    """4 long shared prefixes over 2 prefill workers: later requests of a prefix go to the
    worker that holds it, and report cached tokens.

    A decision the gateway made without the index (its Redis lookup timed out: on a 2-core
    machine the gateway's event loop can stall past redis_timeout_s while four workers
    compute) is load-only by design; the gateway counts those (``load_only``), so they are
    told apart here rather than counted as routing misses, and the requests go 4 at a time,
    in rounds until enough decisions were informed."""
    prefixes = [f"System prompt {i}: " + ("You are a careful assistant for topic %d. " % i) * 12
                for i in range(4)]
    users = ["Hi!", "What is 2+2?", "Name a color.", "Say yes.", "Count to 3.", "Bye."]
    load_only = ("pdserve_routing_decisions_total", (("mode", "load_only"),))

    def blind_count() -> float:
        return scrape(cluster_2p2d.gateway.metrics_port).get(load_only, 0)

    async def go():
        """The first request of each prefix, then the others a prefix per request, 4 at a
        time, again (up to 3 rounds) until 16 decisions were made with the index."""
        outs, blind = [], 0
        async with client.channel(cluster_2p2d.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            firsts = [client.make_request(p + users[0], max_tokens=2, temperature=0.0) for p in prefixes]
            await asyncio.gather(*(client.generate(stub, r, timeout=120) for r in firsts))
            await asyncio.sleep(0.5)  # index publication is asynchronous (~50 ms)
            for _ in range(3):
                for u in users[1:]:
                    before = blind_count()
                    group = [client.make_request(p + u, max_tokens=2, temperature=0.0)
                             for p in prefixes]
                    outs += await asyncio.gather(*(client.generate(stub, r, timeout=120)
                                                   for r in group))
                    blind += int(blind_count() - before)
                if len(outs) - blind >= 16:
                    break
        return outs, blind
    outs, blind = run(go())
    hits = sum(o.cached_tokens > 0 for o in outs)
    detail = ([o.cached_tokens for o in outs], f"{blind} routed without the index")
    assert len(outs) - blind >= 16, detail
    assert hits >= 0.9 * (len(outs) - blind), detail


def test_bad_requests_get_invalid_argument(cluster_2p2d):
    async def status(req):
        async with client.channel(cluster_2p2d.address) as ch:
            try:
                await client.generate(gateway_pb2_grpc.GatewayStub(ch), req, timeout=30)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
        return grpc.StatusCode.OK, ""
    cases = [
        client.make_request(""),
        client.make_request("hi", max_tokens=0),
        client.make_request("hi", temperature=-1),
        client.make_request("hi", top_p=1.5),
        client.make_request("hi", model="no-such-model"),
        client.make_request(token_ids=[10**9]),
        client.make_request("word " * 9000),
        client.make_request("hi", request_id="r" * 300),
    ]
    for req in cases:
        code, details = run(status(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (req, code, details)
        assert details and "transfer" not in details  # says what the client sent wrong
    # the cluster still serves after all that
    assert run(gen_many(cluster_2p2d.address, _reqs(["Hello"])))[0].completion_tokens > 0


def test_cancel_and_deadline_free_all_blocks(cluster_2p2d):
    addrs = [w.address for w in cluster_2p2d.workers]

    async def cancel_mid_stream():
        async with client.channel(cluster_2p2d.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            call = stub.Generate(client.make_request("Write a long story about a dragon.",
                                                     max_tokens=400, ignore_eos=True))
            n = 0
            async for _ in call:
                n += 1
                if n == 5:
                    call.cancel()
                    break
            return n

    async def deadline():
        async with client.channel(cluster_2p2d.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            try:
                await client.generate(stub, client.make_request(
                    "Write a long story about a knight.", max_tokens=400, ignore_eos=True),
                    timeout=1.0)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    assert run(cancel_mid_stream()) == 5
    stats = run(wait_all_free(addrs))
    assert all(s.kv_blocks_used == 0 and s.num_running == 0 for s in stats), stats
    assert run(deadline()) == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = run(wait_all_free(addrs))
    assert all(s.kv_blocks_used == 0 and s.num_running == 0 for s in stats), stats


def test_1p1d_streams_the_kv_of_chunked_prefills():
    """Prompts longer than the step budget prefill in chunks; the prefill worker sends each
    finished chunk's KV while the next computes (the send starts with the request). The
    decode worker continues token-exact with an engine using the same chunking."""
    prompts = [f"Story {i}: " + "The river bends past the old mill and the stone bridge. " * 6
               for i in range(6)]
    chunk = ("--max-num-batched-tokens", "32")
    ref = LLM("smollm2-135m", max_num_batched_tokens=32).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    with LocalCluster("smollm2-135m", prefill=1, decode=1, worker_args=chunk) as c:
        outs = run(gen_many(c.address, _reqs(prompts)))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert all(len(r.prompt_token_ids) > 64 for r in ref)  # at least 3 chunks each
        stats = run(wait_all_free([w.address for w in c.workers]))
        assert all(s.kv_blocks_used == 0 for s in stats)
        assert sum(s.transferred_bytes for s in stats) > 0


def test_request_ending_at_its_first_token_sends_no_kv(cluster_2p2d):
    """max_tokens=1: the prefill worker's first token ends the request; the transfer it had
    started ends at once (no wait for its timeout) and every block is freed."""
    t0 = time.monotonic()
    outs = run(gen_many(cluster_2p2d.address, [
        client.make_request(p, max_tokens=1, temperature=0.0) for p in PROMPTS[:4]]))
    assert time.monotonic() - t0 < 10
    assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in outs)
    stats = run(wait_all_free([w.address for w in cluster_2p2d.workers]))
    assert all(s.kv_blocks_used == 0 for s in stats)


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker():
    """--local-prefill-max-tokens 48 with no queue threshold: prompts of <= 48 tokens are
    prefilled by the decode worker itself, longer ones by the prefill worker; the tokens are
    the engine's either way (dummy:tiny, fp32)."""
    lens = [7, 30, 48, 49, 120]
    prompts = [[10 + (i * 37 + j * 11) % 200 for j in range(n)] for i, n in enumerate(lens)]
    ref = LLM("dummy:tiny").generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                             ignore_eos=True))
    # a decode-side cap that never binds here (its rule: tests/unit/test_router.py)
    gateway_args = ("--local-prefill-max-tokens", "48", "--local-prefill-queue-tokens", "0",
                    "--local-prefill-decode-tokens", "100000")
    with LocalCluster("dummy:tiny", prefill=1, decode=1, metrics=True,
                      gateway_args=gateway_args) as c:
        reqs = [client.make_request(token_ids=p, max_tokens=8, ignore_eos=True)
                for p in prompts]
        outs = run(gen_many(c.address, reqs))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        eager = ("pdserve_engine_steps_total", (("path", "eager"),))
        done = [("pdserve_worker_requests_total", (("kind", k), ("outcome", "ok")))
                for k in ("decode_local", "decode_remote")]
        # engine stats reach /metrics every 0.25 s; a worker counts a request once its
        # stream has ended, just after the client got the last message
        deadline = time.monotonic() + 5
        while True:
            gw, pre, dec = (scrape(s.metrics_port) for s in (c.gateway, *c.workers))
            if (min(pre.get(eager, 0), dec.get(eager, 0)) > 0
                    and sum(dec.get(k, 0) for k in done) >= 5) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert gw[("pdserve_routing_decisions_total", (("mode", "local_prefill"),))] == 3
    assert sum(v for (n, lab), v in gw.items() if n == "pdserve_routing_decisions_total") == 5
    assert gw[("pdserve_pending_prefill_tokens", ())] == 0
    ok = (("kind", "prefill"), ("outcome", "ok"))
    assert pre[("pdserve_worker_requests_total", ok)] == 2
    for kind, n in (("decode_local", 3), ("decode_remote", 2)):
        assert dec[("pdserve_worker_requests_total", (("kind", kind), ("outcome", "ok")))] == n
    for w in (pre, dec):  # model runs by path: all eager on the CPU
        assert w[eager] > 0
        assert w[("pdserve_engine_steps_total", (("path", "mixed_graph"),))] == 0
