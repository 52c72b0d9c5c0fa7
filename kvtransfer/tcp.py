"""TCP backend: any two hosts. One connection at a time per transfer, kept for the next
transfer to the same receiver when this one ends DONE (see :mod:`kvtransfer.control`).

After the handshake the sender writes the payload straight from the cache's memory: one
``sock_sendall`` per run of consecutive source block ids (no gather copy), then waits for the
final OK (the receiver has the data). The receiver ``sock_recv_into``s straight into the
destination blocks, one run of consecutive destination ids at a time, then acks. A peer that
dies mid-transfer shows up as end-of-stream / reset on the other side at once.
"""

from __future__ import annotations

import asyncio
import socket

import torch

from kvtransfer import protocol as proto
from kvtransfer.base import KVLayout, TransferStateMachine
from kvtransfer.blocks import block_runs, byte_view
from kvtransfer.control import ControlReceiver, ControlSender, await_ack, tune_socket
from kvtransfer.stream import BlockStream
from kvtransfer.tracking import ExpectedTransfer, TransferError

SOCK_BUF_BYTES = 8 << 20


def _tune(sock: socket.socket) -> None:
    tune_socket(sock)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF_BYTES)
        except OSError:
            pass


class TcpReceiver(ControlReceiver):
    scheme = "tcp"
    kind = proto.KIND_TCP
    _tune = staticmethod(_tune)

    def __init__(self, cache: torch.Tensor, layout: KVLayout, host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None) -> None:
        layout.validate(cache, need_contiguous_cpu=True)
        super().__init__(cache, layout, host, port, advertise_host)
        self._view = byte_view(cache)

    async def _receive_payload(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                               entry: ExpectedTransfer) -> None:
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


class TcpSender(ControlSender):
    scheme = "tcp"
    kind = proto.KIND_TCP
    _tune = staticmethod(_tune)

    def __init__(self, cache: torch.Tensor, layout: KVLayout) -> None:
        layout.validate(cache, need_contiguous_cpu=True)
        super().__init__(cache, layout)
        self._view = byte_view(cache)

    async def _send_payload(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                            endpoint: str, sm: TransferStateMachine,
                            blocks: BlockStream) -> None:
        bb = self._layout.block_bytes
        try:
            async for ids in blocks.ready_parts(watch=sock):  # the receiver reads in order
                for run in block_runs(ids):
                    await loop.sock_sendall(
                        sock, self._view[run.start * bb:(run.start + run.count) * bb])
                    sm.num_bytes += run.count * bb
        except OSError as exc:  # the receiver hung up; it may have said why
            raise TransferError(await _peer_reason(loop, sock, exc)) from exc
        await await_ack(loop, sock, sm)


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
