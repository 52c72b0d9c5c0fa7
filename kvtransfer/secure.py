"""TLS on the control connection (and the tcp backend's data, which shares it).

With ``KVTransferOptions.tls`` set (a :class:`KVTls`, the worker's cluster identity) every
control connection is mutual TLS: the receiver admits only a sender whose certificate the
cluster CA signed for a role that sends KV (prefill, colocated), the sender only a receiver
of a role that receives it (decode, colocated), whatever address it dialled. For tcp the
blocks travel inside that TLS stream; the GPU backends (nccl, cuda_ipc, nixl) move their
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
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
import logging
import select
import selectors
import socket
import ssl
import threading
import time
from typing import Protocol

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
    """The TLS connections of one side (each served by its own pump thread); ``close`` ends
    them all."""

    def __init__(self) -> None:
        self.pumps: set[_Pump] = set()

    async def start(self, raw: socket.socket, context: ssl.SSLContext, server_side: bool,
                    hostname: str | None, check: Callable[[bytes | None], None]
                    ) -> socket.socket:
        """The TLS handshake on the connected ``raw`` and ``check`` of the peer's
        certificate (in the pump's thread); the plain socket the backend uses. Raises
        ssl.SSLError / OSError / TimeoutError (handshake) or ValueError (``check``)."""
        pump = _Pump(raw, context, server_side, hostname, check)
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


class _Pump:
    """One TLS connection: a thread does the handshake, then moves bytes between the TLS
    socket and its end of a socketpair (the other end is the backend's), both non-blocking,
    in one select loop: OpenSSL runs without the GIL, beside the event loop, and one thread
    per connection means no two threads ever use one SSL object."""

    def __init__(self, raw: socket.socket, context: ssl.SSLContext, server_side: bool,
                 hostname: str | None, check: Callable[[bytes | None], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self._ready: asyncio.Future = self.loop.create_future()
        self._raw, self._context, self._server_side = raw, context, server_side
        self._hostname, self._check = hostname, check
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = threading.Event()
        self.on_exit: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._main, name="kv-tls", daemon=True)
        self._thread.start()

    async def started(self) -> socket.socket:
        return await self._ready

    def stop(self) -> None:
        self._stopping.set()
        for wake in (lambda: self._wake_w.send(b"x"),
                     lambda: self._raw.shutdown(socket.SHUT_RDWR)):  # ends a handshake
            try:
                wake()
            except OSError:
                pass

    def join(self) -> None:
        self._thread.join()

    def _report(self, result=None, error: BaseException | None = None) -> None:
        def set_it():
            if self._ready.done():  # the caller gave up: nobody will use the socket
                if result is not None:
                    result.close()
                return
            if error is not None:
                self._ready.set_exception(error)
            else:
                self._ready.set_result(result)
        try:
            self.loop.call_soon_threadsafe(set_it)
        except RuntimeError:  # the loop is closed
            if result is not None:
                result.close()

    def _main(self) -> None:
        tls = None
        try:
            try:
                tls = self._handshake()
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                self._raw.close()
                self._report(error=e)
                return
            app, mine = socket.socketpair()
            for s_ in (app, mine):
                s_.setblocking(False)
                for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    s_.setsockopt(socket.SOL_SOCKET, opt, PAIR_BUFFER)
            self._report(app)
            try:
                _Loop(tls, mine, self._wake_r, self._stopping).run()
            finally:
                mine.close()
        finally:
            if tls is not None:
                tls.close()
            self._wake_r.close()
            self._wake_w.close()
            if self.on_exit is not None:
                self.on_exit()

    def _handshake(self) -> ssl.SSLSocket:
        raw = self._raw
        raw.setblocking(True)
        raw.settimeout(HANDSHAKE_TIMEOUT_S)
        tls = self._context.wrap_socket(raw, server_side=self._server_side,
                                        server_hostname=self._hostname)
        try:
            self._check(tls.getpeercert(binary_form=True))
            if self._stopping.is_set():
                raise ConnectionAbortedError("stopped during the TLS handshake")
        except BaseException:
            tls.close()
            raise
        tls.setblocking(False)
        return tls


class _Loop:
    """The pump's select loop (see :class:`_Pump`): one buffer each way, filled by one side
    and drained into the other before it is filled again (no copies but the kernel's and
    OpenSSL's)."""

    def __init__(self, tls: ssl.SSLSocket, mine: socket.socket, wake: socket.socket,
                 stopping: threading.Event) -> None:
        self.tls, self.mine, self.wake, self.stopping = tls, mine, wake, stopping
        self.out_buf = memoryview(bytearray(CHUNK))  # backend -> TLS
        self.out: memoryview | None = None  # what is still to be written into TLS
        self.in_buf = memoryview(bytearray(CHUNK))  # TLS -> backend
        self.in_start = self.in_end = 0
        self.app_eof = self.net_eof = self.app_shut = False
        self.linger_until: float | None = None

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.wake, selectors.EVENT_READ)
        try:
            while not self.stopping.is_set() and not self._finished():
                timeout = 0 if (self.tls.pending() and self._want_net()) else 0.5
                for s_, mask in self._interest().items():
                    _set(sel, s_, mask)
                ready = dict((k.fileobj, m) for k, m in sel.select(timeout))
                if self.wake in ready:
                    return
                self._step(ready)
        except (OSError, ssl.SSLError):
            return  # either side broke: closing both ends tells the other
        finally:
            sel.close()

    def _want_net(self) -> bool:
        return not self.net_eof and self.in_end < CHUNK

    def _want_app(self) -> bool:
        return not self.app_eof and self.out is None

    def _interest(self) -> dict:
        net = (selectors.EVENT_READ if self._want_net() else 0) | \
            (selectors.EVENT_WRITE if self.out is not None else 0)
        app = (selectors.EVENT_READ if self._want_app() else 0) | \
            (selectors.EVENT_WRITE if self.in_end > self.in_start else 0)
        return {self.tls: net, self.mine: app}

    def _step(self, ready: dict) -> None:
        if ready.get(self.tls, 0) & selectors.EVENT_READ or (self.tls.pending()
                                                             and self._want_net()):
            self._net_in()
        if ready.get(self.mine, 0) & selectors.EVENT_READ and self._want_app():
            self._app_in()
        if self.out is not None:
            self._net_out()
        if self.in_end > self.in_start:
            self._app_out()
        if self.net_eof and self.in_end == self.in_start and not self.app_shut:
            self.app_shut = True
            self.mine.shutdown(socket.SHUT_WR)  # the peer ended: end of stream for the backend

    def _net_in(self) -> None:
        while self._want_net():  # one TLS record per recv_into: read what is there
            try:
                n = self.tls.recv_into(self.in_buf[self.in_end:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except (ssl.SSLZeroReturnError, ConnectionError, ssl.SSLEOFError):
                n = 0
            if not n:
                self.net_eof = True
                return
            self.in_end += n

    def _app_out(self) -> None:
        try:
            n = self.mine.send(self.in_buf[self.in_start:self.in_end])
        except BlockingIOError:
            return
        self.in_start += n
        if self.in_start == self.in_end:
            self.in_start = self.in_end = 0

    def _app_in(self) -> None:
        try:
            n = self.mine.recv_into(self.out_buf)
        except BlockingIOError:
            return
        if n:
            self.out = self.out_buf[:n]
            return
        self.app_eof = True
        if not _hung_up(self.mine):  # a half-close: the peer may still say why
            self.linger_until = time.monotonic() + LINGER_S

    def _net_out(self) -> None:
        # a write that wants to be retried is retried with the same bytes (OpenSSL's rule)
        try:
            n = self.tls.send(self.out)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
            return
        self.out = self.out[n:] if n < len(self.out) else None

    def _finished(self) -> bool:
        """Done once the backend stopped writing and everything it wrote went out: at once
        when it closed, after the peer ended or LINGER_S when it only half-closed."""
        if not self.app_eof or self.out is not None:
            return False
        if self.linger_until is None or self.net_eof:
            return True
        return time.monotonic() > self.linger_until or _hung_up(self.mine)


def _set(sel: selectors.BaseSelector, sock, mask: int) -> None:
    try:
        key = sel.get_key(sock)
    except KeyError:
        key = None
    if not mask:
        if key is not None:
            sel.unregister(sock)
    elif key is None:
        sel.register(sock, mask)
    elif key.events != mask:
        sel.modify(sock, mask)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the other end of a socketpair closed (not just shut its write side)."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLHUP)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _, ev in p.poll(0))
