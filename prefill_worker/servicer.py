"""PrefillWorker servicer: the engine in prefill role plus a KV sender.

Lifecycle of one request here:
  Prefill RPC -> engine computes the prompt (reusing its prefix cache) and samples the first
  token -> blocks HELD -> KV sent to the decode worker's receiver -> response; the blocks are
  released in the background as soon as the send ended (on DONE, FAILED, TIMED_OUT,
  cancellation or any error: the lease always ends; Stats and shutdown wait for releases).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvtransfer import KVLayout, TransferState
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import telemetry
from services.logging_setup import request_context
from services.metrics import WorkerMetrics
from services.protocol import sampling_from_proto

logger = logging.getLogger(__name__)

STATE_PB = {
    TransferState.PENDING: common_pb2.TRANSFER_STATE_PENDING,
    TransferState.TRANSFERRING: common_pb2.TRANSFER_STATE_TRANSFERRING,
    TransferState.DONE: common_pb2.TRANSFER_STATE_DONE,
    TransferState.FAILED: common_pb2.TRANSFER_STATE_FAILED,
    TransferState.TIMED_OUT: common_pb2.TRANSFER_STATE_TIMED_OUT,
    TransferState.CANCELLED: common_pb2.TRANSFER_STATE_ABORTED,
}


def layout_from_proto(pb: common_pb2.KVLayout) -> KVLayout:
    return KVLayout(pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.block_size, pb.dtype)


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, block_size=layout.block_size,
                               dtype=layout.dtype)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, aengine, runtime, senders: dict, layout: KVLayout, metrics=None):
        self.aengine = aengine
        self.runtime = runtime
        self.senders = senders  # backend name -> KVSender
        self.layout = layout
        self.metrics = metrics or WorkerMetrics("prefill")
        self.clock = telemetry.StepClock(aengine) if telemetry.ENABLED else None
        self._releases: set[asyncio.Task] = set()

    async def Prefill(self, request: worker_pb2.PrefillRequest, context):
        rid = request.request_id
        span = telemetry.server_span("prefill", context, {
            "pdserve.request_id": rid, "pdserve.prompt_tokens": len(request.prompt_token_ids),
            "pdserve.worker": self.runtime.worker_id})
        outcome = "error"
        with request_context(rid, telemetry.trace_id(span, context)):
            try:
                resp = await self._prefill(rid, request, context, span)
                outcome = "ok"
                return resp
            finally:
                self.metrics.requests.labels("prefill", outcome).inc()
                span.end()

    async def _prefill(self, rid, request, context, span):
        try:
            sp = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.model and request.model != self.runtime.model_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"this worker serves {self.runtime.model_id!r}, not {request.model!r}")
        kv = request.kv_transfer
        sender = self.senders.get(kv.backend)
        if sender is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV backend {kv.backend!r} not available here "
                                f"(have {sorted(self.senders)})")
        if layout_from_proto(kv.layout) != self.layout:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "KV layout of the decode worker does not match this worker's")
        ids = list(request.prompt_token_ids)
        t0, t0_ns = time.perf_counter(), time.time_ns()
        if self.clock is not None:
            self.clock.watch(rid)
        try:
            first = await self.aengine.prefill(rid, ids, sp)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            step = self.clock.pop(rid) if self.clock is not None else None
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        self.metrics.tokens.inc(len(first.token_ids))
        if step is not None:  # tracing on: engine wait, then the step that computed the prompt
            telemetry.child(span, "queue", start_time=t0_ns).end(end_time=step[0])
            telemetry.child(span, "prefill.compute", {
                "pdserve.prompt_tokens": len(ids),
                "pdserve.cached_tokens": first.num_cached_tokens}, start_time=step[0]
            ).end(end_time=step[1])
        span.set_attribute("pdserve.cached_tokens", first.num_cached_tokens)
        try:
            result = await self._send(rid, kv, first, sender, span)
        finally:
            # the lease ends with send(); answering need not wait for the engine thread
            # (busy with a step under load) to take the blocks back
            self._release_later(rid)
        resp = worker_pb2.PrefillResponse(
            request_id=rid, first_token_id=first.token_ids[0],
            num_cached_tokens=first.num_cached_tokens, transfer=result)
        if first.logprobs:
            resp.first_logprob = first.logprobs[0]
        logger.info("prefill %s: %d tokens (%d cached), transfer %s", rid, len(ids),
                    first.num_cached_tokens, common_pb2.TransferState.Name(result.state))
        return resp

    async def _send(self, rid, kv, first, sender, span) -> common_pb2.KVTransferResult:
        dst = list(kv.dst_block_ids)
        blocks = first.held_block_ids
        if blocks is None:
            blocks = await self.aengine.call(lambda e: e.held_blocks(rid))
        src = blocks[kv.skip_blocks:kv.skip_blocks + len(dst)]
        if first.finish_reason is not None:
            # the first token already ended the request: nothing to decode, nothing to send
            return common_pb2.KVTransferResult(transfer_id=kv.transfer_id,
                                               state=common_pb2.TRANSFER_STATE_DONE)
        if len(src) != len(dst):
            return common_pb2.KVTransferResult(
                transfer_id=kv.transfer_id, state=common_pb2.TRANSFER_STATE_FAILED,
                error=f"decode worker expects {len(dst)} blocks, prefill holds {len(src)}")
        self.runtime.active_transfers += 1
        tspan = telemetry.child(span, "kv.transfer", {
            "pdserve.kv.backend": kv.backend, "pdserve.kv.blocks": len(src),
            "pdserve.kv.transfer_id": kv.transfer_id})
        try:
            res = await sender.send(kv.transfer_id, kv.receiver_endpoint, src,
                                    max(kv.timeout_ms, 1) / 1000.0)
        except BaseException as e:
            telemetry.end_with_status(tspan, "UNKNOWN", repr(e))
            raise
        finally:
            self.runtime.active_transfers -= 1
        if tspan.is_recording():
            tspan.set_attributes({"pdserve.kv.bytes": res.num_bytes,
                                  "pdserve.kv.gbps": round(res.gbps, 4),
                                  "pdserve.kv.state": res.state.value})
            telemetry.end_with_status(tspan, "OK" if res.ok else "UNAVAILABLE", res.error or "")
        self.runtime.transferred_bytes += res.num_bytes
        self.metrics.transfer("sent", res.state.value, res.num_bytes, res.seconds)
        return common_pb2.KVTransferResult(
            transfer_id=kv.transfer_id, state=STATE_PB[res.state], error=res.error or "",
            num_blocks=len(src), num_bytes=res.num_bytes, duration_ms=res.seconds * 1000)

    def _release_later(self, rid: str) -> None:
        task = asyncio.ensure_future(_shielded(self.aengine.release(rid)))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def drain(self) -> None:
        """Wait for pending block releases (shutdown)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    async def Stats(self, request, context):
        await self.drain()  # a Stats answer never shows blocks whose release is in flight
        return await self.runtime.stats_proto()

    async def Abort(self, request, context):
        found = await self.aengine.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)


async def _shielded(coro) -> None:
    """Run a cleanup to completion even if the caller is being cancelled."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise
    except Exception:  # noqa: BLE001 - engine dead: nothing left to release
        logger.exception("cleanup failed")
