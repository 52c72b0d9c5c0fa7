"""The gRPC bootstrap over real sockets: health, reflection, graceful shutdown, SIGTERM."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
import signal
import subprocess
import sys
import textwrap
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from google.protobuf.descriptor_pool import DescriptorPool
import pytest

from protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.grpc_server import GATEWAY_SERVICE, GrpcServer
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class SlowGateway(gateway_pb2_grpc.GatewayServicer):
    """Streams max_tokens tokens (0, 1, 2, ...), one every 50 ms."""

    async def Generate(self, request, context):
        n = request.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(0.05)
            last = i == n - 1
            yield common_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=[i], text=f"t{i}",
                finish_reason="length" if last else "",
                usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                       completion_tokens=n) if last else None)


async def read_rest(call) -> list:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def check(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return resp.status


def reflection_services(address: str) -> list[str]:
    with grpc.insecure_channel(address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = sorted(db.get_services())
        method = DescriptorPool(db).FindServiceByName(GATEWAY_SERVICE).methods_by_name["Generate"]
        assert method.output_type.full_name == "pdserve.v1.GenerateResponse"
        assert method.server_streaming
    return services


def test_health_reflection_and_graceful_drain():
    async def main():
        srv = GrpcServer([GATEWAY_SERVICE], host="127.0.0.1", port=0, grace_s=3.0,
                         drain_delay_s=0.3)
        gateway_pb2_grpc.add_GatewayServicer_to_server(SlowGateway(), srv.server)
        hook_calls = []
        srv.add_shutdown_hook(lambda: hook_calls.append("sync"))

        async def async_hook():
            hook_calls.append("async")

        srv.add_shutdown_hook(async_hook)
        port = await srv.start()
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as ch:
            assert await check(ch) == SERVING
            assert await check(ch, GATEWAY_SERVICE) == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await check(ch, "pdserve.v1.Nope")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

            services = await asyncio.to_thread(reflection_services, address)
            assert services == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                "pdserve.v1.Gateway"]

            stub = gateway_pb2_grpc.GatewayStub(ch)
            req = gateway_pb2.GenerateRequest(request_id="r1", prompt_token_ids=[5, 6],
                                              sampling=common_pb2.SamplingParams(max_tokens=12))
            call = stub.Generate(req)
            first = await call.read()  # the stream is in flight
            assert list(first.token_ids) == [0]

            stop = srv.stop()
            await asyncio.sleep(0.1)  # inside the drain delay: still answering, NOT_SERVING
            assert await check(ch) == NOT_SERVING
            assert await check(ch, GATEWAY_SERVICE) == NOT_SERVING
            assert hook_calls == ["sync", "async"]

            rest = await read_rest(call)  # the in-flight stream finishes within the grace
            assert [t for r in rest for t in r.token_ids] == list(range(1, 12))
            assert rest[-1].finish_reason == "length" and rest[-1].usage.prompt_tokens == 2
            await stop
            assert srv.stop() is stop  # idempotent

        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await check(ch)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_grace_expiry_cancels_in_flight_rpcs():
    async def main():
        srv = GrpcServer([GATEWAY_SERVICE], host="127.0.0.1", port=0, grace_s=0.2)
        gateway_pb2_grpc.add_GatewayServicer_to_server(SlowGateway(), srv.server)
        port = await srv.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
                sampling=common_pb2.SamplingParams(max_tokens=1000)))
            await call.read()
            t0 = time.monotonic()
            await srv.stop()
            assert time.monotonic() - t0 < 1.5
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await read_rest(call)
            assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)

    asyncio.run(main())


SERVER_SCRIPT = textwrap.dedent("""
    import sys
    from services.grpc_server import GATEWAY_SERVICE, GrpcServer, run
    from services.logging_setup import setup_logging

    async def main(port):
        setup_logging("test-gateway", "INFO", "json")
        srv = GrpcServer([GATEWAY_SERVICE], host="127.0.0.1", port=port, grace_s=2.0,
                         drain_delay_s=1.0)
        await srv.serve()
        print("clean exit", flush=True)

    run(main(int(sys.argv[1])))
""")


def test_sigterm_sets_not_serving_then_exits_cleanly():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            grpc.channel_ready_future(ch).result(timeout=15)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 1.0
            status = SERVING
            while status == SERVING and time.monotonic() < deadline:
                status = stub.Check(health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE),
                                    timeout=2).status
                time.sleep(0.02)
            assert status == NOT_SERVING
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "clean exit" in out
        assert '"msg": "received SIGTERM"' in err and '"service": "test-gateway"' in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_peer_back_on_its_address_is_reached_within_seconds():
    """A peer's address is dialled (health probes, one per second) while nothing listens
    there for 30 s, then a server starts on it: the pooled channel reaches it within a few
    seconds. gRPC's default reconnect backoff grows to 120 s; after 30 s of failures its
    next attempt was 5-20 s away (a restarted worker was routed around for 30-40 s)."""
    from services.grpc_server import MAX_RECONNECT_S, ChannelPool

    async def main():
        port = free_port()
        address = f"127.0.0.1:{port}"
        pool = ChannelPool(health_pb2_grpc.HealthStub)
        stub = pool.stub(address)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end:
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            await asyncio.sleep(1)
        srv = GrpcServer([GATEWAY_SERVICE], host="127.0.0.1", port=port)
        await srv.start()
        t0 = time.monotonic()
        try:
            while True:
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)
            assert time.monotonic() - t0 < MAX_RECONNECT_S + 2.0
        finally:
            await srv.stop(0.1)
            await pool.close()
    asyncio.run(main())
