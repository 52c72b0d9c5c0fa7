"""Gateway servicer: validate, tokenize, hash, route, relay the decode worker's stream.

Thin by design: request checks and tokenization here, placement in gateway/router.py, the
work itself on the workers. Imports no torch.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from gateway.router import NoWorkers, OverCapacity, Route, Router
from protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.block_hash import BlockHasher
from services.grpc_server import grpc_options
from services.logging_setup import request_context
from services.protocol import sampling_from_proto, sampling_to_proto

logger = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 1 << 20
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, router: Router, tokenizer, *, model: str, vocab_size: int,
                 max_model_len: int, hasher: BlockHasher, request_timeout_s: float):
        self.router = router
        self.tokenizer = tokenizer
        self.model = model
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.hasher = hasher
        self.request_timeout_s = request_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.status_counts: dict[str, int] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=grpc_options())
            self._channels[address] = ch
        return worker_pb2_grpc.DecodeWorkerStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

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

    def _count(self, code: grpc.StatusCode) -> None:
        self.status_counts[code.name] = self.status_counts.get(code.name, 0) + 1

    # --------------------------------------------------------------- Generate
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        rid = request.request_id or uuid.uuid4().hex
        with request_context(rid):
            try:
                ids = self.prompt_ids(request)
                sp = sampling_from_proto(request.sampling)
            except ValueError as e:
                self._count(grpc.StatusCode.INVALID_ARGUMENT)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            hashes = self.hasher.hash_blocks(ids)
            remaining = context.time_remaining()
            timeout = min(remaining, self.request_timeout_s) if remaining else self.request_timeout_s
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            for attempt in range(3):
                try:
                    route = await self.router.route(len(ids), hashes)
                except NoWorkers as e:
                    self._count(grpc.StatusCode.UNAVAILABLE)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                except OverCapacity as e:
                    self._count(grpc.StatusCode.RESOURCE_EXHAUSTED)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                logger.debug("request %s -> prefill %s decode %s (cached %d)", rid,
                             route.prefill.id if route.prefill else "-", route.decode.id,
                             route.cached_tokens)
                dreq = worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=sampling_to_proto(sp),
                    model=self.router.model,
                    prefill_address=route.prefill.info.address if route.prefill else "")
                started = False
                self.router.begin(route)
                call = self._stub(route.decode.info.address).Generate(
                    dreq, timeout=max(deadline - loop.time(), 0.001),
                    metadata=_trace_metadata(context))
                try:
                    async for resp in call:
                        started = True
                        yield resp
                    self._count(grpc.StatusCode.OK)
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
                    self._count(code)
                    await context.abort(code, e.details() or code.name)
                finally:
                    call.cancel()  # no-op when finished; frees the workers when we are cancelled
                    self.router.end(route)


def _trace_metadata(context):
    keep = ("traceparent", "tracestate")
    return tuple((k, v) for k, v in (context.invocation_metadata() or ()) if k in keep)


def route_summary(route: Route) -> str:  # pragma: no cover - logging aid
    return f"{route.prefill.id if route.prefill else '-'} -> {route.decode.id}"
