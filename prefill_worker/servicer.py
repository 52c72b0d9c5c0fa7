"""PrefillWorker servicer: the engine in prefill role plus a KV sender.

Lifecycle of one request here:
  Prefill RPC -> the KV transfer to the decode worker's receiver starts (its handshake and
  each chunk's KV overlap the forward pass) -> engine computes the prompt (reusing its prefix
  cache) and samples the first token -> blocks HELD -> response, as soon as the receiver has
  accepted the transfer (state TRANSFERRING: the decode worker's receiver reports how it ends)
  or it ended (its final state) -> the blocks are released in the background once the send
  ended (on DONE, FAILED, TIMED_OUT, cancellation or any error: the lease always ends; Stats,
  shutdown and a retry of the same request id wait for releases).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.request import PrefillProgress
from kvtransfer import KVLayout, TransferState
from kvtransfer.stream import BlockStream
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import telemetry
from services.kv_proto import layout_from_proto
from services.logging_setup import request_context
from services.metrics import WorkerMetrics
from services.protocol import check_request_id, sampling_from_proto

logger = logging.getLogger(__name__)

STATE_PB = {
    TransferState.PENDING: common_pb2.TRANSFER_STATE_PENDING,
    TransferState.TRANSFERRING: common_pb2.TRANSFER_STATE_TRANSFERRING,
    TransferState.DONE: common_pb2.TRANSFER_STATE_DONE,
    TransferState.FAILED: common_pb2.TRANSFER_STATE_FAILED,
    TransferState.TIMED_OUT: common_pb2.TRANSFER_STATE_TIMED_OUT,
    TransferState.CANCELLED: common_pb2.TRANSFER_STATE_ABORTED,
}


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, aengine, runtime, senders: dict, layout: KVLayout, metrics=None):
        self.aengine = aengine
        self.runtime = runtime
        self.senders = senders  # backend name -> KVSender
        self.layout = layout
        self.metrics = metrics or WorkerMetrics("prefill")
        self.clock = telemetry.StepClock(aengine) if telemetry.ENABLED else None
        # request id -> the task that awaits its send's end and then releases its blocks. A
        # retry of the same id waits for the entry before replacing it, so these are all the
        # sends (and releases) still in flight
        self._sends: dict[str, asyncio.Future] = {}

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
            check_request_id(rid)
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
        try:
            layout = layout_from_proto(kv.layout)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV layout: {e}")
        if layout != self.layout:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "KV layout of the decode worker does not match this worker's")
        ids = list(request.prompt_token_ids)
        bs = self.layout.block_size
        prompt_blocks = -(-len(ids) // bs)
        count = kv.num_blocks or len(kv.dst_block_ids)
        if kv.num_blocks and kv.dst_block_ids and kv.num_blocks != len(kv.dst_block_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kv_transfer.num_blocks is {kv.num_blocks} but "
                                f"{len(kv.dst_block_ids)} dst_block_ids were given")
        if not count or kv.skip_blocks + count > prompt_blocks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"decode worker expects {count} blocks after "
                                f"skipping {kv.skip_blocks}; the prompt has {prompt_blocks}")
        previous = self._sends.get(rid)
        if previous is not None:  # a retry (over another backend) of a transfer still ending
            await _settled(previous)
        t0, t0_ns = time.perf_counter(), time.time_ns()
        # the send starts now: its handshake, and the KV of each prefill chunk (as it computes),
        # overlap the rest of the prompt's forward pass
        feed = _ChunkFeed(count, kv.skip_blocks, bs, len(ids))
        accepted = asyncio.Event()
        sending = asyncio.ensure_future(self._send(rid, kv, feed.stream, sender, span,
                                                   accepted))
        if self.clock is not None:
            self.clock.watch(rid)
        try:
            first = await self.aengine.prefill(rid, ids, sp, on_progress=feed.progress)
        except BaseException as e:
            # no more blocks will come: the send fails (the receiver hears why) and ends
            # before the engine frees the blocks it may be reading
            feed.fail(f"prefill failed on the prefill worker: {e!r}"[:500])
            await _settled(sending)
            if isinstance(e, ValueError):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise
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
            if first.finish_reason is not None:
                # the first token already ended the request: nothing to decode, nothing to send
                # (failing the stream ends the send however far it got)
                feed.fail("nothing to send: the request finished at its first token")
                await _settled(sending)
                result = common_pb2.KVTransferResult(transfer_id=kv.transfer_id,
                                                     state=common_pb2.TRANSFER_STATE_DONE)
            else:
                feed.finish(first.held_block_ids)
                # answer once the receiver accepted the transfer (it then learns of its end
                # itself, however it ends): the first token travels while the last KV moves
                if not (accepted.is_set() or sending.done()):
                    waiter = asyncio.ensure_future(accepted.wait())
                    try:
                        await asyncio.wait({sending, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                result = sending.result() if sending.done() else common_pb2.KVTransferResult(
                    transfer_id=kv.transfer_id, state=common_pb2.TRANSFER_STATE_TRANSFERRING,
                    num_blocks=feed.stream.total)
        except BaseException:
            if not sending.done():  # (the RPC was cancelled: the decode side gave up)
                feed.fail("prefill worker gave up the request")
                sender.cancel(kv.transfer_id)
            raise
        finally:
            # the lease ends with send(), in the background if we answer before it ends;
            # answering need not wait for the engine thread (busy with a step under load)
            # to take the blocks back
            self._release_after(rid, sending)
        resp = worker_pb2.PrefillResponse(
            request_id=rid, first_token_id=first.token_ids[0], first_text=first.text,
            num_cached_tokens=first.num_cached_tokens, transfer=result)
        if first.logprobs:
            resp.first_logprob = first.logprobs[0]
        logger.info("prefill %s: %d tokens (%d cached), transfer %s (%d parts, %.2f ms after "
                    "the prompt)", rid, len(ids), first.num_cached_tokens,
                    common_pb2.TransferState.Name(result.state), feed.parts, result.duration_ms)
        return resp

    async def _send(self, rid, kv, stream, sender, span,
                    accepted: asyncio.Event | None = None) -> common_pb2.KVTransferResult:
        self.runtime.active_transfers += 1
        tspan = telemetry.child(span, "kv.transfer", {
            "pdserve.kv.backend": kv.backend, "pdserve.kv.blocks": stream.total,
            "pdserve.kv.transfer_id": kv.transfer_id})
        try:
            res = await sender.send(kv.transfer_id, kv.receiver_endpoint, stream,
                                    max(kv.timeout_ms, 1) / 1000.0, accepted)
        except ValueError as e:  # e.g. a transfer id this worker is already sending
            telemetry.end_with_status(tspan, "INVALID_ARGUMENT", str(e))
            return common_pb2.KVTransferResult(
                transfer_id=kv.transfer_id, state=common_pb2.TRANSFER_STATE_FAILED,
                error=f"invalid transfer: {e}")
        except BaseException as e:
            telemetry.end_with_status(tspan, "UNKNOWN", repr(e))
            raise
        finally:
            self.runtime.active_transfers -= 1
        tail = res.tail_seconds if res.tail_seconds is not None else res.seconds
        if tspan.is_recording():
            tspan.set_attributes({"pdserve.kv.bytes": res.num_bytes,
                                  "pdserve.kv.tail_ms": round(tail * 1000, 3),
                                  # over the tail: the rate once the last blocks were ready
                                  "pdserve.kv.gbps": round(res.num_bytes / tail / 1e9, 4)
                                  if tail > 0 else 0.0,
                                  "pdserve.kv.state": res.state.value})
            telemetry.end_with_status(tspan, "OK" if res.ok else "UNAVAILABLE", res.error or "")
        self.runtime.transferred_bytes += res.num_bytes
        self.metrics.transfer("sent", res.state.value, res.num_bytes, tail)
        return common_pb2.KVTransferResult(
            transfer_id=kv.transfer_id, state=STATE_PB[res.state], error=res.error or "",
            num_blocks=stream.total, num_bytes=res.num_bytes, duration_ms=tail * 1000)

    def _release_after(self, rid: str, sending: asyncio.Future) -> None:
        """Once the send ended, give the request's blocks back (the lease ends with send()).
        A new Prefill of the same request id (a retry over another backend) waits for it."""
        prior = self._sends.get(rid)  # normally None or ended (a retry waits for it first)

        async def release() -> None:
            try:
                await _settled(sending)
            finally:
                await _shielded(self.aengine.release(rid))
                if prior is not None:  # stays drainable through this entry
                    await _settled(prior)

        task = asyncio.ensure_future(release())
        self._sends[rid] = task

        def done(t: asyncio.Future) -> None:
            if self._sends.get(rid) is t:
                del self._sends[rid]
        task.add_done_callback(done)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait for the sends still ending and their block releases (shutdown: all of them;
        Stats: for at most ``timeout_s``)."""
        if self._sends:
            await asyncio.wait(set(self._sends.values()), timeout=timeout_s)

    async def Stats(self, request, context):
        # a Stats answer does not show blocks whose release is in flight (unless a transfer
        # is still running after a second: then its blocks are in use)
        await self.drain(timeout_s=1.0)
        return await self.runtime.stats_proto()

    async def Abort(self, request, context):
        found = await self.aengine.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)


