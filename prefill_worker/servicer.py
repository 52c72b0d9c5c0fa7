"""PrefillWorker servicer: the engine in prefill role plus KV senders.

Thin: each Prefill call is a :class:`prefill_worker.call.PrefillCall` (its steps are written
out there); Stats answers from the engine's latest counters; Abort ends every call of a
request_id (CANCELLED). Blocks whose send is still ending are released in the background;
shutdown waits for those releases (:meth:`drain`).
"""
from __future__ import annotations

import asyncio
import logging

from kvtransfer import KVLayout
from protos.pdserve.v1 import common_pb2, worker_pb2_grpc
from services import telemetry
from services.calls import CallRegistry
from services.metrics import WorkerMetrics

from prefill_worker.call import PrefillCall, PrefillEnv

logger = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, aengine, runtime, senders: dict, layout: KVLayout, settings,
                 metrics=None):
        clock = telemetry.StepClock(aengine) if telemetry.ENABLED else None
        self.env = PrefillEnv(aengine, runtime, senders, layout, settings,
                              metrics or WorkerMetrics("prefill"), clock, {})
        self.calls: CallRegistry[PrefillCall] = CallRegistry()

    async def Prefill(self, request, context):
        call = PrefillCall(self.env, request, context)
        with self.calls.track(request.request_id, call):
            return await call.run()

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait for the sends still ending and their block releases."""
        releases = set(self.env.releases.values())
        if releases:
            await asyncio.wait(releases, timeout=timeout_s)

    async def Stats(self, request, context):
        return await self.env.runtime.stats_proto()

    async def Abort(self, request, context):
        calls = self.calls.with_label(request.request_id)
        await asyncio.gather(*(c.abort() for c in calls), return_exceptions=True)
        return common_pb2.AbortResponse(found=bool(calls))
