"""One PrefillWorker.Prefill call, step by step.

  1. validate: the shared request checks, the KV backend and layout, the block counts;
     nothing is computed or sent before they pass. The call gets its own internal id.
  2. send: the KV transfer to the decode worker's receiver starts (its handshake and each
     chunk's KV overlap the forward pass: prefill_worker.feed).
  3. compute: the engine computes the prompt (reusing its prefix cache), samples the first
     token and HOLDS the blocks.
  4. answer: as soon as the receiver accepted the transfer (state TRANSFERRING: the decode
     worker's receiver reports how it ends) or the send ended (its final state).
  5. release: once the send ended (DONE, FAILED, TIMED_OUT, cancellation, abort or any
     error) the blocks go back, in the background: the lease always ends. The send always
     ends before the blocks it reads are freed.
Abort ends the call with CANCELLED (its send first, then its blocks).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
import logging
import time

import grpc

from engine.async_engine import EngineDeadError
from engine.request import FinishReason
from kvtransfer import TransferState
from pdcore.ids import new_id
from services.kv_proto import heads_from_proto, layout_from_proto
from protos.pdserve.v1 import common_pb2, worker_pb2
from services import telemetry, validation
from services.logging_setup import request_context
from services.membership import MembershipUnknown, NotMember
from services.protocol import top_logprobs_to_proto
from services.validation import InvalidRequest

from prefill_worker.feed import ChunkFeed

logger = logging.getLogger(__name__)

STATE_PB = {
    TransferState.PENDING: common_pb2.TRANSFER_STATE_PENDING,
    TransferState.TRANSFERRING: common_pb2.TRANSFER_STATE_TRANSFERRING,
    TransferState.DONE: common_pb2.TRANSFER_STATE_DONE,
    TransferState.FAILED: common_pb2.TRANSFER_STATE_FAILED,
    TransferState.TIMED_OUT: common_pb2.TRANSFER_STATE_TIMED_OUT,
    TransferState.CANCELLED: common_pb2.TRANSFER_STATE_ABORTED,
}


def _layout_text(layout) -> str:
    return (f"{layout.dtype} x {layout.num_layers} layers x {layout.num_kv_heads} heads x "
            f"{layout.head_dim} per row, blocks of {layout.block_size}")


@dataclass
class PrefillEnv:
    """What every call of one prefill worker shares."""
    aengine: object
    runtime: object  # services.worker_runtime.WorkerRuntime
    senders: dict  # backend name -> KVSender
    layout: object
    settings: object  # services.config.WorkerSettings
    metrics: object
    clock: object  # telemetry.StepClock or None
    releases: dict  # internal id -> the task that releases the call's blocks

    @property
    def engine(self):
        return self.aengine.engine


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Request:
    ids: list[int]
    output_ids: list[int]
    sp: object
    kv: common_pb2.KVTransferParams
    sender: object
    count: int  # blocks to send


class PrefillCall:
    def __init__(self, env: PrefillEnv, request, context) -> None:
        self.env, self.request, self.context = env, request, context
        self.label = request.request_id
        self.rid = new_id()
        self.log_id = self.label[:64] or self.rid  # logs: the caller's id (every hop's)
        self.span = telemetry.server_span("prefill", context, {
            "pdserve.request_id": self.label, "pdserve.internal_id": self.rid,
            "pdserve.prompt_tokens": len(request.prompt_token_ids),
            "pdserve.worker": env.runtime.worker_id})
        self.req: _Request | None = None
        self.feed: ChunkFeed | None = None
        self.sending: asyncio.Future | None = None
        self.stopped = False

    async def abort(self) -> None:
        """End the call: its send first (it may be reading the blocks), then its blocks."""
        self.stopped = True
        if self.feed is not None:
            self.feed.fail("the prefill was aborted")
        if self.sending is not None and not self.sending.done():
            self.req.sender.cancel(self.req.kv.transfer_id)
            await _settled(self.sending)
        await self.env.aengine.abort(self.rid)

    # ------------------------------------------------------------------- run
    async def run(self) -> worker_pb2.PrefillResponse:
        outcome = "error"
        # logs carry the caller's id for the request (the gateway's, on every hop)
        with request_context(self.log_id,
                             telemetry.trace_id(self.span, self.context)):
            try:
                self.req = self._validate()
                await validation.compile_constraint(self.env.engine, self.req.sp)
                await self._admit_receiver()
                resp = await self._serve()
                outcome = "ok"
                return resp
            except InvalidRequest as e:
                await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
            except _Refused as e:
                await self.context.abort(e.code, str(e))
            except EngineDeadError as e:  # e.g. a tensor-parallel rank died
                await self.context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker's engine "
                                         f"failed: {validation.clip(str(e), 300)}")
            finally:
                self.env.metrics.requests.labels("prefill", outcome).inc()
                self.span.end()

    def _validate(self) -> _Request:
        r, env = self.request, self.env
        limits = env.settings.limits
        validation.check_label(r.request_id, limits)
        sp = validation.sampling(r.sampling, limits)
        validation.check_model(r.model, env.runtime.model_id, limits)
        if not r.prompt_token_ids:
            raise InvalidRequest("prompt is empty")
        vocab = env.engine.model_config.vocab_size
        ids = validation.check_token_ids(r.prompt_token_ids, vocab)
        outs = validation.check_token_ids(r.output_token_ids, vocab, "output")
        validation.check_context(len(ids), len(outs), env.engine.max_model_len)
        validation.check_sampling_vocab(sp, vocab)
        kv = r.kv_transfer
        sender = env.senders.get(kv.backend)
        if sender is None:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"KV backend {validation.clip(kv.backend, 40)} not available here "
                           f"(have {sorted(env.senders)})")
        self._check_layout(kv.layout)
        return _Request(ids, outs, sp, kv, sender, self._block_count(kv, len(ids) + len(outs)))

    async def _admit_receiver(self) -> None:
        """The receiver must be a cluster member's (services/membership.py)."""
        try:
            await self.env.runtime.members.admit(self.req.kv.receiver_endpoint, "receiver")
        except NotMember as e:
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED, str(e)) from None
        except MembershipUnknown as e:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    def _check_layout(self, pb) -> None:
        try:
            layout = layout_from_proto(pb)
        except ValueError as e:
            raise InvalidRequest(f"bad KV layout: {e}") from None
        if layout != self.env.layout:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"KV layout of the decode worker does not match this worker's: "
                           f"{_layout_text(layout)} there, {_layout_text(self.env.layout)} "
                           "here (kv_dtype int8 / fp8: int8/slab, fp8/slab, head_dim + 4 bytes "
                           "per token and head)")
        # blocks carry every KV head whatever either side's TP size (engine.parallel.driver)
        tp, start, end = heads_from_proto(pb)
        mine = self.env.engine.kv_heads
        if (start, end) != (0, layout.num_kv_heads) or mine != (0, layout.num_kv_heads):
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"KV heads differ: the decode worker (TP {tp}) takes heads "
                           f"[{start}, {end}), this worker sends [{mine[0]}, {mine[1]}) of "
                           f"{layout.num_kv_heads}")

    def _block_count(self, kv, num_tokens: int) -> int:
        prompt_blocks = -(-num_tokens // self.env.layout.block_size)
        count = kv.num_blocks or len(kv.dst_block_ids)
        if kv.num_blocks and kv.dst_block_ids and kv.num_blocks != len(kv.dst_block_ids):
            raise InvalidRequest(f"kv_transfer.num_blocks is {kv.num_blocks} but "
                                 f"{len(kv.dst_block_ids)} dst_block_ids were given")
        if not count or kv.skip_blocks + count > prompt_blocks:
            raise InvalidRequest(f"decode worker expects {count} blocks after skipping "
                                 f"{kv.skip_blocks}; the prompt has {prompt_blocks}")
        return count

    # ---------------------------------------------------------------- serve
    async def _serve(self) -> worker_pb2.PrefillResponse:
        req, t0 = self.req, time.perf_counter()
        self.feed = ChunkFeed(req.count, req.kv.skip_blocks, self.env.layout.block_size,
                              len(req.ids) + len(req.output_ids))
        accepted = asyncio.Event()
        # step 2: the send starts now; its handshake and the KV of each prefill chunk (as it
        # computes) overlap the rest of the prompt's forward pass
        self.sending = asyncio.ensure_future(self._send(accepted))
        try:
            first = await self._compute(time.time_ns())
            result = await self._answer(first, accepted)
        except BaseException:
            if not self.sending.done():  # (the RPC was cancelled: the decode side gave up)
                self.feed.fail("prefill worker gave up the request")
                req.sender.cancel(req.kv.transfer_id)
            raise
        finally:
            self._release_after()  # step 5
        self.env.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        return self._response(first, result)

    async def _compute(self, t0_ns: int):
        """Step 3."""
        env, req = self.env, self.req
        if env.clock is not None:
            env.clock.watch(self.rid)
        try:
            first = await env.aengine.prefill(self.rid, req.ids, req.sp,
                                              on_progress=self.feed.progress,
                                              output_token_ids=req.output_ids,
                                              abort_on_error=False)
        except BaseException as e:
            # no more blocks will come: the send fails (the receiver hears why) and ends
            # before the engine frees the blocks it may be reading
            self.feed.fail(f"prefill failed on the prefill worker: {e!r}"[:500])
            try:
                await _settled(self.sending)
            finally:
                await _shielded(env.aengine.abort(self.rid))
            if isinstance(e, ValueError):
                raise InvalidRequest(str(e)) from None
            raise
        finally:
            step = env.clock.pop(self.rid) if env.clock is not None else None
        if first.finish_reason is FinishReason.ABORT or self.stopped:
            await _settled(self.sending)
            raise _Refused(grpc.StatusCode.CANCELLED, "the prefill was aborted")
        self._trace_compute(first, step, t0_ns)
        env.metrics.tokens.inc(len(first.token_ids))
        return first

    def _trace_compute(self, first, step, t0_ns: int) -> None:
        self.span.set_attribute("pdserve.cached_tokens", first.num_cached_tokens)
        if step is not None:  # tracing on: engine wait, then the step that computed the prompt
            telemetry.child(self.span, "queue", start_time=t0_ns).end(end_time=step[0])
            telemetry.child(self.span, "prefill.compute", {
                "pdserve.prompt_tokens": len(self.req.ids),
                "pdserve.cached_tokens": first.num_cached_tokens}, start_time=step[0]
            ).end(end_time=step[1])

    async def _answer(self, first, accepted: asyncio.Event) -> common_pb2.KVTransferResult:
        """Step 4: the transfer's state to answer with."""
        kv = self.req.kv
        if first.finish_reason is not None and self.req.sp.n <= 1:
            # the first token already ended the request: nothing to decode, nothing to send
            # (with n > 1 the other samples still start from the prompt's KV)
            # (failing the stream ends the send however far it got)
            self.feed.fail("nothing to send: the request finished at its first token")
            await _settled(self.sending)
            return common_pb2.KVTransferResult(transfer_id=kv.transfer_id,
                                               state=common_pb2.TRANSFER_STATE_DONE)
        self.feed.finish(first.held_block_ids)
        # answer once the receiver accepted the transfer (it then learns of its end itself,
        # however it ends): the first token travels while the last KV moves
        if not (accepted.is_set() or self.sending.done()):
            waiter = asyncio.ensure_future(accepted.wait())
            try:
                await asyncio.wait({self.sending, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        if self.sending.done():
            return self.sending.result()
        return common_pb2.KVTransferResult(transfer_id=kv.transfer_id,
                                           state=common_pb2.TRANSFER_STATE_TRANSFERRING,
                                           num_blocks=self.feed.stream.total)

    def _response(self, first, result) -> worker_pb2.PrefillResponse:
        resp = worker_pb2.PrefillResponse(
            request_id=self.label, first_token_id=first.token_ids[0], first_text=first.text,
            num_cached_tokens=first.num_cached_tokens, transfer=result)
        if first.logprobs:
            resp.first_logprob = first.logprobs[0]
        if first.top_logprobs:
            resp.first_top_logprobs.CopyFrom(top_logprobs_to_proto(first.top_logprobs[0]))
        logger.info("prefill %s: %d tokens (%d cached), transfer %s (%d parts, %.2f ms after "
                    "the prompt)", self.log_id, len(self.req.ids), first.num_cached_tokens,
                    common_pb2.TransferState.Name(result.state), self.feed.parts,
                    result.duration_ms)
        return resp

    # ------------------------------------------------------------------ send
    async def _send(self, accepted: asyncio.Event) -> common_pb2.KVTransferResult:
        env, kv, stream = self.env, self.req.kv, self.feed.stream
        env.runtime.active_transfers += 1
        tspan = telemetry.child(self.span, "kv.transfer", {
            "pdserve.kv.backend": kv.backend, "pdserve.kv.blocks": stream.total,
            "pdserve.kv.transfer_id": kv.transfer_id})
        try:
            res = await self.req.sender.send(kv.transfer_id, kv.receiver_endpoint, stream,
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
            env.runtime.active_transfers -= 1
        return self._sent(res, tspan)

    def _sent(self, res, tspan) -> common_pb2.KVTransferResult:
        kv, stream = self.req.kv, self.feed.stream
        tail = res.tail_seconds if res.tail_seconds is not None else res.seconds
        if tspan.is_recording():
            tspan.set_attributes({"pdserve.kv.bytes": res.num_bytes,
                                  "pdserve.kv.tail_ms": round(tail * 1000, 3),
                                  # over the tail: the rate once the last blocks were ready
                                  "pdserve.kv.gbps": round(res.num_bytes / tail / 1e9, 4)
                                  if tail > 0 else 0.0,
                                  "pdserve.kv.state": res.state.value})
            telemetry.end_with_status(tspan, "OK" if res.ok else "UNAVAILABLE", res.error or "")
        self.env.runtime.transferred_bytes += res.num_bytes
        self.env.metrics.transfer("sent", res.state.value, res.num_bytes, tail)
        return common_pb2.KVTransferResult(
            transfer_id=kv.transfer_id, state=STATE_PB[res.state], error=res.error or "",
            num_blocks=stream.total, num_bytes=res.num_bytes, duration_ms=tail * 1000)

    def _release_after(self) -> None:
        """Step 5: once the send ended, give the request's blocks back."""
        sending, aengine, rid, releases = self.sending, self.env.aengine, self.rid, \
            self.env.releases

        async def release() -> None:
            try:
                await _settled(sending)
            finally:
                await _shielded(aengine.release(rid))

        task = asyncio.ensure_future(release())
        releases[rid] = task
        task.add_done_callback(lambda t: releases.pop(rid, None))


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
