"""The control connection every TCP-connected backend shares (tcp, nccl, cuda_ipc, nixl).

Each transfer runs over one TCP connection to the receiver's endpoint
(``<scheme>://host:port``): for tcp it carries the payload too, for the GPU backends it is
the *control* connection while the data moves over NVLink / NCCL / NIXL. A connection whose
transfer ended DONE is kept for the next transfer to the same receiver (a sender keeps up to
POOL_PER_ENDPOINT idle ones per receiver for up to POOL_IDLE_S, a receiver waits up to
RECEIVER_IDLE_S for the next HELLO on it): no connect, accept or TCP slow start per transfer.
Any other outcome closes it::

    sender                                   receiver
    HELLO (kind, layout, transfer id, n)  -> claim the expected transfer
                                          <- OK (accepted) | ERROR (why)
    ... backend-specific exchange: BLOBs with metadata, data over NVLink / NCCL / NIXL,
        one part at a time as the sender's BlockStream hands the blocks over ...
                                          <- OK (the blocks are in place) | ERROR (why)

A sender connects (or takes a kept connection) when its request arrives, so HELLO and the
backend's set-up overlap the prompt's forward pass; parts (each prefill chunk's blocks,
handed over when the chunk is queued on the GPU) follow, each moved once its KV is written.
A one-sided backend (cuda_ipc, nixl: the receiver reads the blocks) whose blocks are all
readable when the send starts (a retry, a benchmark) writes its payload right behind HELLO
and reads the answer to HELLO with the ack: one round trip less; a receiver that rejects
it reads the payload away before closing, so the sender gets the reason, not a connection
reset.

The control connection is also how each side learns that the other gave up: a side that
times out, is cancelled or fails closes it (after an ERROR saying why when it can), and the
peer's pending read ends at once.

Composition: :class:`ControlClient` (a sender's channel) and :class:`ControlServer` (a
receiver's channel) run the connection, the handshake and the ack; a backend plugs in a
:class:`PayloadSender` / :class:`PayloadReceiver` that moves the data in between.
:class:`Listener` (the accept loop and its connection tasks) is shared with the shm backend.
With ``KVTransferOptions.tls`` the connection is mutual TLS between cluster members
(:mod:`kvtransfer.secure`); the backends still see a plain socket. Timeouts, cancellation
and statistics are :mod:`kvtransfer.lifecycle`'s; waiting on device
work while watching the connection is :mod:`kvtransfer.waits`'.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from kvtransfer import secure, wire
from kvtransfer.api import (
    KVLayout,
    KVTransferOptions,
    ListenAddress,
    TransferError,
    TransferState,
)
from kvtransfer.lifecycle import (
    ExpectedTransfer,
    Receiver,
    ReceiverTracker,
    Sender,
    TransferStateMachine,
)
from kvtransfer.stream import BlockStream
from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 30.0
POOL_IDLE_S = 30.0  # a sender reuses a connection idle at most this long
POOL_PER_ENDPOINT = 8  # idle connections a sender keeps per receiver
# a receiver closes a connection idle this long: well above POOL_IDLE_S, so a sender never
# picks a connection its receiver is closing (only a receiver's exit or restart does that,
# which fails the transfer as any receiver crash would)
RECEIVER_IDLE_S = 120.0
LINGER_S = 1.0  # most a rejecting receiver waits for the sender to hang up
LEASE_DRAIN_TIMEOUT_S = 10.0  # most a failed one-sided send waits for the receiver to stop
# a new connection to a receiver (TCP connect and TLS handshake) that takes longer fails, so
# a partitioned or hung receiver costs this, not the transfer's whole deadline; after a
# failed connection, sends to that receiver fail at once for UNREACHABLE_COOLDOWN_S (the
# decode worker then prefills locally) and the first one after it tries again
CONNECT_TIMEOUT_S = 5.0
UNREACHABLE_COOLDOWN_S = 5.0
# the same after an eager payload that the receiver never even answered HELLO to: it has not
# looked at the transfer for its whole lifetime, and whatever it reads later finds our ERROR
# right behind the payload (checked before it counts a transfer DONE)
UNANSWERED_DRAIN_TIMEOUT_S = 0.5


def tune_socket(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def require_cuda(cache: torch.Tensor, backend: str) -> None:
    """GPU-to-GPU backends move blocks of a contiguous CUDA cache only."""
    if cache.device.type != "cuda" or not cache.is_contiguous():
        raise ValueError(f"the {backend} backend needs a contiguous CUDA cache tensor")


def parse_host_port(endpoint: str, scheme: str) -> tuple[str, int]:
    host, _, port = wire.parse_endpoint(endpoint, scheme).rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise TransferError(f"bad {scheme} endpoint {endpoint!r}")
    return host, int(port)


# ------------------------------------------------------------------ what a backend plugs in


class PayloadSender(Protocol):
    """A backend's sending half: moves the data once the control connection is up."""

    # True for backends whose payload messages may follow HELLO before the receiver accepted
    # (one-sided: the payload is metadata, the receiver moves the data)
    eager: bool

    async def send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, endpoint: str,
                   sm: TransferStateMachine, blocks: BlockStream) -> None:
        """Move the blocks as ``blocks`` hands them over and return once the receiver acked
        them all (:func:`await_ack`) and this side no longer reads them. Raise
        TransferError / OSError to fail the transfer."""

    def close(self) -> None:
        """Release backend resources (communicators, exports). Called once."""


