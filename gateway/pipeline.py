"""The one request path below the front doors (gRPC today): every front translates its
request into a :class:`ClientRequest` and streams what :meth:`GatewayRequest.run` yields.

Steps of one request (:class:`GatewayRequest`):
  1. check: the shared request checks (services.validation), exactly one kind of prompt.
  2. admit: the API key's limits (gateway.admission); shedding when the pool is full.
  3. tokenize: off the event loop (gateway.tokenize); the prompt must leave room in the
     workers' context limit.
  4. route: prefill worker by cached prefix and load, decode worker by load (gateway.router).
  5. relay: stream the decode worker's responses to the client, counting the tokens.
  6. migrate: when the decode stream breaks (the worker died, stopped answering its
     probes, or is shutting down) the request resumes on another decode worker from the
     prompt plus the tokens already streamed: the client's stream continues with no gap or
     repeat. Before the first token this is a plain retry. At most ``max_migrations`` times.
  7. finish: the last response carries finish_reason and usage (counted here, over every
     attempt); errors end with a status and a short message. A gateway shutting down ends
     streams still open at the end of its grace period with finish_reason "abort".
The request's identity is its own (``rid``); the client's request_id is a label, echoed.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
import json
import logging
import time
import uuid

import grpc

from gateway.admission import Admission, OverLimit, Ticket
from gateway.decode_calls import DecodeCalls
from gateway.router import NoWorkers, OverCapacity, Route, Router
from gateway.tokenize import PromptTokenizer, TokenizerBusy
from protos.pdserve.v1 import common_pb2, worker_pb2
from services import telemetry, validation
from pdcore.block_hash import BlockHasher
from services.logging_setup import request_context
from services.metrics import GatewayMetrics, route_mode
from services.protocol import sampling_to_proto
from services.validation import InvalidRequest, RequestLimits

logger = logging.getLogger(__name__)

# a broken decode stream resumes elsewhere on these (with tokens streamed: a migration)
RESUMABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED", "INTERNAL", "UNKNOWN",
                       "ABORTED", "lost", "eof"})
PRE_TOKEN_RETRIES = 2  # retries on another worker before anything was streamed


class RequestError(Exception):
    """How a request ends when it does not end with a finish_reason."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class ClientRequest:
    """A request as every front door hands it over (nothing checked yet)."""
    label: str
    prompt: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    messages: list = field(default_factory=list)  # ChatMessage protos or role/content dicts
    model: str = ""
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    api_key: str = ""  # gateway.admission.key_id of the caller's key ("" without keys)
    timeout_s: float = 600.0
    tools: list | None = None  # chat: tool definitions for the template (OpenAI's shape)


@dataclass
class GatewayEnv:
    """What every request of one gateway shares."""
    router: Router
    tokenizer: PromptTokenizer
    admission: Admission
    hasher: BlockHasher
    metrics: GatewayMetrics
    limits: RequestLimits
    model: str
    vocab_size: int
    max_migrations: int
    decode: DecodeCalls  # the calls to decode workers
    active: set = field(default_factory=set)  # GatewayRequests streaming
    shutting_down: bool = False

    def end_all(self, reason: str) -> None:
        """Shutdown: every stream still open ends (finish_reason "abort")."""
        self.shutting_down = True
        for req in list(self.active):
            req.cut(reason)


