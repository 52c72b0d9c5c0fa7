"""The pump behind kvtransfer.secure: one thread per TLS connection that does the handshake,
switches the connection to large AES-GCM records keyed inside it (kvtransfer/aead.py), then
moves bytes between that record socket and its end of a socketpair (the backend holds the
other end), and runs bulk writes / reads (:class:`Bulk`) straight on the backend's memory.
Why a thread and how end of stream and lingering work: kvtransfer/secure.py."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
import logging
import select
import selectors
import socket
import ssl
import threading
import time
import weakref

from kvtransfer.aead import AeadSocket, switch

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
CHUNK = 1 << 20  # most bytes a pump moves per read
PAIR_BUFFER = 4 << 20  # each socketpair end's buffers
LINGER_S = 2.0
BULK_PIECE = 4 << 20  # most bytes of a bulk write handed to one record (kvtransfer.aead.MAX_RECORD)
PROGRESS_BYTES = 4 << 20  # a bulk read reports its progress at least this often
WAIT_MS = 100  # a bulk loop's longest wait before the select loop looks around

BY_APP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plain socket -> pump


class Bulk:
    """One bulk write into / read out of the TLS stream, done by the pump thread on the
    backend's memory. ``lock`` is held around every read into ``view``: once ``abort``
    returned, the pump no longer writes into it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, view: memoryview, receive: bool,
                 on_bytes: Callable[[int], None] | None) -> None:
        self.loop, self.receive, self.on_bytes = loop, receive, on_bytes
        self.view = view if view.ndim == 1 and view.format == "B" else view.cast("B")
        self.pos = self.reported = 0
        self.started = self.aborted = False
        self.lock = threading.Lock()
        self.future: asyncio.Future = loop.create_future()

    def abort(self) -> None:
        with self.lock:
            self.aborted = True

    def report(self, final: bool = False, error: BaseException | None = None) -> None:
        """Pump thread: progress (every PROGRESS_BYTES) and, when ``final``, the result."""
        new = self.pos - self.reported
        if not final and new < PROGRESS_BYTES:
            return
        self.reported = self.pos
        pos, fut, on_bytes = self.pos, self.future, self.on_bytes

        def deliver():
            if fut.done():
                return
            if new and on_bytes is not None:
                on_bytes(new)
            if error is not None:
                fut.set_exception(error)
            elif final:
                fut.set_result(pos)
        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed
            pass


class Pump:
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
        self._requests: deque[Bulk] = deque()
        self._requests_lock = threading.Lock()
        self._ended = False  # no more bulk operations: the connection is gone
        self._hold = [False]  # shared with the loop: see hold()
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

    def hold(self, on: bool) -> None:
        """While on, the pump reads TLS only into bulk reads (see :class:`reading`)."""
        self._hold[0] = on
        try:
            self._wake_w.send(b"h")
        except OSError:
            pass

    async def bulk(self, view: memoryview, receive: bool,
                   on_bytes: Callable[[int], None] | None,
                   on_end: Callable[[Callable[[], None]], None] | None = None) -> int:
        """Hand ``view`` to the pump thread (see :func:`sendall`, :func:`recv_exactly`)."""
        op = Bulk(self.loop, view, receive, on_bytes)
        if on_end is not None:
            on_end(op.abort)
        with self._requests_lock:
            if self._ended:
                raise ConnectionResetError("the TLS connection is closed")
            self._requests.append(op)
        try:
            self._wake_w.send(b"b")
        except OSError:
            raise ConnectionResetError("the TLS connection is closed") from None
        try:
            return await op.future
        except BaseException:
            op.abort()
            try:
                self._wake_w.send(b"b")
            except OSError:
                pass
            raise

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
            BY_APP[app] = self
            self._report(app)
            try:
                _Loop(tls, mine, app, self._wake_r, self._stopping, self._requests,
                      self._hold).run()
            finally:
                BY_APP.pop(app, None)
                mine.close()
        finally:
            with self._requests_lock:
                self._ended = True
                left = list(self._requests)
                self._requests.clear()
            for op in left:  # the connection ended under them
                op.report(final=True, error=ConnectionResetError("the TLS connection closed"))
            if tls is not None:
                tls.close()
            self._wake_r.close()
            self._wake_w.close()
            if self.on_exit is not None:
                self.on_exit()

    def _handshake(self) -> AeadSocket:
        raw = self._raw
        raw.setblocking(True)
        raw.settimeout(HANDSHAKE_TIMEOUT_S)
        tls = self._context.wrap_socket(raw, server_side=self._server_side,
                                        server_hostname=self._hostname)
        try:
            self._check(tls.getpeercert(binary_form=True))
            if self._stopping.is_set():
                raise ConnectionAbortedError("stopped during the TLS handshake")
            return switch(tls, self._server_side)  # the records from here on
        except BaseException:
            tls.close()
            raise


