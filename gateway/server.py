"""Gateway servicer: validate, tokenize, hash, route, relay the decode worker's stream.

Thin by design: request checks and tokenization here, placement in gateway/router.py, the
work itself on the workers. Imports no torch.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
import logging
import uuid

import grpc

from gateway.router import NoWorkers, OverCapacity, Router
from protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services import telemetry
from pdcore.block_hash import BlockHasher
from services.grpc_server import ChannelPool
from services.logging_setup import request_context
from services.metrics import GatewayMetrics, RequestTimer, route_mode
from services.protocol import check_request_id, sampling_from_proto, sampling_to_proto

logger = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 1 << 20
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, router: Router, tokenizer, *, model: str, vocab_size: int,
                 max_model_len: int, hasher: BlockHasher, request_timeout_s: float,
                 metrics: GatewayMetrics | None = None):
        self.router = router
        self.tokenizer = tokenizer
        self.model = model
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.hasher = hasher
        self.request_timeout_s = request_timeout_s
        self._peers = ChannelPool(worker_pb2_grpc.DecodeWorkerStub)
        self.metrics = metrics or GatewayMetrics()

    async def close(self) -> None:
        await self._peers.close()

    # ------------------------------------------------------------ validation
    def prompt_ids(self, req: gateway_pb2.GenerateRequest) -> list[int]:
        """Token ids of the request's prompt; ValueError with a readable message if bad."""
        given = [bool(req.prompt), bool(req.prompt_token_ids), bool(req.messages)]
        if sum(given) != 1:
            raise ValueError("set exactly one of prompt, prompt_token_ids and messages"
                             if any(given) else "prompt is empty")
        if req.model and req.model != self.model:
            raise ValueError(f"unknown model {req.model!r}; this gateway serves {self.model!r}")
        if req.prompt_token_ids:
            ids = list(req.prompt_token_ids)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        elif req.prompt:
            if len(req.prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompt is longer than {MAX_PROMPT_CHARS} characters")
            ids = self.tokenizer.encode(req.prompt)
        else:
            msgs = []
            for m in req.messages:
                if m.role not in ("system", "user", "assistant"):
                    raise ValueError(f"unknown chat role {m.role!r}")
                msgs.append({"role": m.role, "content": m.content})
            if sum(len(m["content"]) for m in msgs) > MAX_PROMPT_CHARS:
                raise ValueError(f"messages are longer than {MAX_PROMPT_CHARS} characters")
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is "
                             f"{self.max_model_len} (prompt + at least one new token)")
        return ids

    async def _abort(self, context, outcome: "_Outcome", code: grpc.StatusCode, msg: str):
        outcome.code, outcome.message = code.name, msg
        await context.abort(code, msg)

    # --------------------------------------------------------------- Generate
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        rid = request.request_id or uuid.uuid4().hex
        span = telemetry.server_span("gateway.Generate", context, {"pdserve.request_id": rid})
        outcome = _Outcome()
        with request_context(rid, telemetry.trace_id(span, context)):
            try:
                async for resp in self._generate(rid, request, context, span, outcome):
                    yield resp
            except asyncio.CancelledError:
                if outcome.code == "OK":
                    outcome.code = "CANCELLED"
                raise
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                outcome.code, outcome.message = "UNKNOWN", repr(e)
                raise
            finally:
                if outcome.timer is not None:
                    outcome.timer.done(outcome.code)
                else:
                    self.metrics.requests.labels(outcome.code).inc()
                if outcome.timer is not None:
                    span.set_attribute("pdserve.completion_tokens", outcome.timer.n)
                telemetry.end_with_status(span, outcome.code, outcome.message)

    async def _generate(self, rid, request, context, span, outcome: "_Outcome"):
        try:
            check_request_id(rid)
            ids = self.prompt_ids(request)
            sp = sampling_from_proto(request.sampling)
        except ValueError as e:
            await self._abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span.set_attribute("pdserve.prompt_tokens", len(ids))
        hashes = self.hasher.hash_blocks(ids)
        outcome.timer = self.metrics.timer(len(ids))
        remaining = context.time_remaining()
        timeout = min(remaining, self.request_timeout_s) if remaining else self.request_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for attempt in range(3):
            with telemetry.child(span, "route", {"pdserve.attempt": attempt}) as rspan:
                try:
                    route = await self.router.route(len(ids), hashes)
                except NoWorkers as e:
                    await self._abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(e))
                except OverCapacity as e:
                    await self._abort(context, outcome, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                mode = route_mode(route)
                if rspan.is_recording():
                    attrs = {"pdserve.prefill_worker": route.prefill.id if route.prefill else "",
                             "pdserve.decode_worker": route.decode.id,
                             "pdserve.cached_tokens_predicted": route.cached_tokens,
                             "pdserve.routing_mode": mode, "pdserve.index_ok": route.index_ok}
                    rspan.set_attributes(attrs)
                    span.set_attributes(attrs)
            self.metrics.routed(route, len(ids))
            logger.debug("request %s -> prefill %s decode %s (cached %d, %s)", rid,
                         route.prefill.id if route.prefill else "-", route.decode.id,
                         route.cached_tokens, mode)
            dreq = worker_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, sampling=sampling_to_proto(sp),
                model=self.router.model,
                prefill_address=route.prefill.info.address if route.prefill else "")
            started = False
            self.router.begin(route)
            call = self._peers.stub(route.decode.info.address).Generate(
                dreq, timeout=max(deadline - loop.time(), 0.001),
                metadata=telemetry.outgoing_metadata(span, context))
            try:
                async for resp in call:
                    if not started:
                        self.router.prefilled(route)  # a first token: the prompt is computed
                    started = True
                    outcome.timer.tokens(len(resp.token_ids))
                    yield resp
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if not started and code in RETRYABLE and attempt < 2 \
                        and loop.time() < deadline:
                    logger.warning("request %s: %s on %s; retrying elsewhere", rid,
                                   code.name, route.decode.id)
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self.router.mark_failed(route.decode)
                    continue
                await self._abort(context, outcome, code, e.details() or code.name)
            finally:
                call.cancel()  # no-op when finished; frees the workers when we are cancelled
                self.router.end(route)


@dataclass
class _Outcome:
    """How one Generate call ended (for the metrics and the span)."""
    code: str = "OK"
    message: str = ""
    timer: RequestTimer | None = None

