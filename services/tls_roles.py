"""Per-RPC roles on the gRPC servers: :class:`RoleInterceptor` admits each RPC only from
the roles :data:`RPC_ROLES` lists for it (health and reflection: any cluster certificate; an
unlisted method: nobody). Split out of :mod:`services.tls`, which re-exports every name
here."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
import inspect
import logging

import grpc

from services.tls_certs import pem_role

logger = logging.getLogger("services.tls")

_DECODE = "/pdserve.v1.DecodeWorker/"
_PREFILL = "/pdserve.v1.PrefillWorker/"
RPC_ROLES: dict[str, tuple[str, ...]] = {
    _DECODE + "Generate": ("gateway",),
    _DECODE + "GenerateMany": ("gateway",),
    _DECODE + "Abort": ("gateway",),
    _DECODE + "Stats": ("gateway", "operator"),
    _PREFILL + "Prefill": ("decode", "colocated"),
    _PREFILL + "Abort": ("decode", "colocated"),
    _PREFILL + "Stats": ("gateway", "operator", "decode", "colocated"),
}
# any cluster certificate: probes and service discovery
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# a refused streaming-request call: how long and how many messages the server reads before it
# answers PERMISSION_DENIED (_settle_requests)
REFUSE_READ_S, REFUSE_READ_MESSAGES = 1.0, 64


# ------------------------------------------------------------------------ per-RPC roles
class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Admits each RPC only from the roles :data:`RPC_ROLES` lists for it (health and
    reflection: any cluster certificate; an unlisted method: nobody)."""

    def __init__(self, policy: dict[str, tuple[str, ...]] | None = None,
                 on_reject: Callable[[str, str], None] | None = None):
        self.policy = RPC_ROLES if policy is None else policy
        self._on_reject = on_reject

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        return _checked(handler, method, self.policy.get(method, ()), self._on_reject)


def peer_role(context) -> str | None:
    pems = context.auth_context().get("x509_pem_cert") or ()
    return pem_role(bytes(pems[0])) if pems else None


def _checked(handler: grpc.RpcMethodHandler, method: str, roles: tuple[str, ...],
             on_reject) -> grpc.RpcMethodHandler:
    """``handler`` behind a check of the caller's role."""
    def why(context) -> str | None:
        role = peer_role(context)
        if role in roles:
            return None
        msg = (f"{method} is not open to a {role or 'role-less'} certificate"
               + (f" (only {', '.join(roles)})" if roles else ""))
        logger.warning("refused %s from %s: %s", method, context.peer(), msg)
        if on_reject is not None:
            on_reject(method, role or "")
        return msg

    code = grpc.StatusCode.PERMISSION_DENIED
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        inner = handler.unary_stream

        async def stream(request, context):
            if (msg := why(context)) is not None:
                await context.abort(code, msg)
            res = inner(request, context)
            if inspect.isasyncgen(res):
                async for item in res:
                    yield item
            else:  # a coroutine that writes its responses with context.write
                await res
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.unary_unary is not None:
        inner_u = handler.unary_unary

        async def unary(request, context):
            if (msg := why(context)) is not None:
                await context.abort(code, msg)
            return await inner_u(request, context)
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.stream_stream is not None:  # DecodeWorker.GenerateMany
        inner_s = handler.stream_stream

        async def both(request_iterator, context):
            if (msg := why(context)) is not None:
                await _settle_requests(request_iterator)
                await context.abort(code, msg)
            async for item in inner_s(request_iterator, context):
                yield item
        return grpc.stream_stream_rpc_method_handler(both, **kw)
    # streaming requests only: no pdserve RPC has one; refuse rather than pass unchecked
    async def refuse(request_iterator, context):
        await _settle_requests(request_iterator)
        await context.abort(code, f"{method}: streaming requests are not served here")
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse, **kw)


async def _settle_requests(request_iterator) -> None:
    """Read what the caller has sent (until it half-closes, REFUSE_READ_MESSAGES messages or
    REFUSE_READ_S seconds) before a streaming-request call is refused. Refused at once, the
    call can finish while the client is still writing its first message, and grpc's asyncio
    client then reports its failed write as INTERNAL instead of the server's status (seen in
    CI: PERMISSION_DENIED came back as INTERNAL for Decode.GenerateMany)."""
    async def drain():
        n = 0
        async for _ in request_iterator:
            n += 1
            if n >= REFUSE_READ_MESSAGES:
                return
    try:
        await asyncio.wait_for(drain(), REFUSE_READ_S)
    except Exception:  # noqa: BLE001 - timed out, or the stream broke: refuse all the same
        pass
