"""One DecodeWorker.Generate call, step by step.

  1. validate: the shared request checks (services.validation); nothing is reserved before
     they pass. The call gets its own internal id: the caller's request_id is a label.
  2. prefill: remote, when the caller named a prefill worker -- over each KV backend in turn
     (decode_worker.remote: reserve blocks + Prefill RPC; the first token may stream before
     the KV lands) -- else, or when every remote attempt failed, locally.
  3. decode: the engine's outputs stream back (continuous batching).
  4. finish: the last response carries finish_reason and usage. Abort ends the stream with
     finish_reason "abort"; a worker shutting down ends it with UNAVAILABLE (the gateway then
     resumes the request elsewhere); a cancelled or expired call frees its blocks.

A resumed request (``output_token_ids``: tokens generated before its previous decode worker
failed) continues after them, as if uninterrupted.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
import logging
import time

import grpc

from engine.async_engine import EngineDeadError
from engine.request import FinishReason, RequestOutput
from pdcore.ids import new_id
from protos.pdserve.v1 import common_pb2
from services import telemetry, validation
from services.logging_setup import request_context
from services.protocol import response_from_output
from pdcore.tasks import Stopped, unless_stopped
from services.membership import MembershipUnknown, NotMember
from services.validation import InvalidRequest

from decode_worker.remote import NoFreeBlocks, PrefillFailed, RemotePrefill, early_first

logger = logging.getLogger(__name__)


@dataclass
class DecodeEnv:
    """What every call of one decode worker shares."""
    aengine: object
    runtime: object  # services.worker_runtime.WorkerRuntime
    receivers: list  # [(backend, KVReceiver)], preferred first
    layout: object
    settings: object  # services.config.WorkerSettings
    metrics: object
    peers: object  # services.grpc_server.ChannelPool of PrefillWorker stubs
    allow_local_prefill: bool = True  # when every remote attempt failed

    @property
    def model_id(self) -> str:
        return self.runtime.model_id

    @property
    def engine(self):
        return self.aengine.engine


@dataclass
class _Request:
    """A validated DecodeRequest."""
    ids: list[int]
    output_ids: list[int]
    sp: object
    prefill_address: str
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.ids)

    @property
    def num_tokens(self) -> int:
        return len(self.ids) + len(self.output_ids)


class _Evicted(Exception):
    pass


class DecodeCall:
    def __init__(self, env: DecodeEnv, request, context) -> None:
        self.env, self.request, self.context = env, request, context
        self.label = request.request_id
        self.rid = new_id()  # the engine's id of this call
        self.log_id = self.label[:64] or self.rid  # logs: the caller's id (every hop's)
        self.req: _Request | None = None
        self.span = telemetry.server_span("decode.generate", context, {
            "pdserve.request_id": self.label, "pdserve.internal_id": self.rid,
            "pdserve.prompt_tokens": len(request.prompt_token_ids),
            "pdserve.worker": env.runtime.worker_id,
            "pdserve.prefill_address": request.prefill_address})
        self.kind, self.outcome, self.completion = "decode_local", "error", 0
        self.open_samples: set[int] = set()  # sampling.n > 1: the samples not finished yet
        self.stop = asyncio.Event()
        self.stop_reason = ""  # "abort" | "shutdown"
        self.early: RequestOutput | None = None  # the first token, streamed before its KV
        self.pending: RemotePrefill | None = None  # the remote prefill in flight
        self._cleaned = False
        context.add_done_callback(self._rpc_done)

    # --------------------------------------------------------------- control
    async def abort(self) -> None:
        """End the call: its stream ends with finish_reason "abort", its blocks are freed."""
        await self._end("abort")

    async def evict(self) -> None:
        """The worker is shutting down: end the call with UNAVAILABLE."""
        await self._end("shutdown")

    async def _end(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.stop.set()
        await self.env.aengine.abort(self.rid)  # a decoding stream gets its last output

    def _bounded(self, seconds: float) -> float:
        left = self.context.time_remaining()
        return max(0.001, min(seconds, left) if left is not None else seconds)

    def prefill_timeout_s(self) -> float:
        """The Prefill call's deadline: its own, within the request's."""
        s = self.env.settings
        return self._bounded(s.prefill_timeout_s
                             + s.prefill_timeout_per_token_ms / 1000 * self.req.num_tokens)

    def transfer_timeout_s(self) -> float:
        return self._bounded(self.env.settings.transfer_timeout_s)

    def kv_blocks_wait_s(self) -> float:
        """How long this request's prompt may wait for free KV blocks: the transfer's
        timeout runs meanwhile (a sender may connect first), so at most half of it."""
        s = self.env.settings
        if s.kv_blocks_wait_s <= 0:
            return 0.0
        return self._bounded(min(s.kv_blocks_wait_s, s.transfer_timeout_s / 2))

    # ------------------------------------------------------------------- run
    async def run(self):
        # logs carry the caller's id for the request (the gateway's, on every hop)
        with request_context(self.log_id,
                             telemetry.trace_id(self.span, self.context)):
            logger.debug("request %s: internal id %s", self.log_id, self.rid)
            try:
                self.req = self._validate()
                await validation.compile_constraint(self.env.engine, self.req.sp)
                if self.req.prefill_address:  # dial cluster members only
                    await self.env.runtime.members.admit(self.req.prefill_address, "prefill")
                async for resp in self._serve():
                    yield resp
            except InvalidRequest as e:
                await self._fail(grpc.StatusCode.INVALID_ARGUMENT, e.message)
            except NotMember as e:
                await self._fail(grpc.StatusCode.PERMISSION_DENIED, str(e))
            except MembershipUnknown as e:
                await self._fail(grpc.StatusCode.UNAVAILABLE, str(e))
            except NoFreeBlocks as e:
                await self._fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except EngineDeadError as e:  # e.g. a tensor-parallel rank died: resume elsewhere
                await self._fail(grpc.StatusCode.UNAVAILABLE,
                                 f"decode worker's engine failed: {validation.clip(str(e), 300)}")
            except (Stopped, _Evicted):
                self.outcome = "abort"
                if self.stop_reason == "shutdown":
                    await self._fail(grpc.StatusCode.UNAVAILABLE, "decode worker is shutting "
                                     "down: resume the request elsewhere")
                for resp in self._aborted():
                    yield resp
            finally:
                self.env.metrics.requests.labels(self.kind, self.outcome).inc()
                self.env.metrics.tokens.inc(self.completion)
                telemetry.end_with_status(self.span, "OK" if self.outcome != "error"
                                          else "CANCELLED")
                await asyncio.shield(self._cleanup())

    def _rpc_done(self, _context) -> None:
        """The RPC ended: whatever path the handler took (or did not take, if its generator
        was abandoned), nothing of the call may stay in the engine."""
        if not self._cleaned:
            asyncio.ensure_future(self._cleanup())

    async def _cleanup(self) -> None:
        """Idempotent: calls off a transfer in flight, ends the engine's request (a request
        that finished is gone already: then this is a no-op)."""
        if self._cleaned:
            return
        self._cleaned = True
        if self.pending is not None:
            self.pending.receiver.cancel(self.pending.tid)
        if self.outcome != "ok":
            try:
                await self.env.aengine.abort(self.rid)
            except Exception:  # noqa: BLE001 - engine dead: nothing left to free
                pass

    async def _fail(self, code: grpc.StatusCode, message: str) -> None:
        telemetry.end_with_status(self.span, code.name, message)
        await self.context.abort(code, message)

    def _validate(self) -> _Request:
        r, env = self.request, self.env
        limits = env.settings.limits
        validation.check_label(r.request_id, limits)
        sp = validation.sampling(r.sampling, limits)
        validation.check_model(r.model, env.model_id, limits)
        if not r.prompt_token_ids:
            raise InvalidRequest("prompt is empty")
        vocab = env.engine.model_config.vocab_size
        ids = validation.check_token_ids(r.prompt_token_ids, vocab)
        outs = validation.check_token_ids(r.output_token_ids, vocab, "output")
        validation.check_context(len(ids), len(outs), env.engine.max_model_len)
        validation.check_sampling_vocab(sp, vocab)
        if len(outs) >= sp.max_tokens:
            raise InvalidRequest(f"{len(outs)} tokens already generated; max_tokens is "
                                 f"{sp.max_tokens}")
        if sp.n > 1 and outs:
            raise InvalidRequest("a resumed request (output_token_ids) has one sample (n=1)")
        self.open_samples = set(range(sp.n))
        return _Request(ids, outs, sp, r.prefill_address)

    # ---------------------------------------------------------------- serve
    async def _serve(self):
        stream = None
        if self.req.prefill_address:
            holder: list = []
            async for resp in self._remote(holder):
                yield resp
            stream = holder[0] if holder else None
        if stream is None:
            stream = await self._local()
        elif self.early is not None:
            stream = _after_early(self.early, stream)
        async for resp in self._decode(stream):
            yield resp

    async def _remote(self, holder: list):
        """Step 2, remote: over each KV backend in turn; on success ``holder`` gets the
        engine stream. Yields the early first token when there is one."""
        receivers = self.env.receivers
        for i, (backend, receiver) in enumerate(receivers):
            try:
                self.pending = RemotePrefill(self, backend, receiver, self.early)
                pending = await unless_stopped(self.pending.start(), self.stop)
                async for resp in self._stream_early(pending):
                    yield resp
                holder.append(await unless_stopped(pending.landed(), self.stop))
                self.kind = "decode_remote"
                return
            except PrefillFailed as e:
                if e.transfer and i + 1 < len(receivers):
                    logger.warning("request %s: %s; retrying the transfer over %s",
                                   self.log_id, e, receivers[i + 1][0])
                    self.span.add_event("kv backend fallback", {"reason": str(e)[:200]})
                    continue
                if not self.env.allow_local_prefill:
                    await self._fail(grpc.StatusCode.UNAVAILABLE, str(e))
                logger.warning("request %s: %s; prefilling locally", self.log_id, e)
                self.span.add_event("local prefill fallback", {"reason": str(e)[:200]})
                return

    async def _stream_early(self, pending: RemotePrefill):
        if self.early is not None:
            return
        self.early = early_first(pending, self.req.num_tokens, self.req.sp, self.env.engine)
        if self.early is None:
            return
        try:
            yield self._response(self.early)
        except BaseException:  # the caller left: free the blocks
            await pending.give_up()
            raise

    async def _local(self):
        """Step 2, local: the engine computes the prompt here (after an early first token:
        the prompt plus that token)."""
        req = self.req
        outs = req.output_ids + (self.early.token_ids if self.early is not None else [])
        stream = self.env.aengine.generate(self.rid, req.ids, req.sp, output_token_ids=outs)
        try:
            first = await unless_stopped(stream.__anext__(), self.stop)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return _prepend(first, stream)

    async def _decode(self, stream):
        """Steps 3 and 4."""
        dspan = telemetry.child(self.span, "decode")
        t_first = t_last = 0.0
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ABORT and self.stop.is_set():
                    raise _Evicted
                if out.token_ids:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                if out.finished and out.finish_reason is FinishReason.ABORT:
                    for resp in self._aborted(out.num_cached_tokens):
                        yield resp
                    self.outcome = "ok"
                    return
                if out.finished:
                    self.open_samples.discard(out.index)
                    if not self.open_samples:
                        self.outcome = "ok"
                        yield self._final(out)
                        return
                yield self._response(out)
        finally:
            await stream.aclose()  # a cancelled call aborts the request and frees blocks
            if dspan.is_recording():
                n = self.completion
                tpot = (t_last - t_first) / (n - 1) if n > 1 else 0.0
                dspan.set_attributes({"pdserve.completion_tokens": n,
                                      "pdserve.tpot_ms": round(tpot * 1000, 3)})
                self.span.set_attribute("pdserve.completion_tokens", n)
            dspan.end()

    def _response(self, out: RequestOutput) -> common_pb2.GenerateResponse:
        self.completion += len(out.token_ids)
        return response_from_output(out, self.label)

    def _aborted(self, num_cached_tokens: int = 0) -> list[common_pb2.GenerateResponse]:
        """finish_reason "abort" for every sample still open; usage on the last."""
        left = sorted(self.open_samples) or [0]
        self.open_samples.clear()
        outs = [RequestOutput(self.rid, [], finished=True, finish_reason=FinishReason.ABORT,
                              index=i, num_cached_tokens=num_cached_tokens) for i in left]
        return [self._response(o) for o in outs[:-1]] + [self._final(outs[-1])]

    def _final(self, out: RequestOutput) -> common_pb2.GenerateResponse:
        resp = self._response(out)
        req = self.req
        resp.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=req.num_prompt_tokens if req else 0,
            completion_tokens=self.completion + (len(req.output_ids) if req else 0),
            cached_tokens=out.num_cached_tokens))
        return resp


async def _prepend(first, stream):
    try:
        yield first
        async for x in stream:
            yield x
    finally:
        await stream.aclose()


async def _after_early(early: RequestOutput, stream):
    """The continuation's outputs without its first one, which repeats the token already
    streamed (a finishing first output still ends the stream, with no tokens)."""
    try:
        first = await stream.__anext__()
        if first.token_ids != early.token_ids:
            logger.error("request %s: continuation starts with %s, %s was streamed",
                         early.request_id, first.token_ids, early.token_ids)
        if first.finished:  # (with n > 1 the other samples follow)
            yield RequestOutput(first.request_id, [], finished=True,
                                finish_reason=first.finish_reason, index=first.index,
                                num_cached_tokens=first.num_cached_tokens)
        async for x in stream:
            yield x
    finally:
        await stream.aclose()