class _Loop:
    """The pump's select loop (see :class:`Pump`): one buffer each way, filled by one side
    and drained into the other before it is filled again (no copies but the kernel's and
    OpenSSL's); a bulk operation (:class:`Bulk`) reads from / writes into the backend's
    memory instead, once what came before it went through."""

    def __init__(self, tls: AeadSocket, mine: socket.socket, app: socket.socket,
                 wake: socket.socket, stopping: threading.Event,
                 requests: deque[Bulk], hold: list[bool]) -> None:
        self.tls, self.mine, self.app, self.wake = tls, mine, app, wake
        self.stopping, self.requests, self.hold = stopping, requests, hold
        self.out_buf = memoryview(bytearray(CHUNK))  # backend -> TLS
        self.out: memoryview | None = None  # what is still to be written into TLS
        self.in_buf = memoryview(bytearray(CHUNK))  # TLS -> backend
        self.in_start = self.in_end = 0
        self.app_eof = self.net_eof = self.app_shut = False
        self.linger_until: float | None = None
        self.op: Bulk | None = None  # the bulk operation under way
        self.poller: select.poll | None = None  # the bulk loops' waits

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
                    self._woken()
                    if self.stopping.is_set():
                        return
                self._step(ready)
        except (OSError, ssl.SSLError):
            return  # either side broke: closing both ends tells the other
        finally:
            sel.close()
            if self.op is not None:  # the connection ended under it
                self.op.report(final=True, error=None if self.op.receive and self.net_eof
                               else ConnectionResetError("the TLS connection closed"))

    def _woken(self) -> None:
        try:
            while self.wake.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _want_net(self) -> bool:
        if self.op is not None and self.op.receive and self.op.started:
            return not self.net_eof
        if self.hold[0] and self.op is None:  # the next bulk read takes it
            return False
        return not self.net_eof and self.in_end < CHUNK

    def _want_app(self) -> bool:
        return not self.app_eof and self.out is None and (
            self.op is None or self.op.receive)

    def _interest(self) -> dict:
        net = (selectors.EVENT_READ if self._want_net() else 0) | \
            (selectors.EVENT_WRITE if self.out is not None else 0)
        receiving = self.op is not None and self.op.receive
        app = (selectors.EVENT_READ if self._want_app() else 0) | \
            (selectors.EVENT_WRITE if self.in_end > self.in_start and not receiving else 0)
        return {self.tls: net, self.mine: app}

    def _step(self, ready: dict) -> None:
        if self.op is None and self.requests:
            self.op = self.requests.popleft()
        if self.op is not None:
            self._bulk()
        receiving = self.op is not None and self.op.receive  # TLS goes into its memory
        if not receiving and (ready.get(self.tls, 0) & selectors.EVENT_READ
                              or (self.tls.pending() and self._want_net())):
            self._net_in()
        if ready.get(self.mine, 0) & selectors.EVENT_READ and self._want_app():
            self._app_in()
        if self.out is not None:
            self._net_out()
        if self.in_end > self.in_start and not receiving:
            self._app_out()
        if self.net_eof and self.in_end == self.in_start and not self.app_shut \
                and not receiving:
            self.app_shut = True
            self.mine.shutdown(socket.SHUT_WR)  # the peer ended: end of stream for the backend

    # ---------------------------------------------------------------- bulk operations

    def _bulk(self) -> None:
        op = self.op
        if op.aborted:
            self.op = None
            op.report(final=True, error=ConnectionAbortedError("bulk operation abandoned"))
            if not op.receive and op.started:  # a write cut short: the stream is broken
                raise ConnectionAbortedError("bulk write abandoned")
            return
        if op.receive:
            self._bulk_in(op)
        else:
            self._bulk_out(op)

    def _bulk_out(self, op: Bulk) -> None:
        """Write the backend's bytes into TLS (first what it wrote to the socketpair), in a
        loop of its own while TLS takes them: the select loop only between waits."""
        if not op.started:
            if self.out is not None:
                self._net_out()
                if self.out is not None:
                    return
            if not self.app_eof and self._app_in():
                return  # more of what came before: it goes first
            op.started = True
        while not op.aborted:
            if self.out is not None:
                self._net_out()
                if self.out is not None and not self._wait_net(select.POLLOUT):
                    return  # woken, peer input or a long wait: the select loop's turn
                continue
            if op.pos == len(op.view):
                self.op = None
                op.report(final=True)
                return
            self.out = op.view[op.pos:op.pos + BULK_PIECE]
            op.pos += len(self.out)

    def _bulk_in(self, op: Bulk) -> None:
        """Fill the backend's memory: first what is still in the socketpair for it, then
        what the pump holds, then straight from TLS, in a loop of its own while TLS has
        bytes (the select loop only between waits)."""
        if not op.started:
            with op.lock:
                if op.aborted:
                    return
                self._bulk_in_held(op)
            op.started = True
        view, end, lock, recv_into = op.view, len(op.view), op.lock, self.tls.recv_into
        pos, mark = op.pos, op.pos + PROGRESS_BYTES  # one record per recv_into
        while pos < end and not self.net_eof:
            with lock:
                if op.aborted:
                    return
                try:
                    n = recv_into(view[pos:])
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    n = -1
                except (ssl.SSLZeroReturnError, ConnectionError, ssl.SSLEOFError):
                    n = 0
            if n > 0:
                pos += n
                if pos >= mark:
                    op.pos, mark = pos, pos + PROGRESS_BYTES
                    op.report()
                continue
            op.pos = pos
            if not n:
                self.net_eof = True
                break
            if not self._wait_net(0):
                return  # woken or a long wait: the select loop's turn
        op.pos = pos
        if op.pos == end or self.net_eof:
            self.op = None
            op.report(final=True)

    def _bulk_in_held(self, op: Bulk) -> None:
        """What came before the bulk read: the bytes still in the socketpair (the pump
        stopped writing to it), then those the pump holds."""
        while op.pos < len(op.view):
            try:
                n = self.app.recv_into(op.view[op.pos:])
            except BlockingIOError:
                break
            if not n:
                break
            op.pos += n
        n = min(self.in_end - self.in_start, len(op.view) - op.pos)
        op.view[op.pos:op.pos + n] = self.in_buf[self.in_start:self.in_start + n]
        op.pos += n
        self.in_start += n
        if self.in_start == self.in_end:
            self.in_start = self.in_end = 0

    def _wait_net(self, also: int) -> bool:
        """A bulk loop's wait: True once TLS is readable (and, with ``also``, ready for
        it: POLLOUT); False when woken, on other input, or after WAIT_MS."""
        if self.poller is None:
            self.poller = select.poll()
            self.poller.register(self.wake.fileno(), select.POLLIN)
        self.poller.register(self.tls.fileno(), select.POLLIN | also)  # or modifies
        events = dict(self.poller.poll(WAIT_MS))
        ev = events.get(self.tls.fileno(), 0)
        if self.wake.fileno() in events or not ev:
            return False
        if also:  # a write waits for room; input from the peer is the select loop's
            return not ev & select.POLLIN and bool(ev & also)
        return True

    # ---------------------------------------------------------------- the socketpair

    def _net_in(self) -> None:
        while self._want_net():  # one record per recv_into: read what is there
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

    def _app_in(self) -> bool:
        """Read what the backend wrote; True when there was something."""
        try:
            n = self.mine.recv_into(self.out_buf)
        except BlockingIOError:
            return False
        if n:
            self.out = self.out_buf[:n]
            return True
        self.app_eof = True
        if not _hung_up(self.mine):  # a half-close: the peer may still say why
            self.linger_until = time.monotonic() + LINGER_S
        return False

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
        if not self.app_eof or self.out is not None or self.op is not None:
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
