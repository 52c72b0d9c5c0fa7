"""API-key authentication of the gateway's clients (gRPC metadata).

A client sends ``authorization: Bearer <key>`` (or ``x-api-key: <key>``) with each call. When
the gateway is started with keys (``--api-key-file`` with one key per line, or
``PDSERVE_API_KEYS=k1,k2``; a ``--api-keys`` flag works too but shows in ``ps``), every RPC but
the health checks and server reflection must carry one of them, else it ends with
UNAUTHENTICATED and a message saying what was wrong, before any work is done. Keys are compared
in constant time. Without keys nothing is checked (a local cluster, or a gateway behind a proxy
that authenticates).

A key may be stored as its hash, ``sha256:<64 hex digits>`` (``pdserve hash-key`` prints it):
the gateway then never holds the key itself, and a leaked key file grants nothing.

Clients (:func:`pdserve.client.channel`) add the header from ``PDSERVE_API_KEY`` or their
``--api-key`` option. The workers' RPCs are internal (decode -> prefill, gateway -> workers):
they admit only callers with a cluster certificate of the right role (services/tls.py).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
import hashlib
import hmac
import logging
import re

import grpc

logger = logging.getLogger(__name__)

# RPCs anyone may call: load balancers' and orchestrators' probes, and service discovery
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def load_api_keys(keys: Iterable[str] = (), key_file: str = "") -> tuple[str, ...]:
    """The accepted keys: ``keys`` plus one per non-empty, non-comment line of ``key_file``.
    Raises ValueError for an unreadable file or a key with whitespace inside."""
    out = [k.strip() for k in keys if k.strip()]
    if key_file:
        from pdcore.files import read_small_text
        text = read_small_text(key_file, "api_key_file")  # regular, small, UTF-8
        out += [ln.strip() for ln in text.splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
        if not out:
            raise ValueError(f"api_key_file {key_file!r} holds no key")
    for k in out:
        problem = api_key_problem(k)
        if problem:
            where = f" in api_key_file {key_file!r}" if key_file else ""
            raise ValueError(f"an API key{where} {problem}")
        if k.startswith(HASH_PREFIX) and not _HASH.fullmatch(k):
            raise ValueError("a stored key hash must be sha256: and 64 hex digits")
    return tuple(dict.fromkeys(out))


def api_key_problem(key: str) -> str | None:
    """What makes ``key`` unusable as an API key, or None: it travels as a gRPC metadata
    value and an HTTP header, so printable ASCII without whitespace (33..126) only. The
    message never shows the key."""
    if not key:
        return "is empty"
    for i, c in enumerate(key):
        if not 33 <= ord(c) <= 126:
            what = ("whitespace" if c.isspace() else
                    "a control character" if ord(c) < 32 or ord(c) == 127 else
                    "a non-ASCII character")
            return (f"must be printable ASCII without whitespace; character {i + 1} is "
                    f"{what} (U+{ord(c):04X})")
    return None


HASH_PREFIX = "sha256:"
_HASH = re.compile(r"sha256:[0-9a-f]{64}")


def presented_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key a call carries: ``authorization: Bearer <key>`` or ``x-api-key: <key>``."""
    for name, value in metadata or ():
        name = name.lower()
        if isinstance(value, bytes):
            continue
        if name == "authorization":
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == "x-api-key" and value.strip():
            return value.strip()
    return None


class ApiKeys:
    """The configured keys, plain or stored as ``sha256:`` hashes: the one check both fronts
    (gRPC's interceptor, the HTTP API) use."""

    def __init__(self, keys: Iterable[str]):
        keys = list(keys)
        self._keys = [k.encode() for k in keys if not _HASH.fullmatch(k)]
        self._hashes = [bytes.fromhex(k[len(HASH_PREFIX):]) for k in keys if _HASH.fullmatch(k)]

    def __bool__(self) -> bool:
        return bool(self._keys or self._hashes)

    def valid(self, key: str) -> bool:
        given = key.encode()
        digest = hashlib.sha256(given).digest()
        ok = False
        for k in self._keys:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(given, k)
        for h in self._hashes:
            ok |= hmac.compare_digest(digest, h)
        return ok


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every non-exempt RPC without a valid key with UNAUTHENTICATED."""

    def __init__(self, keys: Iterable[str], on_reject: Callable[[str], None] | None = None):
        self._check = ApiKeys(keys)
        if not self._check:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._on_reject = on_reject

    def _valid(self, key: str) -> bool:
        return self._check.valid(key)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method or ""
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(details)
        key = presented_key(details.invocation_metadata)
        if key is not None and self._valid(key):
            return await continuation(details)
        why = ("missing API key: send the metadata 'authorization: Bearer <key>'" if key is None
               else "invalid API key")
        logger.info("refused %s: %s", method, why)
        if self._on_reject is not None:
            self._on_reject(method)
        handler = await continuation(details)
        return None if handler is None else _refusing(handler, why)


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only aborts with UNAUTHENTICATED."""
    code = grpc.StatusCode.UNAUTHENTICATED
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.response_streaming:
        async def stream(request, context):
            await context.abort(code, why)
            yield  # pragma: no cover - an async generator that never yields

        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, **kw)
        return grpc.unary_stream_rpc_method_handler(stream, **kw)

    async def unary(request, context):
        await context.abort(code, why)

    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