class PayloadReceiver(Protocol):
    """A backend's receiving half: brings one accepted transfer's blocks into place."""

    async def start(self) -> None:
        """Called once the listener is up (background work such as sweeps starts here)."""

    async def receive(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      entry: ExpectedTransfer) -> str | None:
        """Bring the transfer's blocks into ``entry.dst_block_ids``; raise to fail it.

        Must not return before the data is in place (device work complete), and must stop
        touching the blocks when cancelled. May return a message for the final OK (e.g.
        :func:`~kvtransfer.wire.data_seconds_message`).
        """

    def close(self) -> None:
        """Release backend resources (communicators, mappings). Called once."""


def control_sender(cache: torch.Tensor, layout: KVLayout, scheme: str, kind: int,
                   payload: PayloadSender, shared: KVTransferOptions,
                   tune: Callable[[socket.socket], None] = tune_socket) -> Sender:
    """A sender whose transfers run over control connections to ``scheme://`` endpoints."""
    return Sender(cache, layout, ControlClient(layout, scheme, kind, payload, tune,
                                               tls=shared.tls), shared)


def control_receiver(cache: torch.Tensor, layout: KVLayout, scheme: str, kind: int,
                     payload: PayloadReceiver, shared: KVTransferOptions,
                     listen: ListenAddress | None,
                     tune: Callable[[socket.socket], None] = tune_socket) -> Receiver:
    """A receiver listening for control connections at ``listen`` (default: localhost, any
    port)."""
    layout.validate(cache)
    tracker = ReceiverTracker(cache.shape[0], layout.block_bytes, shared)
    server = ControlServer(tracker, layout, scheme, kind, payload,
                           listen or ListenAddress(), tune, tls=shared.tls)
    return Receiver(tracker, server)


# ------------------------------------------------------------------ receiving side


