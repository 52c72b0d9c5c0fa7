"""Hostile and unlucky clients against a real cluster (processes, sockets, Redis): each test
is one defect found by trying the system as such a client would (issue 21)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from pdserve import client
from pdserve.chaos.streams import greedy_requests, run_streams, settle, until
from pdserve.cluster import LocalCluster
from protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, \
    worker_pb2_grpc
from tests.integration.helpers import run, wait_all_free

KEYS = ("key-alpha", "key-beta")
CONTEXT = 1024  # the workers' context limit (the model's own is 8192)


@pytest.fixture(scope="module")
def cluster():
    env = {"PDSERVE_API_KEYS": ",".join(KEYS)}
    with LocalCluster("smollm2-135m", prefill=1, decode=1, env=env,
                      worker_args=("--max-model-len", str(CONTEXT),
                                   "--max-num-batched-tokens", "1024")) as c:
        yield c


def _stub(ch):
    return gateway_pb2_grpc.GatewayStub(ch)


async def _status(address, req, key=KEYS[0], timeout=60):
    async with client.channel(address, api_key=key) as ch:
        try:
            async for _ in _stub(ch).Generate(req, timeout=timeout):
                pass
            return "OK", ""
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details() or ""


def test_two_requests_with_one_request_id_are_independent(cluster):
    """Reusing a running request's request_id used to hang the first stream (or fail it
    UNKNOWN) and leak the decode worker's KV blocks for good."""
    reqs = []
    for i in range(5):
        r = client.make_request(f"pair {i}: tell me about rivers", max_tokens=24,
                                ignore_eos=True, request_id=f"dup-{i}")
        reqs += [r, r]
    streams = run(run_streams(cluster.address, reqs, api_key=KEYS[0], timeout=120))
    assert [s.code for s in streams] == ["OK"] * 10, [(s.code, s.message) for s in streams]
    assert all(s.finish_reason == "length" and len(s.tokens) == 24 for s in streams)
    for a, b in zip(streams[::2], streams[1::2]):
        assert a.tokens == b.tokens  # same prompt, greedy: same answer, each its own
    after = run(settle(cluster.workers))
    assert all(v["used"] == 0 and v["stranded"] == 0 for v in after.values()), after


def test_abort_rpc_ends_its_victims_stream_with_a_status(cluster):
    """The decode worker's Abort used to free the request and leave its stream hanging."""
    dec = next(w for w in cluster.workers if w.kind == "decode")

    async def main():
        async with cluster.worker_channel(dec.address) as ch:  # as the gateway
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            call = stub.Generate(worker_pb2.DecodeRequest(
                request_id="victim", prompt_token_ids=list(range(100, 160)),
                sampling=common_pb2.SamplingParams(max_tokens=5000, ignore_eos=True)),
                timeout=60)
            first = await call.read()
            assert first.token_ids
            found = await stub.Abort(common_pb2.AbortRequest(request_id="victim"), timeout=10)
            last = first
            async with asyncio.timeout(10):
                while (resp := await call.read()) is not grpc.aio.EOF:
                    last = resp
            return found.found, last
    found, last = run(main())
    assert found and last.finish_reason == "abort" and last.usage.completion_tokens > 0
    after = run(settle([dec]))
    assert all(v["used"] == 0 and v["stranded"] == 0 for v in after.values()), after


MALFORMED = [
    b"\x12\x03\xff\xfe\xfd",            # prompt: invalid UTF-8
    b"\x12\x03\xed\xa0\x80",            # prompt: a lone UTF-16 surrogate (a JavaScript client)
    b"\x22\x05\x0a\x03\xc3\x28\x41",    # messages[0].role: invalid UTF-8
    b"\xff\xff\xff\xff",                # not protobuf
    b"\x1a\x05\x01\x02",                # a truncated packed field
]


