"""DecodeWorker servicer: the engine in decode role (continuous batching) plus a KV receiver.

Lifecycle of one disaggregated request here:
  Generate RPC -> expect a transfer of the prompt's block count -> PrefillWorker.Prefill on
  the worker the gateway chose, while the blocks are pre-allocated (RESOURCE_EXHAUSTED if
  none; the receiver writes nothing before it has their ids) -> wait for the KV to land ->
  prompt counted as computed, first token emitted -> joins the running batch -> tokens
  stream back. A failed transfer frees the blocks and is retried once per remaining KV
  backend (``--kv-backend nccl,cuda_ipc``); any other failure before the first token falls
  back to prefilling locally; a cancelled or expired call aborts the request and frees its
  blocks.

A colocated worker (or a request without a prefill address) prefills locally.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import telemetry
from services.grpc_server import ChannelPool
from services.logging_setup import request_context
from services.metrics import WorkerMetrics
from services.protocol import (check_request_id, response_from_output, sampling_from_proto,
                               sampling_to_proto)

from prefill_worker.servicer import layout_to_proto

logger = logging.getLogger(__name__)


class PrefillFailed(Exception):
    def __init__(self, message: str, transfer: bool = False) -> None:
        super().__init__(message)
        self.transfer = transfer  # the prompt was computed, moving its KV failed


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, aengine, runtime, receivers: list, layout,
                 transfer_timeout_s: float, allow_local_prefill: bool = True, metrics=None):
        """``receivers``: ``[(backend, KVReceiver), ...]``, preferred first; a transfer that
        fails on one is retried on the next (the prefill worker's prefix cache still holds
        the prompt, so the retry costs little compute)."""
        self.aengine = aengine
        self.runtime = runtime
        self.receivers = list(receivers)
        self.layout = layout
        self.transfer_timeout_s = transfer_timeout_s
        self.allow_local_prefill = allow_local_prefill
        self.metrics = metrics or WorkerMetrics("decode")
        self._peers = ChannelPool(worker_pb2_grpc.PrefillWorkerStub)

    async def close(self) -> None:
        await self._peers.close()

    async def Generate(self, request: worker_pb2.DecodeRequest, context):
        rid = request.request_id or uuid.uuid4().hex
        span = telemetry.server_span("decode.generate", context, {
            "pdserve.request_id": rid, "pdserve.prompt_tokens": len(request.prompt_token_ids),
            "pdserve.worker": self.runtime.worker_id,
            "pdserve.prefill_address": request.prefill_address})
        kind, outcome = "decode_local", "error"
        with request_context(rid, telemetry.trace_id(span, context)):
            try:
                sp = sampling_from_proto(request.sampling)
            except ValueError as e:
                await _abort(span, context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if request.model and request.model != self.runtime.model_id:
                await _abort(span, context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"this worker serves {self.runtime.model_id!r}, not {request.model!r}")
            ids = list(request.prompt_token_ids)
            if not ids:
                await _abort(span, context, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            try:
                check_request_id(rid)
            except ValueError as e:
                await _abort(span, context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            stream = None
            if request.prefill_address:
                for i, (backend, receiver) in enumerate(self.receivers):
                    try:
                        stream = await self._remote_prefill(
                            rid, ids, sp, request.prefill_address, context, span,
                            backend, receiver, request.prompt_token_ids)
                        kind = "decode_remote"
                        break
                    except ValueError as e:
                        await _abort(span, context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    except PrefillFailed as e:
                        if e.transfer and i + 1 < len(self.receivers):
                            nxt = self.receivers[i + 1][0]
                            logger.warning("request %s: %s; retrying the transfer over %s",
                                           rid, e, nxt)
                            span.add_event("kv backend fallback",
                                           {"reason": str(e)[:200], "next": nxt})
                            continue
                        if not self.allow_local_prefill:
                            await _abort(span, context, grpc.StatusCode.UNAVAILABLE, str(e))
                        logger.warning("request %s: %s; prefilling locally", rid, e)
                        span.add_event("local prefill fallback", {"reason": str(e)[:200]})
                        break
            if stream is None:
                try:
                    stream = self.aengine.generate(rid, ids, sp)
                    first = await stream.__anext__()
                except ValueError as e:
                    await _abort(span, context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                stream = _prepend(first, stream)
            completion = 0
            dspan = telemetry.child(span, "decode")
            t_first = t_last = 0.0
            try:
                async for out in stream:
                    n = len(out.token_ids)
                    if n:
                        t_last = time.perf_counter()
                        t_first = t_first or t_last
                    completion += n
                    resp = response_from_output(out, rid)
                    if out.finished:
                        resp.usage.CopyFrom(common_pb2.Usage(
                            prompt_tokens=len(ids), completion_tokens=completion,
                            cached_tokens=out.num_cached_tokens))
                        outcome = "ok"
                    yield resp
            finally:
                await stream.aclose()  # a cancelled call aborts the request and frees blocks
                self.metrics.requests.labels(kind, outcome).inc()
                self.metrics.tokens.inc(completion)
                if dspan.is_recording():
                    tpot = (t_last - t_first) / (completion - 1) if completion > 1 else 0.0
                    dspan.set_attributes({"pdserve.completion_tokens": completion,
                                          "pdserve.tpot_ms": round(tpot * 1000, 3)})
                    span.set_attribute("pdserve.completion_tokens", completion)
                dspan.end()
                telemetry.end_with_status(span, "OK" if outcome == "ok" else "CANCELLED")

    async def _remote_prefill(self, rid, ids, sp, address, context, span, backend, receiver,
                              prompt_pb):
        """Have ``address`` prefill and send the KV, while this worker reserves the blocks
        it will land in (the prefill worker needs only their number; the receiver holds
        the data back until it has the ids); returns the token stream."""
        num_blocks = -(-len(ids) // self.layout.block_size)
        tid = f"{rid}-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        kspan = telemetry.child(span, "kv.receive", {
            "pdserve.kv.backend": backend, "pdserve.kv.blocks": num_blocks,
            "pdserve.kv.transfer_id": tid})
        ok = False
        call = None
        try:  # from here on, any way out but success gives the pre-allocated blocks back
            handle = receiver.expect(tid, num_blocks, self.transfer_timeout_s)
            req = worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt_pb, sampling=sampling_to_proto(sp),
                model=self.runtime.model_id,
                kv_transfer=common_pb2.KVTransferParams(
                    transfer_id=tid, backend=backend,
                    receiver_endpoint=receiver.endpoint, num_blocks=num_blocks,
                    timeout_ms=int(self.transfer_timeout_s * 1000),
                    layout=layout_to_proto(self.layout)))
            pspan = telemetry.child(span, "prefill.remote", {"pdserve.prefill_address": address})
            # the call starts now; the blocks are reserved meanwhile (under load the engine
            # thread takes them between two steps)
            call = self._peers.stub(address).Prefill(
                req, timeout=context.time_remaining(),
                metadata=telemetry.outgoing_metadata(pspan, context))
            blocks = await self.aengine.preallocate(rid, ids, sp)  # ValueError: bad request
            if blocks is None:
                telemetry.end_with_status(pspan, "CANCELLED", "no free KV blocks")
                await _abort(span, context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "decode worker has no free KV blocks for this prompt")
            handle.assign(blocks)
            try:
                resp = await call
            except grpc.aio.AioRpcError as e:
                telemetry.end_with_status(pspan, e.code().name, e.details() or "")
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(e.details()) from None
                # FAILED_PRECONDITION: that worker lacks this backend / layout: try the next
                raise PrefillFailed(
                    f"prefill on {address} failed: {e.code().name} {e.details()}",
                    transfer=e.code() == grpc.StatusCode.FAILED_PRECONDITION) from None
            pspan.set_attribute("pdserve.cached_tokens", resp.num_cached_tokens)
            pspan.end()
            # TRANSFERRING: the prefill worker answered once our receiver had accepted the
            # transfer, which tells us below how it ends
            if resp.transfer.state not in (common_pb2.TRANSFER_STATE_DONE,
                                           common_pb2.TRANSFER_STATE_TRANSFERRING):
                raise PrefillFailed(f"KV transfer over {backend} "
                                    f"{common_pb2.TransferState.Name(resp.transfer.state)}: "
                                    f"{resp.transfer.error}", transfer=True)
            if resp.transfer.num_blocks:
                result = await handle.wait()
                self.metrics.transfer("received", result.state.value, result.num_bytes,
                                      time.perf_counter() - t0)
                kspan.set_attributes({"pdserve.kv.bytes": result.num_bytes,
                                      "pdserve.kv.state": result.state.value})
                if not result.ok:
                    raise PrefillFailed(f"KV transfer over {backend} {result.state.value}: "
                                        f"{result.error}", transfer=True)
            ok = True
        finally:
            if not ok:
                if call is not None:
                    call.cancel()  # the prefill worker stops computing and sending
                receiver.cancel(tid)
                await _quiet(self.aengine.abort(rid))
            telemetry.end_with_status(kspan, "OK" if ok else "UNAVAILABLE")
        lp = resp.first_logprob if resp.HasField("first_logprob") else None
        if not resp.transfer.num_blocks:
            receiver.cancel(tid)
        return self.aengine.continue_from(rid, resp.first_token_id, lp, resp.num_cached_tokens)

    async def Stats(self, request, context):
        return await self.runtime.stats_proto([r for _, r in self.receivers])

    async def Abort(self, request, context):
        found = await self.aengine.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)


async def _abort(span, context, code: grpc.StatusCode, message: str):
    telemetry.end_with_status(span, code.name, message)
    await context.abort(code, message)


async def _prepend(first, stream):
    try:
        yield first
        async for x in stream:
            yield x
    finally:
        await stream.aclose()


async def _quiet(coro):
    try:
        await asyncio.shield(coro)
    except Exception:  # noqa: BLE001
        pass