class Listener:
    """Accepts connections on a bound, listening socket and serves each one in a task of
    its own; ``close`` cancels them all and closes the socket."""

    def __init__(self, sock: socket.socket, serve: Callable[[socket.socket], Awaitable[None]],
                 what: str, tune: Callable[[socket.socket], None]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._serve = serve
        self._what = what
        self._tune = tune
        self._accept_task: asyncio.Task | None = None
        self.connections: set[asyncio.Task] = set()  # being served now
        self.accepted = 0  # connections so far (reused ones count once)

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        await cancel_and_wait([self._accept_task, *self.connections])
        self._accept_task = None
        self.sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                logger.warning("%s receiver accept failed: %s", self._what, exc)
                await asyncio.sleep(0.05)
                continue
            self._tune(conn)
            self.accepted += 1
            task = loop.create_task(self._serve(conn))
            self.connections.add(task)
            task.add_done_callback(self.connections.discard)


class ControlServer:
    """A receiver's channel: listens on TCP, runs each connection's transfers one after
    another (HELLO, claim, the payload's ``receive``, ack)."""

    def __init__(self, tracker: ReceiverTracker, layout: KVLayout, scheme: str, kind: int,
                 payload: PayloadReceiver, listen: ListenAddress,
                 tune: Callable[[socket.socket], None] = tune_socket,
                 tls: secure.KVTls | None = None) -> None:
        self.tracker = tracker
        self.tls = tls
        self.pumps = secure.Pumps()
        self.layout = layout
        self.scheme = scheme
        self.kind = kind
        self.payload = payload
        self._listen = listen
        self._tune = tune
        self._port = listen.port
        self.listener: Listener | None = None

    @property
    def connections_accepted(self) -> int:
        return self.listener.accepted if self.listener is not None else 0

    async def start(self) -> None:
        host = self._listen.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, self._port))
        sock.listen(128)
        self._port = sock.getsockname()[1]
        serve = self._serve if self.tls is None else self._serve_tls
        self.listener = Listener(sock, serve, self.scheme, self._tune)
        self.listener.start()
        await self.payload.start()

    @property
    def endpoint(self) -> str:
        if self.listener is None:
            raise RuntimeError("receiver not started")
        advertise = self._listen.advertise_host or self._listen.host
        host = f"[{advertise}]" if ":" in advertise else advertise
        return f"{self.scheme}://{host}:{self._listen.advertise_port or self._port}"

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()
            self.listener = None
        await self.pumps.close()
        self.payload.close()

    async def _serve_tls(self, raw: socket.socket) -> None:
        conn = await secure.accept(self.tls, self.pumps, raw)
        if conn is not None:
            await self._serve(conn)

    async def _serve(self, conn: socket.socket) -> None:
        """Serve the connection's transfers one after another, while each ends DONE and
        the sender sends the next HELLO within RECEIVER_IDLE_S."""
        loop = asyncio.get_running_loop()
        try:
            while await self._serve_one(loop, conn):
                if not await _readable(loop, conn, RECEIVER_IDLE_S):
                    return
        finally:
            conn.close()

    async def _serve_one(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bool:
        """One transfer on the connection; True when it ended DONE and was acked (the
        connection is clean: the sender may send its next HELLO on it)."""
        entry: ExpectedTransfer | None = None
        try:
            entry = await self._claim(loop, conn)
            if entry is None:
                return False
            await loop.sock_sendall(conn, wire.encode_reply(wire.OK))
            entry.mark("hello_ok")
            await entry.destination()  # expected by count: the ids may still be on their way
            message = await self.payload.receive(loop, conn, entry)
            if wire.peer_failed(conn):  # gave up while the data moved: its blocks may be gone
                raise TransferError(f"peer gave up: {await wire.peer_reason(loop, conn)}")
            entry.mark("landed")
            if not entry.finish(TransferState.DONE):  # it timed out or was cancelled meanwhile
                return False
            await loop.sock_sendall(conn, wire.encode_reply(wire.OK, 0, message or ""))
            return True
        except asyncio.CancelledError:
            if entry is not None:
                wire.try_send_error(conn, f"transfer {entry.transfer_id} "
                                          f"{entry.state.value} on receiver")
            raise
        except (OSError, EOFError, TransferError) as exc:
            if entry is not None:
                if entry.finish(TransferState.FAILED, f"{type(exc).__name__}: {exc}"):
                    wire.try_send_error(conn, str(exc))
            else:
                logger.debug("%s receiver dropped a connection: %s", self.scheme, exc)
        except Exception as exc:  # noqa: BLE001 - never leave a transfer hanging on a bug
            logger.exception("%s receiver: unexpected error", self.scheme)
            if entry is not None and entry.finish(TransferState.FAILED, f"receiver error: {exc!r}"):
                wire.try_send_error(conn, f"receiver error: {exc!r}")
        return False

    async def _claim(self, loop: asyncio.AbstractEventLoop,
                     conn: socket.socket) -> ExpectedTransfer | None:
        """Read a HELLO and claim its transfer; None after rejecting it (the sender got an
        ERROR saying why)."""
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            hello = await wire.read_hello(loop, conn)
        try:
            if hello.kind != self.kind:
                raise TransferError(f"{self.scheme} receiver got a kind {hello.kind} sender")
            return self.tracker.claim(hello.transfer_id, hello.num_blocks,
                                      wire.layout_error(hello, self.layout,
                                                        self.tracker.options.checksums),
                                      owner=asyncio.current_task())
        except TransferError as exc:
            await loop.sock_sendall(conn, wire.encode_reply(wire.ERROR, 0, str(exc)))
            await _linger(loop, conn)
            return None


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    timeout_s: float) -> bool:
    """Wait until ``sock`` has input (or end of stream); False after ``timeout_s``."""
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        async with asyncio.timeout(timeout_s):
            await ready
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


