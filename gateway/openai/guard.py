"""What an HTTP connection may hold before it has sent a whole request head: the HTTP front's
connection protocol (uvicorn's httptools protocol) with three limits uvicorn does not have.

- ``max_header_bytes``: the request line and headers of one request, counted as they arrive
  and checked before the parser sees more. Beyond it: 431, connection closed. (httptools
  joins a header value's pieces by concatenation, so an unbounded header costs time
  quadratic in its size on the event loop every other client shares.)
- ``header_timeout_s``: from the moment a connection opens, and again from the first byte of
  each later request, the head must be complete within this time. Else: 408, closed. (uvicorn
  times only idle keep-alive connections after a response; a connection that never sends a
  request, or sends its head a byte at a time, was held forever.)
- ``max_connections``: connections open at once; a new one beyond it is answered 503 and
  closed at once, so the file descriptors that remain serve the gRPC side and the clients
  already in.

The body has its own size limit and timeout in the application (app.py). Imported only when
the HTTP front starts (a gateway with ``http_port 0`` never loads uvicorn).
"""
from __future__ import annotations

import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


def _response(status: bytes, msg: str) -> bytes:
    body = msg.encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
            + body)


def guarded_protocol(max_header_bytes: int, header_timeout_s: float, max_connections: int):
    """A uvicorn ``http`` protocol class with the limits above."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,),
                {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s,
                 "max_connections": max_connections})


class GuardedHttpProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024
    header_timeout_s = 10.0
    max_connections = 8192

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._in_head = True
        self._head_timer = None
        if len(self.connections) > self.max_connections:
            logger.warning("HTTP: %d connections open (http_max_connections %d): refusing a "
                           "new one", len(self.connections) - 1, self.max_connections)
            self._refuse(b"503 Service Unavailable", "too many connections\n")
            return
        self._arm()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: bytes, msg: str) -> None:
        self._disarm()
        self._in_head = False
        if not self.transport.is_closing():
            self.transport.write(_response(status, msg))
            self.transport.close()

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(b"408 Request Timeout",
                         f"request head not received in {self.header_timeout_s:g} s\n")

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += len(data)
            # one read may hold the end of the head and a body: count it, but judge only once
            # the head is still incomplete after the parser saw it
            if self._head_bytes - len(data) > self.max_header_bytes:
                self._too_large()
                return
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_header_bytes \
                and not self.transport.is_closing():
            self._too_large()

    def _too_large(self) -> None:
        self._refuse(b"431 Request Header Fields Too Large",
                     f"request line and headers exceed {self.max_header_bytes} bytes\n")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # a later request on this connection: count afresh (from
            self._in_head = True  # the next read: at most one read goes uncounted)
            self._head_bytes = 0
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)
