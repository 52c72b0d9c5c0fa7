"""DecodeWorker servicer: the engine in decode role (continuous batching) plus KV receivers.

Thin: each Generate call is a :class:`decode_worker.call.DecodeCall` (its steps are written
out there); GenerateMany carries many such calls on one stream (decode_worker.many); Stats
answers from the engine's latest counters without waiting for a step; Abort ends every call
of a request_id with finish_reason "abort". A colocated worker (or a request without a
prefill address) prefills locally.
"""
from __future__ import annotations

import asyncio
import logging

from protos.pdserve.v1 import common_pb2, worker_pb2_grpc
from services.calls import CallRegistry
from services.grpc_server import ChannelPool
from services.metrics import WorkerMetrics

from decode_worker.call import DecodeCall, DecodeEnv
from decode_worker.many import ManyCalls

logger = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, aengine, runtime, receivers: list, layout, settings,
                 allow_local_prefill: bool = True, metrics=None, tls=None):
        """``receivers``: ``[(backend, KVReceiver), ...]``, preferred first; a transfer that
        fails on one is retried on the next (the prefill worker's prefix cache still holds
        the prompt, so the retry costs little compute). ``tls``: the worker's cluster
        identity (mutual TLS to prefill workers)."""
        self.env = DecodeEnv(aengine, runtime, list(receivers), layout, settings,
                             metrics or WorkerMetrics("decode"),
                             ChannelPool(worker_pb2_grpc.PrefillWorkerStub, tls=tls),
                             allow_local_prefill)
        self.calls: CallRegistry[DecodeCall] = CallRegistry()
        self.streams: set[ManyCalls] = set()  # open GenerateMany streams
        self.closing = False  # shutting down: GenerateMany refuses new calls

    async def close(self) -> None:
        await self.env.peers.close()

    async def Generate(self, request, context):
        call = DecodeCall(self.env, request, context)
        with self.calls.track(request.request_id, call):
            async for resp in call.run():
                yield resp

    async def GenerateMany(self, request_iterator, context):
        many = ManyCalls(self, context)
        self.streams.add(many)
        try:
            async for resp in many.run(request_iterator):
                yield resp
        finally:
            self.streams.discard(many)

    def stop_accepting(self) -> None:
        """Shutdown began: GenerateMany streams refuse new calls (UNAVAILABLE), as the server
        refuses new Generate calls, and end once their calls are done."""
        self.closing = True
        for many in list(self.streams):
            many.close_when_idle()

    async def Stats(self, request, context):
        st = await self.env.runtime.stats_proto([r for _, r in self.env.receivers])
        st.draining = self.closing
        return st

    async def Abort(self, request, context):
        calls = self.calls.with_label(request.request_id)
        await asyncio.gather(*(c.abort() for c in calls), return_exceptions=True)
        return common_pb2.AbortResponse(found=bool(calls))

    async def evict_all(self) -> None:
        """Shutdown, once the grace period is over: every call still open ends with
        UNAVAILABLE, so its gateway resumes it on another worker."""
        calls = self.calls.all()
        if calls:
            logger.warning("shutting down with %d requests still decoding: ending them",
                           len(calls))
        await asyncio.gather(*(c.evict() for c in calls), return_exceptions=True)
