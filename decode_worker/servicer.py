"""DecodeWorker servicer: the engine in decode role (continuous batching) plus a KV receiver.

Lifecycle of one disaggregated request here:
  Generate RPC -> expect a transfer of the prompt's block count -> PrefillWorker.Prefill on
  the worker the gateway chose, while the blocks are pre-allocated (RESOURCE_EXHAUSTED if
  none; the receiver writes nothing before it has their ids) -> the prefill worker answers
  with the first token (and its text) -> the first token streams back at once -> wait for
  the KV to land -> prompt counted as computed -> joins the running batch -> the other
  tokens stream back. A failed transfer frees the blocks and is retried once per remaining
  KV backend (``--kv-backend nccl,cuda_ipc``); any other failure falls back to prefilling
  locally; a cancelled or expired call aborts the request and frees its blocks.

The first token goes out before the KV has landed (it needs neither the KV nor this worker's
engine thread, which under load is busy with a step) only when it cannot end the request
(:func:`_early_first`: more than one token asked for, not a stop or EOS token, no stop
strings). If the transfer then fails, the retry or the local prefill continues from that
token: a retry keeps it whatever the prefill worker samples again, a local prefill computes
the prompt plus that token.

A colocated worker (or a request without a prefill address) prefills locally.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import grpc

from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import telemetry
from services.grpc_server import ChannelPool
from services.kv_proto import layout_to_proto
from services.logging_setup import request_context
from services.metrics import WorkerMetrics
from services.protocol import (check_request_id, response_from_output, sampling_from_proto,
                               sampling_to_proto)

from engine.request import RequestOutput

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
            early = None  # the first token, already streamed (see _early_first)
            early_at = 0.0
            if request.prefill_address:
                for i, (backend, receiver) in enumerate(self.receivers):
                    try:
                        pending = await self._remote_prefill(
                            rid, ids, sp, request.prefill_address, context, span,
                            backend, receiver, request.prompt_token_ids, pinned=early)
                        if early is None:
                            early = _early_first(pending, ids, sp, self.aengine.engine)
                            if early is not None:
                                early_at = time.perf_counter()
                                try:
                                    yield response_from_output(early, rid)
                                except BaseException:  # the caller left: free the blocks
                                    await pending.give_up()
                                    raise
                        stream = await pending.landed()
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
                local_ids, local_sp = ids, sp
                if early is not None:  # continue after the token already streamed
                    local_ids = ids + early.token_ids
                    local_sp = dataclasses.replace(sp, max_tokens=sp.max_tokens - 1)
                try:
                    stream = self.aengine.generate(rid, local_ids, local_sp)
                    first = await stream.__anext__()
                except ValueError as e:
                    await _abort(span, context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                stream = _prepend(first, stream)
            elif early is not None:
                stream = _after_early(early, stream)
            completion = len(early.token_ids) if early is not None else 0
            dspan = telemetry.child(span, "decode")
            t_first = t_last = early_at
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
                              prompt_pb, pinned=None) -> "_PendingKV":
        """Have ``address`` prefill and send the KV, while this worker reserves the blocks
        it will land in (the prefill worker needs only their number; the receiver holds
        the data back until it has the ids). Returns once the prefill worker answered with
        the first token; :meth:`_PendingKV.landed` then waits for the KV. ``pinned``: a
        first token already streamed, which the continuation keeps."""
        num_blocks = -(-len(ids) // self.layout.block_size)
        tid = f"{rid}-{uuid.uuid4().hex[:8]}"
        kspan = telemetry.child(span, "kv.receive", {
            "pdserve.kv.backend": backend, "pdserve.kv.blocks": num_blocks,
            "pdserve.kv.transfer_id": tid})
        pending = _PendingKV(self, rid, tid, backend, receiver, kspan, pinned)
        call = None
        try:  # from here on, any way out but an answer gives the pre-allocated blocks back
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
            # transfer, which tells us in landed() how it ends
            if resp.transfer.state not in (common_pb2.TRANSFER_STATE_DONE,
                                           common_pb2.TRANSFER_STATE_TRANSFERRING):
                raise PrefillFailed(f"KV transfer over {backend} "
                                    f"{common_pb2.TransferState.Name(resp.transfer.state)}: "
                                    f"{resp.transfer.error}", transfer=True)
            pending.answered(handle, resp)
            return pending
        except BaseException:
            if call is not None:
                call.cancel()  # the prefill worker stops computing and sending
            await pending.give_up()
            raise

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


class _PendingKV:
    """A remote prefill that answered: its first token is known, its KV may still be on the
    way. ``landed()`` waits for it and returns the token stream; any failure gives the
    reserved blocks back (``give_up``)."""

    def __init__(self, servicer: DecodeServicer, rid: str, tid: str, backend: str, receiver,
                 kspan, pinned) -> None:
        self.servicer, self.rid, self.tid = servicer, rid, tid
        self.backend, self.receiver, self.kspan = backend, receiver, kspan
        self.pinned = pinned
        self.t0 = time.perf_counter()
        self.handle = None
        self.resp = None

    def answered(self, handle, resp) -> None:
        self.handle, self.resp = handle, resp

    async def landed(self):
        svc, resp = self.servicer, self.resp
        try:
            if resp.transfer.num_blocks:
                result = await self.handle.wait()
                svc.metrics.transfer("received", result.state.value, result.num_bytes,
                                     time.perf_counter() - self.t0, result.pieces)
                self.kspan.set_attributes({"pdserve.kv.bytes": result.num_bytes,
                                           "pdserve.kv.state": result.state.value})
                if not result.ok:
                    raise PrefillFailed(f"KV transfer over {self.backend} "
                                        f"{result.state.value}: {result.error}", transfer=True)
            else:  # nothing to move (the prefill worker sent no blocks)
                self.receiver.cancel(self.tid)
        except BaseException:
            await self.give_up()
            raise
        telemetry.end_with_status(self.kspan, "OK")
        if self.pinned is not None:  # a retry keeps the token already streamed
            token = self.pinned.token_ids[0]
            lp = self.pinned.logprobs[0] if self.pinned.logprobs else None
        else:
            token = resp.first_token_id
            lp = resp.first_logprob if resp.HasField("first_logprob") else None
        return svc.aengine.continue_from(self.rid, token, lp, resp.num_cached_tokens)

    async def give_up(self) -> None:
        self.receiver.cancel(self.tid)
        await _quiet(self.servicer.aengine.abort(self.rid))
        telemetry.end_with_status(self.kspan, "UNAVAILABLE")


def _early_first(pending: _PendingKV, ids: list[int], sp, engine) -> RequestOutput | None:
    """The first token as an output to stream before the KV landed, or None when it could
    end the request (then only the engine, after the commit, says how): one token asked
    for, a stop / EOS token, stop strings (which trim text), the model's length limit, or
    a prefill worker too old to send the token's text."""
    resp = pending.resp
    tok = resp.first_token_id
    if (not resp.HasField("first_text") or sp.max_tokens <= 1 or sp.stop
            or tok in sp.stop_token_ids or (not sp.ignore_eos and tok in engine.eos_token_ids)
            or len(ids) + 1 >= engine.max_model_len):
        return None
    lp = resp.first_logprob if resp.HasField("first_logprob") else None
    return RequestOutput(request_id=pending.rid, prompt_token_ids=[], token_ids=[tok],
                         text=resp.first_text,
                         logprobs=[lp] if sp.logprobs and lp is not None else None,
                         num_cached_tokens=resp.num_cached_tokens)


async def _after_early(early: RequestOutput, stream):
    """The continuation's outputs without its first one, which repeats the token already
    streamed (a finishing first output still ends the stream, with no tokens)."""
    try:
        first = await stream.__anext__()
        if first.token_ids != early.token_ids:
            logger.error("request %s: continuation starts with %s, %s was streamed",
                         early.request_id, first.token_ids, early.token_ids)
        if first.finished:
            yield dataclasses.replace(first, token_ids=[], text="", logprobs=None)
            return
        async for x in stream:
            yield x
    finally:
        await stream.aclose()
