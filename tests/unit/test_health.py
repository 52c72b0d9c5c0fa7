"""gateway.health over a real gRPC server whose Stats answers late: a worker whose decode
streams deliver meanwhile is alive (its streams are not cut); one that delivers nothing is
judged lost after ``failures`` late answers, as before."""
from __future__ import annotations

import asyncio
import time

import grpc

from gateway.health import HealthProber
from gateway.router import Router, Worker
from protos.pdserve.v1 import common_pb2, worker_pb2_grpc
from services.metrics import GatewayMetrics
from services.registry import WorkerInfo


class _SlowStats(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker whose Stats takes ``delay_s`` (its loop is busy elsewhere)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def Stats(self, request, context):
        await asyncio.sleep(self.delay_s)
        return common_pb2.StatsResponse(worker_id="d1", capacity=8)


async def _probe_thrice(delivering: bool) -> tuple[bool, list[str], float]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_SlowStats(0.6), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    router = Router(model="m", block_size=16)
    w = router.workers["d1"] = Worker(WorkerInfo(
        worker_id="d1", address=f"127.0.0.1:{port}", role="decode", model="m", capacity=8))
    cuts: list[str] = []
    w.watchers.add(cuts.append)  # a stream it serves
    metrics = GatewayMetrics()
    prober = HealthProber(router, interval_s=0.05, timeout_s=0.2, failures=2,
                          late_counter=metrics.probes_late)

    async def stream():  # what the request path does for each response it relays
        while True:
            w.heard_at = time.monotonic()
            await asyncio.sleep(0.05)

    feeder = asyncio.create_task(stream()) if delivering else None
    try:
        for _ in range(3):
            await prober.probe(w)
    finally:
        if feeder is not None:
            feeder.cancel()
        await prober.close()
        await server.stop(None)
    return w.healthy, cuts, metrics.registry.get_sample_value("pdserve_health_probes_late_total")


def test_a_late_probe_answer_from_a_worker_that_streams_is_no_strike():
    healthy, cuts, late = asyncio.run(_probe_thrice(delivering=True))
    assert healthy and cuts == [] and late == 3


def test_late_probe_answers_from_a_silent_worker_make_it_lost():
    healthy, cuts, late = asyncio.run(_probe_thrice(delivering=False))
    assert not healthy and cuts == ["lost"] and late == 0
