"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models`` and ``GET /health``.

Thin handlers: check the API key (``Authorization: Bearer``, the gRPC front's keys, compared
in constant time; ``/health`` is exempt like gRPC's Health), read the body up to
``http_max_body_bytes`` before parsing it (413 beyond), translate it (translate.py), drive
the gateway's request path (drive.py) and render what it yields (render.py). A request's
errors come as OpenAI error bodies with their HTTP status (errors.py), before the first
token; after it, as an error event in the stream. Counted in ``pdserve_http_requests`` (by
route and status) besides the request metrics every front shares.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from gateway.admission import key_id
from gateway.openai import render, tools, translate
from gateway.openai.drive import ClientGone, Drive, unless_gone
from gateway.openai.errors import ApiError, bad, from_status
from gateway.pipeline import GatewayEnv, GatewayRequest, RequestError
from services import telemetry
from services.auth import ApiKeys, presented_key

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_PARSE_ON_LOOP = 256 * 1024  # bodies at least this large are parsed on a thread


class _Headers:
    """The trace headers of an HTTP request, as telemetry reads a gRPC call's metadata."""

    def __init__(self, headers) -> None:
        self._md = [(k, v) for k, v in headers.items() if k in ("traceparent", "tracestate")]

    def invocation_metadata(self):
        return self._md


class HttpFront:
    def __init__(self, env: GatewayEnv, *, keys=(), served_model_name: str = "",
                 request_timeout_s: float = 600.0, max_body_bytes: int = 8 << 20,
                 body_timeout_s: float = 30.0) -> None:
        self.env, self.timeout_s, self.max_body = env, request_timeout_s, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._keys = ApiKeys(keys)
        self.names = tuple(dict.fromkeys(n for n in (served_model_name, env.model) if n))
        self.text = render.TokenText(env.tokenizer.tokenizer)
        self.tool_format = tools.detect(getattr(env.tokenizer.tokenizer, "chat_template", None))
        self.draining = False

    def app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_exception_handler(HTTPException, self._http_error)
        app.add_exception_handler(Exception, self._crash)
        return app

    # ------------------------------------------------------------- routes
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as e:
            return self._error(e, "models")
        limit = self.env.router.context_limit()
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "pdserve",
                 "root": self.env.model, "max_model_len": limit} for n in self.names]
        return self._count(JSONResponse({"object": "list", "data": data}), "models")

    async def health(self, request: Request) -> Response:
        ok = not self.draining and not self.env.shutting_down and self.env.router.seats() > 0
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    # ------------------------------------------------------------- checks
    def _auth(self, request: Request) -> str:
        """The caller's key id (admission's); 401 without a valid key when keys are set."""
        key = presented_key(request.headers.items())
        if not self._keys:
            return ""
        if key is None or not self._keys.valid(key):
            self.env.metrics.requests.labels("UNAUTHENTICATED").inc()
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'"
                           if key is None else "invalid API key", "authentication_error",
                           code="invalid_api_key")
        return key_id(key)

    async def _body(self, request: Request) -> dict:
        """The JSON body, read up to the size limit before anything is parsed."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise self._too_big()
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        raise self._too_big()
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self.body_timeout_s:g} s", code="request_timeout") from None
        raw = b"".join(chunks)
        try:
            # a large body parses on a thread: the event loop keeps serving the others
            body = json.loads(raw) if len(raw) < _PARSE_ON_LOOP else \
                await asyncio.to_thread(json.loads, raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the body is not valid JSON: {str(e)[:200]}") from None
        except RecursionError:
            raise bad("the body is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        if _SURROGATE.search(raw):  # an escape may spell a lone surrogate: not text
            try:
                json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError:
                raise bad("a string in the body is not valid Unicode (a lone surrogate)") \
                    from None
        return body

    def _too_big(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.max_body} bytes",
                        code="request_too_large")

    def _job(self, kind: str, body: dict, request: Request, key: str) -> translate.Job:
        translate.check_sizes(body, self.env.limits)
        label = request.headers.get("x-request-id", "")
        if kind == "chat":
            return translate.chat_job(body, self.names, label, self.timeout_s, key,
                                      self.env.router.context_limit(), self.tool_format)
        return translate.completion_job(body, self.names, label, self.timeout_s, key)

    # ----------------------------------------------------------- generate
    async def _generate(self, request: Request, kind: str) -> Response:
        drive = None
        try:
            key = self._auth(request)
            job = self._job(kind, await self._body(request), request, key)
            headers = _Headers(request.headers)
            span = telemetry.server_span(f"gateway.http.{kind}", headers,
                                         {"pdserve.request_id": job.creq.label[:256]})
            req = GatewayRequest(self.env, job.creq, span, headers)
            drive = Drive(req)
            first = await unless_gone(drive.next(), request.receive, drive)
            args = (job, req.rid, int(time.time()), self.text)
            if job.stream:
                events = render.Events(*args)
                return self._count(StreamingResponse(
                    self._sse(drive, events, first), media_type="text/event-stream",
                    headers={**SSE_HEADERS, "x-request-id": req.rid}), kind)
            answer = render.Answer(*args)
            await unless_gone(self._collect(drive, answer, first), request.receive, drive)
            return self._count(JSONResponse(answer.body(), headers={"x-request-id": req.rid}),
                               kind)
        except ApiError as e:
            return self._error(e, kind)
        except RequestError as e:
            return self._error(from_status(e.code, e.message), kind)
        except ClientGone:
            return self._count(Response(status_code=499), kind)
        finally:
            if drive is not None and not (drive.task.done() or job.stream):
                drive.cancel()

    @staticmethod
    async def _collect(drive: Drive, answer: render.Answer, resp) -> None:
        while resp is not None:
            answer.add(resp)
            resp = await drive.next()

    @staticmethod
    async def _sse(drive: Drive, events: render.Events, resp):
        try:
            while resp is not None:
                yield events.frame(resp)
                resp = await drive.next()
            yield events.tail()
        except RequestError as e:
            yield events.error(from_status(e.code, e.message))
        finally:  # the client left (the body's task is cancelled) or the stream ended
            drive.cancel()

    # ------------------------------------------------------------- errors
    def _error(self, e: ApiError, route: str) -> Response:
        # a body that never arrived (408) or was refused unread (413): the rest of it may
        # still be on its way, so the connection ends with this answer
        close = {"connection": "close"} if e.status in (408, 413) else None
        return self._count(JSONResponse(e.body(), status_code=e.status, headers=close), route)

    def _count(self, resp: Response, route: str) -> Response:
        self.env.metrics.http_requests.labels(route, str(resp.status_code)).inc()
        return resp

    async def _crash(self, request: Request, exc: Exception) -> Response:
        logger.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
        return self._error(ApiError(500, "internal error", "internal_error"), "other")

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return self._error(ApiError(exc.status_code, str(exc.detail), kind), "other")