async def _linger(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    """After an ERROR: let the sender read it. Closing a socket with unread input (an eager
    sender's payload) resets the connection, and a reset can discard the ERROR before the
    sender read it; so stop writing, read until the sender hangs up, then close."""
    try:
        conn.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(LINGER_S):
            while await loop.sock_recv(conn, 65536):
                pass
    except (OSError, TimeoutError):
        pass


# ------------------------------------------------------------------ sending side


class ConnectionPool:
    """A sender's idle control connections, by receiver endpoint: the most recently used
    first, each at most POOL_IDLE_S old, at most POOL_PER_ENDPOINT per receiver."""

    def __init__(self, idle_s: float = POOL_IDLE_S, per_endpoint: int = POOL_PER_ENDPOINT):
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}
        self._idle_s = idle_s
        self._per_endpoint = per_endpoint

    def take(self, endpoint: str) -> socket.socket | None:
        """An idle connection that is still open and has nothing unread, else None."""
        idle = self._idle.get(endpoint)
        now = time.monotonic()
        while idle:
            sock, since = idle.pop()
            if now - since <= self._idle_s and _quiet(sock):
                return sock
            sock.close()
        return None

    def give(self, endpoint: str, sock: socket.socket) -> None:
        idle = self._idle.setdefault(endpoint, [])
        if len(idle) >= self._per_endpoint:
            sock.close()
            return
        idle.append((sock, time.monotonic()))

    def idle(self, endpoint: str) -> int:
        return len(self._idle.get(endpoint, ()))

    def close(self) -> None:
        for idle in self._idle.values():
            for sock, _ in idle:
                sock.close()
        self._idle.clear()


def _quiet(sock: socket.socket) -> bool:
    """An idle connection is usable while nothing waits on it: a receiver that closed it
    shows end of stream (or a reset), and any bytes would be out of protocol."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


class ControlClient:
    """A sender's channel: runs each transfer over a control connection (a pooled one when
    the last transfer to that receiver left one); the payload moves the data."""

    def __init__(self, layout: KVLayout, scheme: str, kind: int, payload: PayloadSender,
                 tune: Callable[[socket.socket], None] = tune_socket,
                 tls: secure.KVTls | None = None) -> None:
        self.layout = layout
        self.scheme = scheme
        self.kind = kind
        self.payload = payload
        self._tune = tune
        self.tls = tls
        self.pumps = secure.Pumps()
        self.pool = ConnectionPool()
        self.unreachable: dict[str, tuple[float, str]] = {}  # endpoint -> (until, why)

    async def close(self) -> None:
        self.payload.close()
        self.pool.close()
        await self.pumps.close()

    async def _dial(self, loop: asyncio.AbstractEventLoop, endpoint: str, host: str,
                    port: int) -> socket.socket:
        """A new connection, bounded by CONNECT_TIMEOUT_S; a receiver whose last connection
        failed is not dialled again for UNREACHABLE_COOLDOWN_S (ConnectionError at once)."""
        down = self.unreachable.get(endpoint)
        if down is not None and time.monotonic() < down[0]:
            raise ConnectionError(f"KV receiver {endpoint} unreachable ({down[1]}); next "
                                  f"attempt in {down[0] - time.monotonic():.1f}s")
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                sock = await self._connect(loop, host, port)
        except TimeoutError:
            why = f"no connection within {CONNECT_TIMEOUT_S:g}s"
            self._down(endpoint, why)
            raise ConnectionError(f"KV receiver {endpoint}: {why}") from None
        except OSError as e:  # refused, no route, a handshake or certificate refused
            self._down(endpoint, f"{type(e).__name__}: {e}"[:200])
            raise
        self.unreachable.pop(endpoint, None)
        return sock

    def _down(self, endpoint: str, why: str) -> None:
        if endpoint not in self.unreachable:
            logger.warning("KV receiver %s unreachable (%s): transfers to it fail at once "
                           "for %gs", endpoint, why, UNREACHABLE_COOLDOWN_S)
        self.unreachable[endpoint] = (time.monotonic() + UNREACHABLE_COOLDOWN_S, why)

    async def _connect(self, loop: asyncio.AbstractEventLoop, host: str,
                       port: int) -> socket.socket:
        if self.tls is not None:
            return await secure.connect(self.tls, self.pumps, host, port, self._tune)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            self._tune(sock)
            await loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def send(self, sm: TransferStateMachine, endpoint: str, blocks: BlockStream) -> int:
        loop = asyncio.get_running_loop()
        host, port = parse_host_port(endpoint, self.scheme)
        sock = self.pool.take(endpoint)
        reused = sock is not None
        if reused:
            sm.mark("reused")
        else:
            sock = await self._dial(loop, endpoint, host, port)
            sm.mark("connected")
        done = False
        try:
            await loop.sock_sendall(sock, wire.encode_hello(
                self.kind, self.layout, sm.transfer_id, blocks.total, checksums=sm.checksums))
            if not (self.payload.eager and blocks.ready()):
                await _accepted(loop, sock, sm)
            # else the blocks are all readable already (a retry, a fully cached prompt): the
            # payload follows HELLO at once and await_ack reads the HELLO's answer first,
            # saving a round trip; a receiver that rejects the transfer drains what we sent
            await self.payload.send(loop, sock, endpoint, sm, blocks)
            sm.mark("acked")
            sm.num_bytes = blocks.total * self.layout.block_bytes
            done = True
            return sm.num_bytes
        finally:
            if done:  # acked: the connection is clean, the next transfer may use it
                self.pool.give(endpoint, sock)
            else:
                sock.close()


async def _accepted(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    sm: TransferStateMachine) -> None:
    """Read the receiver's answer to HELLO: OK moves the transfer to TRANSFERRING."""
    await wire.expect_ok(loop, sock, "rejected the transfer")
    sm.mark("hello_ok")
    sm.advance(TransferState.TRANSFERRING)