def test_malformed_wire_data_gets_invalid_argument_everywhere(cluster):
    """155 of 315 malformed requests used to get UNKNOWN naming a Python exception."""
    async def send(address, method, raw, key=None):
        md = (("authorization", f"Bearer {key}"),) if key else None
        channel = (grpc.aio.insecure_channel(address) if address == cluster.address
                   else cluster.worker_channel(address))  # a worker: as the gateway
        async with channel as ch:
            call = ch.unary_stream(method, request_serializer=None,
                                   response_deserializer=common_pb2.GenerateResponse.FromString)
            try:
                async for _ in call(raw, timeout=10, metadata=md):
                    pass
                return "OK", ""
            except grpc.aio.AioRpcError as e:
                return e.code().name, e.details()

    dec = next(w for w in cluster.workers if w.kind == "decode")
    for raw in MALFORMED:
        code, msg = run(send(cluster.address, "/pdserve.v1.Gateway/Generate", raw, KEYS[0]))
        assert code == "INVALID_ARGUMENT" and "Error" not in msg, (raw, code, msg)
        code, msg = run(send(dec.address, "/pdserve.v1.DecodeWorker/Generate", raw))
        assert code == "INVALID_ARGUMENT", (raw, code, msg)
    # without a key, the key is what is wrong
    assert run(send(cluster.address, "/pdserve.v1.Gateway/Generate", MALFORMED[0]))[0] == \
        "UNAUTHENTICATED"


def test_oversized_fields_are_refused_with_short_messages(cluster):
    """A 1 MB model name was echoed into the error (overflowing the client's metadata
    limit); stop strings and stop_token_ids had no bounds (5M ids slowed another request
    3.2x and held ~80 MB of gateway memory each)."""
    cases = {
        "model": client.make_request("hi", model="m" * 1_000_000),
        "stop count": client.make_request("hi", stop=[f"s{i}" for i in range(17)]),
        "stop length": client.make_request("hi", stop=["x" * 1025]),
        "request_id": client.make_request("hi", request_id="r" * 300),
        "messages": client.make_request(messages=[{"role": "user", "content": "x"}] * 1025),
        "role": client.make_request(messages=[{"role": "sudo", "content": "x"}]),
    }
    ids_req = client.make_request("hi")
    ids_req.sampling.stop_token_ids.extend(range(257))
    cases["stop_token_ids"] = ids_req
    for name, req in cases.items():
        code, msg = run(_status(cluster.address, req))
        assert code == "INVALID_ARGUMENT" and 0 < len(msg) < 300, (name, code, msg[:300])
    # at the limits, all is well
    ok = client.make_request("hi", max_tokens=2, stop=["x" * 1024] * 16)
    ok.sampling.stop_token_ids.extend(range(256))
    assert run(_status(cluster.address, ok)) == ("OK", "")


def test_the_gateway_knows_the_workers_context_limit(cluster):
    """The gateway admitted prompts up to the model's 8191 tokens while the workers refused
    from 4096: the client got the worker's error after routing."""
    over = client.make_request(token_ids=[100 + i % 500 for i in range(CONTEXT)], max_tokens=1)
    code, msg = run(_status(cluster.address, over))
    # refused by the gateway itself, before routing (the workers say "the context limit")
    assert code == "INVALID_ARGUMENT" and f"the workers' context limit is {CONTEXT}" in msg, msg
    fits = client.make_request(token_ids=[100 + i % 500 for i in range(CONTEXT - 8)],
                               max_tokens=4)
    assert run(_status(cluster.address, fits)) == ("OK", "")


def test_stats_answers_during_a_long_engine_step(cluster):
    """Stats used to wait behind the engine's current step (4.5 s during a long chunk)."""
    pre = next(w for w in cluster.workers if w.kind == "prefill")
    long = client.make_request(token_ids=[100 + (i * 7) % 900 for i in range(CONTEXT - 16)],
                               max_tokens=2)

    async def main():
        from pdserve.cluster import operator_channels
        from protos.pdserve.v1 import common_pb2, worker_pb2_grpc

        for make in operator_channels(pre.address):  # the first this cluster accepts
            async with make() as ch:
                stub = worker_pb2_grpc.PrefillWorkerStub(ch)
                try:  # the channel's handshake, before anything is timed
                    await stub.Stats(common_pb2.StatsRequest(), timeout=10)
                except grpc.aio.AioRpcError as e:
                    if e.code() is not grpc.StatusCode.UNAVAILABLE:
                        raise
                    continue
                task = asyncio.ensure_future(_status(cluster.address, long))
                await asyncio.sleep(0.3)  # the prefill worker is inside the prompt's step now
                t0 = time.monotonic()
                await stub.Stats(common_pb2.StatsRequest(), timeout=10)
                stats_s = time.monotonic() - t0
                t1 = time.monotonic()
                code = await task
                return stats_s, time.monotonic() - t1 + 0.3, code
        raise AssertionError("no channel to the prefill worker")
    stats_s, request_s, code = run(main())
    assert code == ("OK", "")
    assert stats_s < 0.5, (stats_s, request_s)


