"""Server interceptors every pdserve gRPC server installs first.

:class:`MalformedRequestInterceptor`: a request that does not parse as its message type
(corrupt wire data, a string field holding invalid UTF-8 such as a lone UTF-16 surrogate
sent by a JavaScript client) ends with INVALID_ARGUMENT and a short message, instead of
grpc's UNKNOWN naming a Python exception class. The handler never sees it. On a request
stream (DecodeWorker.GenerateMany) such a message raises :class:`MalformedRequest` where the
handler reads it: the handler ends what the stream carried (its calls, with that status) and
lets it go, and the call ends with INVALID_ARGUMENT.
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


class MalformedRequest(Exception):
    """A message of a request stream did not parse; ``reason`` is what the client is told."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def _parsed(requests):
    """The request stream as the handler reads it: a message that did not parse raises."""
    async for request in requests:
        if isinstance(request, _Malformed):
            raise MalformedRequest(f"a message of the request stream: {request.reason}")
        yield request


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


def _refuse_malformed_stream(behavior, response_streaming: bool):
    code = grpc.StatusCode.INVALID_ARGUMENT
    if response_streaming:
        async def both(requests, context):
            try:
                result = behavior(_parsed(requests), context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:  # a handler that writes with context.write()
                    await result
            except MalformedRequest as e:
                await context.abort(code, e.reason)
        return both

    async def one(requests, context):
        try:
            return await behavior(_parsed(requests), context)
        except MalformedRequest as e:
            await context.abort(code, e.reason)
    return one


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Every method: a request (or a message of a request stream) that does not parse ends
    the call with INVALID_ARGUMENT (module docstring)."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return handler
        kw = dict(request_deserializer=_parsing(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                _refuse_malformed_stream(handler.stream_stream, True), **kw)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                _refuse_malformed_stream(handler.stream_unary, False), **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _refuse_malformed(handler.unary_stream, True), **kw)
        return grpc.unary_unary_rpc_method_handler(
            _refuse_malformed(handler.unary_unary, False), **kw)