async def await_ack(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    sm: TransferStateMachine) -> str:
    """The receiver's final OK: the blocks are in place on its side (returns its message).
    After an eager payload the answer to HELLO comes first and is read here."""
    if sm.state is TransferState.PENDING:
        await _accepted(loop, sock, sm)
    return await wire.expect_ok(loop, sock, "failed the transfer")


async def hold_lease(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     sm: TransferStateMachine, exc: BaseException) -> None:
    """A one-sided send failed with ``exc`` after the receiver may have started reading:
    :func:`until_receiver_stopped`, bounded as this transfer's state allows."""
    await until_receiver_stopped(loop, sock, f"sender gave up: {exc!r}"[:200],
                                 accepted=sm.state is not TransferState.PENDING)


async def until_receiver_stopped(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                                 reason: str, *, accepted: bool = True) -> None:
    """For backends where the RECEIVER reads the sender's blocks (cuda_ipc, nixl): a send
    that fails after the receiver may have started reading (timeout, cancel, error) tells
    the receiver (ERROR, then end of stream) and returns only once the receiver closed the
    connection or answered, i.e. stopped reading; the caller frees the source blocks when
    ``send()`` returns. This is what makes a receiver's completed read valid without a
    confirmation round trip: while the receiver reads, the sender is still inside
    ``send()``. Bounded by LEASE_DRAIN_TIMEOUT_S (a receiver that neither answers nor hangs
    up for that long is stuck; the blocks are then released anyway, with an error logged),
    or by UNANSWERED_DRAIN_TIMEOUT_S when the receiver had not ``accepted`` (answered HELLO).
    A repeated cancellation does not cut the wait short: it is the lease."""
    wire.try_send_error(sock, reason)
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass

    async def drain() -> None:
        while True:
            try:
                if not await loop.sock_recv(sock, 65536):
                    return
            except OSError:
                return

    task = loop.create_task(drain())
    bound = LEASE_DRAIN_TIMEOUT_S if accepted else UNANSWERED_DRAIN_TIMEOUT_S
    deadline = loop.time() + bound
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            task.cancel()
            if accepted:
                logger.error("receiver still reading %.0fs after the send failed; releasing "
                             "the source blocks anyway", bound)
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), left)
        except (asyncio.CancelledError, TimeoutError):
            pass  # the lease outlives a cancellation; the deadline bounds it
