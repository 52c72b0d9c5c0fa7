"""Mutual TLS on the control connection, then large AES-GCM records keyed inside it
(kvtransfer/aead.py), for the control messages and the tcp backend's data alike.

With ``KVTransferOptions.tls`` set (a :class:`KVTls`, the worker's cluster identity) every
control connection is mutual TLS: the receiver admits only a sender whose certificate the
cluster CA signed for a role that sends KV (prefill, colocated), the sender only a receiver
of a role that receives it (decode, colocated), whatever address it dialled. For tcp the
blocks travel in those records; the GPU backends (nccl, cuda_ipc, nixl) move their
data outside it (NVLink, NCCL, RDMA), between peers that authenticated each other on it
(docs/security.md); shm (one host) and fake (one process) have no TCP connection.

How: the backends speak to a plain socket (they use ``loop.sock_*``, MSG_PEEK, readers on
the file descriptor). A TLS connection gives them one end of a ``socketpair``; a pump thread
(one per connection: the handshake, then a select loop) moves bytes between the other end
and the TLS socket, in both directions, encrypting without the GIL beside the event loop.
End of stream travels both ways: the TLS peer closing shows as end of stream on the plain socket; the
backend closing its socket closes the TLS connection at once, and a half-close (shutdown of
the write side, to let the peer read an ERROR first) keeps delivering what the peer sends
for up to LINGER_S, as TCP would.

Bulk data (tcp's blocks) skips the socketpair: :func:`sendall` and :func:`recv_exactly` hand
the backend's memory to the pump, which encrypts straight from it / decrypts straight into
it (no socketpair copies, no per-chunk event loop round trip), after whatever the backend
wrote or has not read yet on the plain socket, so the byte order stays that of one stream.
On a plain (non-TLS) socket they are ``loop.sock_sendall`` / ``loop.sock_recv_into``.
The pump thread itself: kvtransfer/tls_pump.py.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
import logging
import socket
import ssl
from typing import Protocol

from kvtransfer.tls_pump import BY_APP, Pump

logger = logging.getLogger(__name__)

class KVTls(Protocol):
    """What kvtransfer needs of a cluster identity (services/tls.py: ClusterTls)."""

    server_hostname: str  # the name every cluster certificate holds

    def server_context(self) -> ssl.SSLContext: ...  # current files (rotation)

    def client_context(self) -> ssl.SSLContext: ...

    def check_sender(self, der: bytes | None) -> None:
        """ValueError unless the peer's certificate may send KV."""

    def check_receiver(self, der: bytes | None) -> None:
        """ValueError unless the peer's certificate may receive KV."""


class Pumps:
    """The TLS connections of one side (each served by its own pump thread); ``close`` ends
    them all."""

    def __init__(self) -> None:
        self.pumps: set[Pump] = set()

    async def start(self, raw: socket.socket, context: ssl.SSLContext, server_side: bool,
                    hostname: str | None, check: Callable[[bytes | None], None]
                    ) -> socket.socket:
        """The TLS handshake on the connected ``raw`` and ``check`` of the peer's
        certificate (in the pump's thread); the plain socket the backend uses. Raises
        ssl.SSLError / OSError / TimeoutError (handshake) or ValueError (``check``)."""
        pump = Pump(raw, context, server_side, hostname, check)
        self.pumps.add(pump)
        pump.on_exit = lambda: self.pumps.discard(pump)
        try:
            return await pump.started()
        except BaseException:
            pump.stop()
            raise

    async def close(self) -> None:
        pumps = list(self.pumps)
        for p in pumps:
            p.stop()
        await asyncio.gather(*(asyncio.to_thread(p.join) for p in pumps))


async def connect(tls: KVTls, pumps: Pumps, host: str, port: int,
                  tune: Callable[[socket.socket], None]) -> socket.socket:
    """A TLS connection to a receiver, checked to be a cluster receiver's; returns the plain
    socket the backend uses. OSError (ssl.SSLError) / PermissionError when it is not."""
    loop = asyncio.get_running_loop()
    raw = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        tune(raw)
        await loop.sock_connect(raw, (host, port))
    except BaseException:
        raw.close()
        raise
    try:
        return await pumps.start(raw, tls.client_context(), False, tls.server_hostname,
                                 tls.check_receiver)
    except ValueError as e:
        raise PermissionError(f"KV receiver {host}:{port}: {e}") from None


async def accept(tls: KVTls, pumps: Pumps, raw: socket.socket) -> socket.socket | None:
    """The TLS handshake on an accepted connection and the sender's check; the plain socket
    the receiver serves, or None (the connection was refused and closed)."""
    try:
        peer = raw.getpeername()
    except OSError:
        peer = "?"
    try:
        return await pumps.start(raw, tls.server_context(), True, None, tls.check_sender)
    except (OSError, TimeoutError, ValueError) as e:
        logger.warning("refused a KV connection from %s: %s", peer, e)
        return None


async def sendall(loop: asyncio.AbstractEventLoop, sock: socket.socket, data) -> None:
    """``loop.sock_sendall``; on a TLS connection's plain socket the pump encrypts ``data``
    straight from its memory (after what was written to ``sock`` before)."""
    pump = BY_APP.get(sock)
    if pump is None:
        await loop.sock_sendall(sock, data)
    else:
        await pump.bulk(memoryview(data), False, None)


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, region,
                       on_bytes: Callable[[int], None],
                       on_end: Callable[[Callable[[], None]], None] | None = None) -> int:
    """Fill ``region`` from ``sock``; ``on_bytes(n)`` as bytes land (in order). Returns the
    bytes received: fewer than ``len(region)`` only at end of stream. On a TLS connection's
    plain socket the pump decrypts straight into ``region``; nothing more is written into it
    once the call was cancelled or, with ``on_end`` (e.g. ``ExpectedTransfer.on_end``), once
    the callback it registers ran (the transfer ended: its waiter may look at the blocks)."""
    view = memoryview(region)
    pump = BY_APP.get(sock)
    if pump is not None:
        return await pump.bulk(view, True, on_bytes, on_end)
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            break
        got += n
        on_bytes(n)
    return got


class reading:
    """``async with secure.reading(sock):`` around a run of :func:`recv_exactly` calls: in
    between them the pump leaves the TLS stream alone (nothing goes through the socketpair
    that the next call would take back). No-op on a plain socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._pump = BY_APP.get(sock)

    async def __aenter__(self) -> "reading":
        if self._pump is not None:
            self._pump.hold(True)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._pump is not None:
            self._pump.hold(False)
