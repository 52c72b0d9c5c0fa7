"""TLS on the control connection (and the tcp backend's data, which shares it).

With ``KVTransferOptions.tls`` set (a :class:`KVTls`, the worker's cluster identity) every
control connection is mutual TLS: the receiver admits only a sender whose certificate the
cluster CA signed for a role that sends KV (prefill, colocated), the sender only a receiver
of a role that receives it (decode, colocated), whatever address it dialled. For tcp the
blocks travel inside that TLS stream; the GPU backends (nccl, cuda_ipc, nixl) move their
data outside it (NVLink, NCCL, RDMA), between peers that authenticated each other on it
(docs/security.md); shm (one host) and fake (one process) have no TCP connection.

How: the backends speak to a plain socket (they use ``loop.sock_*``, MSG_PEEK, readers on
the file descriptor). A TLS connection gives them one end of a ``socketpair``; a pump task
moves bytes between the other end and the TLS stream, in both directions. End of stream
travels both ways: the TLS peer closing shows as end of stream on the plain socket; the
backend closing its socket closes the TLS connection at once, and a half-close (shutdown of
the write side, to let the peer read an ERROR first) keeps delivering what the peer sends
for up to LINGER_S, as TCP would.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
import logging
import select
import socket
import ssl
from typing import Protocol

from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
CHUNK = 1 << 20  # most bytes a pump moves per read
PAIR_BUFFER = 4 << 20  # each socketpair end's buffers
LINGER_S = 2.0


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
    """The pump tasks of one side's TLS connections; ``close`` ends them all."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
              ) -> socket.socket:
        """A plain socket whose bytes travel over the TLS stream ``reader``/``writer``."""
        app, mine = socket.socketpair()
        for s in (app, mine):
            s.setblocking(False)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, PAIR_BUFFER)
        task = asyncio.get_running_loop().create_task(_pump(reader, writer, mine))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return app

    async def close(self) -> None:
        await cancel_and_wait(list(self.tasks))


def _peer_der(writer: asyncio.StreamWriter) -> bytes | None:
    obj = writer.get_extra_info("ssl_object")
    return obj.getpeercert(binary_form=True) if obj is not None else None


async def connect(tls: KVTls, pumps: Pumps, host: str, port: int,
                  tune: Callable[[socket.socket], None]) -> socket.socket:
    """A TLS connection to a receiver, checked to be a cluster receiver's; returns the plain
    socket the backend uses. OSError (ssl.SSLError) / PermissionError when it is not."""
    loop = asyncio.get_running_loop()
    raw = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        tune(raw)
        await loop.sock_connect(raw, (host, port))
        reader, writer = await asyncio.open_connection(
            sock=raw, ssl=tls.client_context(), server_hostname=tls.server_hostname,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S, limit=CHUNK)
    except BaseException:
        raw.close()
        raise
    try:
        tls.check_receiver(_peer_der(writer))
    except ValueError as e:
        writer.close()
        raise PermissionError(f"KV receiver {host}:{port}: {e}") from None
    return pumps.spawn(reader, writer)


async def accept(tls: KVTls, pumps: Pumps, raw: socket.socket) -> socket.socket | None:
    """The TLS handshake on an accepted connection and the sender's check; the plain socket
    the receiver serves, or None (the connection was refused and closed)."""
    loop = asyncio.get_running_loop()
    try:
        peer = raw.getpeername()
    except OSError:
        peer = "?"
    reader = asyncio.StreamReader(limit=CHUNK)
    protocol = asyncio.StreamReaderProtocol(reader)
    try:
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, raw, ssl=tls.server_context(),
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
    except (OSError, TimeoutError, asyncio.TimeoutError) as e:
        logger.warning("refused a KV connection from %s: TLS handshake failed: %s", peer, e)
        raw.close()
        return None
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    try:
        tls.check_sender(_peer_der(writer))
    except ValueError as e:
        logger.warning("refused a KV connection from %s: %s", peer, e)
        writer.close()
        return None
    return pumps.spawn(reader, writer)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the other end of a socketpair closed (not just shut its write side)."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLHUP)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _, ev in p.poll(0))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                mine: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    down = loop.create_task(_down(loop, reader, mine))
    try:
        while True:  # the backend's bytes -> TLS
            try:
                data = await loop.sock_recv(mine, CHUNK)
            except OSError:
                break
            if not data:
                break
            writer.write(data)
            await writer.drain()
        await _linger(loop, mine, down)
    except (OSError, ConnectionError):
        pass
    finally:
        await cancel_and_wait([down])
        writer.close()
        mine.close()


async def _linger(loop: asyncio.AbstractEventLoop, mine: socket.socket,
                  down: asyncio.Task) -> None:
    """The backend stopped writing: a close ends at once, a half-close keeps the other way
    open until the peer ends, the backend closes, or LINGER_S."""
    deadline = loop.time() + LINGER_S
    while not down.done() and not _hung_up(mine) and loop.time() < deadline:
        await asyncio.wait({down}, timeout=0.05)


async def _down(loop: asyncio.AbstractEventLoop, reader: asyncio.StreamReader,
                mine: socket.socket) -> None:
    """TLS -> the backend's socket; then end of stream on it."""
    try:
        while data := await reader.read(CHUNK):
            await loop.sock_sendall(mine, data)
    except (OSError, ConnectionError, ssl.SSLError):
        pass
    finally:
        try:
            mine.shutdown(socket.SHUT_WR)
        except OSError:
            pass
