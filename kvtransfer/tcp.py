"""TCP backend: any two hosts. One connection per transfer.

Sender: connect, HELLO, wait for OK (accepted), then write the payload straight from the
cache's memory: one ``sock_sendall`` per run of consecutive source block ids (no gather copy),
then wait for the final OK (the receiver has the data). Receiver: ``sock_recv_into`` straight
into the destination blocks, one run of consecutive destination ids at a time, then ack.
A peer that dies mid-transfer shows up as end-of-stream / reset on the other side at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import torch

from kvtransfer import protocol as proto
from kvtransfer.base import (
    KVLayout,
    KVSender,
    TransferResult,
    TransferState,
    TransferStateMachine,
)
from kvtransfer.blocks import block_runs, byte_view
from kvtransfer.tracking import (
    TrackedReceiver,
    ExpectedTransfer,
    ReceiverTracker,
    SendRunner,
    TransferError,
    check_block_ids,
)

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 30.0  # a connection that never says HELLO is dropped after this
SOCK_BUF_BYTES = 8 << 20


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF_BYTES)
        except OSError:
            pass


class TcpReceiver(TrackedReceiver):
    def __init__(self, cache: torch.Tensor, layout: KVLayout, host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None) -> None:
        layout.validate(cache, need_contiguous_cpu=True)
        self._cache = cache
        self._layout = layout
        self._view = byte_view(cache)
        self._host, self._port = host, port
        self._advertise = advertise_host or host
        self._tracker = ReceiverTracker(cache.shape[0], layout.block_bytes)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._port = sock.getsockname()[1]
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())
        logger.debug("tcp receiver listening on %s", self.endpoint)

    @property
    def endpoint(self) -> str:
        if self._listener is None:
            raise RuntimeError("receiver not started")
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return f"tcp://{host}:{self._port}"

    async def close(self) -> None:
        self._tracker.close()
        tasks = [t for t in (self._accept_task, *self._conns) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        self._accept_task = None

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. EMFILE: back off instead of spinning
                logger.warning("tcp receiver accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            _tune(conn)
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        entry: ExpectedTransfer | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = await proto.read_hello(loop, conn)
            try:
                entry = self._tracker.claim(
                    hello.transfer_id, hello.num_blocks,
                    proto.layout_error(hello, self._layout), owner=asyncio.current_task())
            except TransferError as exc:
                logger.debug("tcp receiver rejects transfer %s: %s", hello.transfer_id, exc)
                await loop.sock_sendall(conn, proto.encode_reply(proto.ERROR, 0, str(exc)))
                return
            await loop.sock_sendall(conn, proto.encode_reply(proto.OK))
            bb = self._layout.block_bytes
            for run in block_runs(entry.dst_block_ids):
                region = self._view[run.start * bb:(run.start + run.count) * bb]
                got = 0
                while got < len(region):
                    n = await loop.sock_recv_into(conn, region[got:])
                    if n == 0:
                        raise proto.PeerClosed(
                            f"sender closed the connection after "
                            f"{entry.num_bytes + got} of {len(entry.dst_block_ids) * bb} bytes")
                    got += n
                    entry.add_bytes(n)
            entry.finish(TransferState.DONE)
            await loop.sock_sendall(conn, proto.encode_reply(proto.OK))
        except asyncio.CancelledError:
            if entry is not None:  # ended by cancel/timeout/close: say why, then hang up
                result = entry.state.value
                proto.try_send_error(conn, f"transfer {entry.transfer_id} {result} on receiver")
        except (OSError, EOFError, TransferError) as exc:
            if entry is not None:
                entry.finish(TransferState.FAILED, f"{type(exc).__name__}: {exc}")
            else:
                logger.debug("tcp receiver dropped a connection: %s", exc)
        except Exception as exc:  # noqa: BLE001 - never leave a transfer hanging on a bug
            logger.exception("tcp receiver: unexpected error")
            if entry is not None:
                entry.finish(TransferState.FAILED, f"receiver error: {exc!r}")
        finally:
            conn.close()


class TcpSender(KVSender):
    def __init__(self, cache: torch.Tensor, layout: KVLayout) -> None:
        layout.validate(cache, need_contiguous_cpu=True)
        self._cache = cache
        self._layout = layout
        self._view = byte_view(cache)
        self._runner = SendRunner()

    async def send(self, transfer_id: str, endpoint: str, src_block_ids: list[int],
                   timeout_s: float) -> TransferResult:
        ids = check_block_ids(src_block_ids, self._cache.shape[0], unique=False)

        async def body(sm: TransferStateMachine) -> int:
            return await self._send(sm, endpoint, ids)

        return await self._runner.run(transfer_id, timeout_s, body)

    def cancel(self, transfer_id: str) -> bool:
        return self._runner.cancel(transfer_id)

    async def close(self) -> None:
        await self._runner.close()

    async def _send(self, sm: TransferStateMachine, endpoint: str, ids: list[int]) -> int:
        loop = asyncio.get_running_loop()
        host, _, port = proto.parse_endpoint(endpoint, "tcp").rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise TransferError(f"bad tcp endpoint {endpoint!r}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _tune(sock)
            await loop.sock_connect(sock, (host, int(port)))
            hello = proto.encode_hello(proto.KIND_TCP, self._layout, sm.transfer_id, len(ids))
            await loop.sock_sendall(sock, hello)
            await proto.expect_ok(loop, sock, "rejected the transfer")
            sm.advance(TransferState.TRANSFERRING)
            bb = self._layout.block_bytes
            try:
                for run in block_runs(ids):
                    await loop.sock_sendall(
                        sock, self._view[run.start * bb:(run.start + run.count) * bb])
                    sm.num_bytes += run.count * bb
            except OSError as exc:  # the receiver hung up; it may have said why
                raise TransferError(await _peer_reason(loop, sock, exc)) from exc
            await proto.expect_ok(loop, sock, "failed the transfer")
            return len(ids) * bb
        finally:
            sock.close()


async def _peer_reason(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       exc: OSError) -> str:
    try:
        async with asyncio.timeout(0.2):
            status, _, message = await proto.read_reply(loop, sock)
        if status == proto.ERROR:
            return f"receiver aborted the transfer: {message}"
    except (OSError, EOFError, TransferError):
        pass
    return f"connection lost while sending: {type(exc).__name__}: {exc}"