def test_one_api_key_cannot_fill_every_seat():
    """With two keys, one key holds at most half the decode pool's seats; the other key
    still gets in while the first is at its limit."""
    env = {"PDSERVE_API_KEYS": ",".join(KEYS)}
    with LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=1, env=env,
                      worker_args=("--max-num-seqs", "4")) as c:
        hog = [client.make_request(token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True)
               for _ in range(3)]

        async def drain(call):
            try:
                async for _ in call:
                    pass
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        async def main():
            async with client.channel(c.address, api_key=KEYS[0]) as ch:
                # key 0 asks for 3 seats while its share is 2 of the 4: one is refused
                return await asyncio.gather(*(drain(_stub(ch).Generate(r, timeout=60))
                                              for r in hog))
        codes = run(main())
        assert codes.count("RESOURCE_EXHAUSTED") == 1 and codes.count("OK") == 2, codes
        assert run(_status(c.address, client.make_request("hi", max_tokens=2),
                           key=KEYS[1])) == ("OK", "")


def test_gateway_shutdown_ends_long_streams_with_a_final_status():
    """A gateway stopping used to cut long streams with UNAVAILABLE and no finish_reason."""
    with LocalCluster("dummy:tiny", prefill=1, decode=1,
                      gateway_args=("--grace-s", "1", "--drain-delay-s", "0")) as c:
        reqs = [client.make_request(token_ids=[9, 8, 7, i], max_tokens=100_000, ignore_eos=True)
                for i in range(3)]

        async def stop(streams):
            # every stream under way (a token each) before the gateway stops: on a slow
            # machine a fixed 0.5 s left some with no token yet
            assert await until(lambda: all(s.tokens for s in streams), 60)
            os.killpg(c.gateway.proc.pid, signal.SIGTERM)
        streams = run(run_streams(c.address, reqs, during=stop, timeout=60))
        for s in streams:
            assert (s.code, s.finish_reason) == ("OK", "abort"), (s.code, s.message)
            assert s.usage[1] == len(s.tokens) > 0
        run(wait_all_free([w.address for w in c.workers], timeout_s=20))


def test_a_dead_service_is_restarted_and_the_rest_keeps_serving():
    """`pdserve up` used to tear the whole cluster down when one service died."""
    with LocalCluster("dummy:tiny", prefill=1, decode=1) as c:
        dec = next(w for w in c.workers if w.kind == "decode")
        c.kill(dec)
        events = c.supervise_once()
        assert any("decode" in e and "restarted" in e for e in events), events
        c.wait_workers_registered()
        streams = run(run_streams(c.address, greedy_requests(2, 8)))
        assert all(s.code == "OK" for s in streams)
        c.kill(c.gateway)
        assert any("gateway" in e for e in c.supervise_once())
        streams = run(run_streams(c.address, greedy_requests(2, 8)))
        assert all(s.code == "OK" for s in streams), [s.message for s in streams]


def test_a_gateway_port_taken_between_pick_and_bind_is_picked_again(monkeypatch):
    """LocalCluster picks the gateway's HTTP port free, then the gateway binds it; another
    process can take it in between (a slow-suite run once failed so: 'gateway did not
    start ... address already in use'). The cluster starts the gateway again on a new port."""
    import socket

    from pdserve import cluster as cluster_mod
    taken = socket.create_server(("127.0.0.1", 0))
    ports = [taken.getsockname()[1]]
    real = cluster_mod.free_port
    monkeypatch.setattr(cluster_mod, "free_port", lambda: ports.pop() if ports else real())
    try:
        with LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=1, http_port=0,
                          redis=False) as c:  # the gateway's HTTP port: the first one picked
            assert c.gateway.http_port != taken.getsockname()[1]
            streams = run(run_streams(c.address, greedy_requests(1, 4)))
            assert streams[0].code == "OK"
    finally:
        taken.close()
