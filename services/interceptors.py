"""Server interceptors every pdserve gRPC server installs first.

:class:`MalformedRequestInterceptor`: a request that does not parse as its message type
(corrupt wire data, a string field holding invalid UTF-8 such as a lone UTF-16 surrogate
sent by a JavaScript client) ends with INVALID_ARGUMENT and a short message, instead of
grpc's UNKNOWN naming a Python exception class. The handler never sees it.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
import logging

import grpc

logger = logging.getLogger(__name__)


class _Malformed:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "UTF-8" in text:
        return "a string field is not valid UTF-8"
    return "the request is not a valid protobuf message"


def _parsing(deserializer):
    def parse(raw: bytes):
        try:
            return deserializer(raw) if deserializer is not None else raw
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            return _Malformed(_reason(e))
    return parse


def _refuse_malformed(behavior, streaming: bool):
    code = grpc.StatusCode.INVALID_ARGUMENT
    if streaming:
        async def stream(request, context):
            if isinstance(request, _Malformed):
                await context.abort(code, request.reason)
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:  # a handler that writes with context.write() (grpc health's Watch)
                await result
        return stream

    async def unary(request, context):
        if isinstance(request, _Malformed):
            await context.abort(code, request.reason)
        return await behavior(request, context)
    return unary


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Unary-request methods only (every pdserve RPC); streaming-request methods pass."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        kw = dict(request_deserializer=_parsing(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _refuse_malformed(handler.unary_stream, True), **kw)
        return grpc.unary_unary_rpc_method_handler(
            _refuse_malformed(handler.unary_unary, False), **kw)