class _ChunkFeed:
    """Feeds a transfer's BlockStream from the engine: the blocks each prefill chunk fills,
    handed over as soon as the chunk is queued on the device, with the events that complete
    once its KV (per layer, on a GPU) is written; full blocks only, but for the last chunk,
    which completes the prompt's partial last block too. Transfer block ``i`` is the
    prompt's block ``skip + i`` (the decode worker already holds the first ``skip``)."""

    def __init__(self, total: int, skip: int, block_size: int, prompt_tokens: int) -> None:
        self.stream = BlockStream(total)
        self.total, self.skip, self.block_size = total, skip, block_size
        self.prompt_tokens = prompt_tokens
        self.handed = 0
        self.parts = 0  # extends so far (one per prefill chunk that completed blocks)

    def progress(self, p: PrefillProgress) -> None:
        if p.reset:
            self.fail("the prefill was preempted on the prefill worker (its blocks were freed)")
            return
        done = p.num_computed_tokens
        # the last chunk completes the prompt's partial last block too
        full = -(-done // self.block_size) if done >= self.prompt_tokens else \
            done // self.block_size
        self._hand(p.block_ids, min(full, self.skip + self.total), p.ready, p.layer_ready)

    def finish(self, block_ids: list[int] | None) -> None:
        if not block_ids or len(block_ids) - self.skip < self.total:
            have = len(block_ids or []) - self.skip
            self.fail(f"decode worker expects {self.total} blocks, prefill holds {have}")
            return
        self._hand(block_ids, self.skip + self.total, None)

    def _hand(self, block_ids: list[int], upto: int, ready, layers=None) -> None:
        start = self.skip + self.handed
        if upto > start and not self.stream.failed:
            self.stream.extend(block_ids[start:upto], ready, layers)
            self.handed = upto - self.skip
            self.parts += 1

    def fail(self, reason: str) -> None:
        if not self.stream.complete:
            self.stream.fail(reason)


async def _settled(task: asyncio.Future) -> None:
    """Wait for ``task`` to end, whatever its outcome (it reports its own failures)."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise
    except Exception:  # noqa: BLE001 - the send's own result/span says what went wrong
        pass


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