class _Broken(Exception):
    """The decode stream of one attempt broke (``reason``: its status code name, "lost" or
    "eof"), or was cut by a shutdown."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.reason, self.message, self.code = reason, message, code


class _NoOther(Exception):
    """No worker is left that this request has not failed on."""


class GatewayRequest:
    def __init__(self, env: GatewayEnv, creq: ClientRequest, span, grpc_context=None) -> None:
        self.env, self.creq, self.span, self.ctx = env, creq, span, grpc_context
        self.rid = uuid.uuid4().hex
        span.set_attribute("pdserve.internal_id", self.rid)
        self.code, self.message = "OK", ""
        self.ids: list[int] = []
        self.streamed: list[int] = []  # every token sent to the client, over every attempt
        self.open_samples: set[int] = {0}  # sampling.n > 1: samples not finished yet
        self.ticket: Ticket | None = None
        self.timer = None
        self._call = None  # the decode call in flight
        self._cut_reason = ""

    def cut(self, reason: str) -> None:
        """End the attempt in flight: its worker was lost ("lost"), the gateway is shutting
        down ("shutdown") or the client left."""
        self._cut_reason = self._cut_reason or reason
        if self._call is not None:
            self._call.cancel()

    # ------------------------------------------------------------------- run
    async def run(self):
        with request_context(self.rid, telemetry.trace_id(self.span, self.ctx)):
            logger.debug("request %s: label %r", self.rid, self.creq.label)
            try:
                sp = await self._prepare()
                async for resp in self._relay(sp):
                    yield resp
            except RequestError as e:
                self.code, self.message = e.code.name, e.message
                raise
            except asyncio.CancelledError:
                self.code = "CANCELLED"
                raise
            except Exception as e:
                self.code, self.message = "UNKNOWN", repr(e)
                logger.exception("request %s failed", self.rid)
                raise RequestError(grpc.StatusCode.INTERNAL, "internal error") from None
            finally:
                self._finish()

    def _finish(self) -> None:
        if self.ticket is not None:
            self.ticket.close()
        if self.timer is not None:
            self.timer.done(self.code)
            self.span.set_attribute("pdserve.completion_tokens", self.timer.n)
        else:
            self.env.metrics.requests.labels(self.code).inc()
        telemetry.end_with_status(self.span, self.code, self.message)

    # ----------------------------------------------------------- steps 1-3
    async def _prepare(self):
        """Check, admit, tokenize; returns the sampling parameters."""
        env, r = self.env, self.creq
        try:
            validation.check_label(r.label, env.limits)
            validation.check_model(r.model, env.model, env.limits)
            sp = validation.sampling(r.sampling, env.limits)
            validation.check_sampling_vocab(sp, env.vocab_size)
            self.open_samples = set(range(sp.n))
            given = [bool(r.prompt), bool(r.prompt_token_ids), bool(r.messages)]
            if sum(given) != 1:
                raise InvalidRequest("set exactly one of prompt, prompt_token_ids and messages"
                                     if any(given) else "prompt is empty")
            self.ticket = self._admit()
            self.ids = await self._tokenize()
            if not self.ids:
                raise InvalidRequest("prompt is empty after tokenization")
            validation.check_context(len(self.ids), 0, env.router.context_limit(),
                                     "the workers'")
        except InvalidRequest as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, e.message) from None
        self.ticket.spend(len(self.ids))
        self.span.set_attribute("pdserve.prompt_tokens", len(self.ids))
        return sp

    def _admit(self) -> Ticket:
        try:
            return self.env.admission.enter(self.creq.api_key, 0, self.env.router.seats())
        except OverLimit as e:
            self.env.metrics.rejections.labels(e.reason).inc()
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None

    async def _tokenize(self) -> list[int]:
        env, r = self.env, self.creq
        if r.prompt_token_ids:  # too long: refused before the ids are copied and scanned
            validation.check_context(len(r.prompt_token_ids), 0, env.router.context_limit(),
                                     "the workers'")
            return validation.check_token_ids(r.prompt_token_ids, env.vocab_size)
        try:
            if r.prompt:
                validation.check_text(r.prompt, env.limits)
                return await env.tokenizer.text(r.prompt)
            if r.tools:
                validation.check_text(json.dumps(r.tools), env.limits, "tools")
            return await env.tokenizer.chat(validation.check_messages(r.messages, env.limits),
                                            r.tools)
        except TokenizerBusy as e:
            env.metrics.rejections.labels("tokenizer_queue").inc()
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except InvalidRequest:  # the request's own limits: their message as it is
            raise
        except ValueError as e:  # a chat template that refuses the conversation
            raise InvalidRequest(f"cannot render the conversation: {e}") from None

    # ----------------------------------------------------------- steps 4-6
    async def _relay(self, sp):
        env = self.env
        hashes = env.hasher.hash_blocks(self.ids)
        self.timer = env.metrics.timer(len(self.ids))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.creq.timeout_s
        failed: set[str] = set()
        last: _Broken | None = None  # why the previous attempt broke
        retries, migrations = PRE_TOKEN_RETRIES, env.max_migrations
        env.active.add(self)
        try:
            while True:
                try:
                    route = await self._route(hashes, frozenset(failed), retries)
                except _NoOther:
                    # every worker left was tried: the client hears why the last one
                    # failed (RESOURCE_EXHAUSTED when it had no KV blocks, ...), not that
                    # there are no workers
                    raise RequestError(last.code, last.message) from None
                try:
                    async for resp in self._attempt(route, sp, deadline):
                        yield resp
                    return
                except _Broken as b:
                    last = b
                    if b.reason == "shutdown":
                        for resp in self._final_aborts():
                            yield resp
                        return
                    failed.add(route.decode.id)
                    # n > 1: samples interleave on one stream; once tokens went out the
                    # request does not resume elsewhere (a retry before that is fine)
                    can = (migrations if self.streamed else retries) > 0 \
                        and b.reason in RESUMABLE and loop.time() < deadline - 0.01 \
                        and not (self.streamed and sp.n > 1)
                    if not can:
                        raise RequestError(b.code, b.message) from None
                    if self.streamed:
                        migrations -= 1
                        self._migrating(route, b)
                    else:
                        retries -= 1
                        logger.warning("request %s: %s on %s; retrying elsewhere", self.rid,
                                       b.reason, route.decode.id)
        finally:
            env.active.discard(self)

    def _migrating(self, route: Route, b: _Broken) -> None:
        self.env.metrics.migrations.labels(b.reason).inc()
        self.span.add_event("migration", {"pdserve.from": route.decode.id,
                                          "pdserve.reason": b.reason,
                                          "pdserve.streamed_tokens": len(self.streamed)})
        logger.warning("request %s: decode worker %s failed (%s) after %d tokens; resuming "
                       "elsewhere", self.rid, route.decode.id, b.reason, len(self.streamed))

    async def _route(self, hashes, exclude: frozenset, retries: int) -> Route:
        env = self.env
        if env.shutting_down:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down")
        with telemetry.child(self.span, "route", {"pdserve.attempt": len(exclude)}) as rspan:
            try:
                route = await env.router.route(len(self.ids), hashes, exclude)
            except NoWorkers as e:
                if exclude:  # workers exist, and this request failed on each of them
                    raise _NoOther() from None
                raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            except OverCapacity as e:
                env.metrics.rejections.labels("capacity").inc()
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            if rspan.is_recording():
                attrs = {"pdserve.prefill_worker": route.prefill.id if route.prefill else "",
                         "pdserve.decode_worker": route.decode.id,
                         "pdserve.cached_tokens_predicted": route.cached_tokens,
                         "pdserve.routing_mode": route_mode(route),
                         "pdserve.index_ok": route.index_ok}
                rspan.set_attributes(attrs)
                self.span.set_attributes(attrs)
        env.metrics.routed(route, len(self.ids))
        return route

    async def _attempt(self, route: Route, sp, deadline: float):
        """One decode call; raises _Broken when its stream breaks."""
        env, loop = self.env, asyncio.get_running_loop()
        dreq = worker_pb2.DecodeRequest(
            request_id=self.rid, prompt_token_ids=self.ids, output_token_ids=self.streamed,
            sampling=sampling_to_proto(sp), model=env.router.model,
            prefill_address=route.prefill.info.address if route.prefill else "")
        env.router.begin(route)
        self._call = call = env.decode.generate(
            route.decode.info.address, dreq, timeout=max(deadline - loop.time(), 0.001),
            metadata=telemetry.outgoing_metadata(self.span, self.ctx))
        route.decode.watchers.add(self.cut)
        try:
            async for resp in self._read(call, route):
                yield resp
                if resp.finish_reason and not self.open_samples:
                    return
            raise self._broken("eof", "the decode worker ended the stream early")
        finally:
            route.decode.watchers.discard(self.cut)
            call.cancel()  # no-op when finished; frees the workers when we are cancelled
            self._call = None
            env.router.end(route)

    async def _read(self, call, route: Route):
        first = True
        try:
            async for resp in call:
                route.decode.heard_at = time.monotonic()  # alive (gateway.health)
                if first:
                    self.env.router.prefilled(route)  # a first token: the prompt is computed
                    first = False
                n = len(resp.token_ids)
                self.streamed.extend(resp.token_ids)
                self.timer.tokens(n)
                self.ticket.spend(n)
                resp.request_id = self.creq.label
                if resp.finish_reason:
                    self.open_samples.discard(resp.index)
                    if self.open_samples:  # usage comes with the request's last message
                        resp.ClearField("usage")
                    else:
                        self._count_usage(resp)
                yield resp
        except asyncio.CancelledError:
            # a call cancelled here (cut) raises CancelledError in its reader; our own task
            # being cancelled (the client left) shows as a pending cancellation
            if self._cut_reason and not asyncio.current_task().cancelling():
                raise self._broken(self._cut_reason, f"decode worker {self._cut_reason}") \
                    from None
            raise
        except grpc.aio.AioRpcError as e:
            code = e.code()
            raise _Broken(code.name, e.details() or code.name, code) from None

    def _broken(self, reason: str, message: str) -> _Broken:
        self._cut_reason = "" if reason != "shutdown" else reason
        return _Broken(reason, message, grpc.StatusCode.UNAVAILABLE)

    def _count_usage(self, resp) -> None:
        """Usage over every attempt: the client's prompt, every token streamed."""
        cached = min(resp.usage.cached_tokens, len(self.ids))
        resp.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(self.ids),
                                             completion_tokens=len(self.streamed),
                                             cached_tokens=cached))

    def _final_aborts(self) -> list[common_pb2.GenerateResponse]:
        """finish_reason "abort" for each sample still open; usage on the last."""
        left = sorted(self.open_samples) or [0]
        self.open_samples.clear()
        out = [common_pb2.GenerateResponse(request_id=self.creq.label, finish_reason="abort",
                                           index=i) for i in left]
        self._count_usage(out[-1])
        return out
