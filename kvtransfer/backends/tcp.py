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
from dataclasses import dataclass

import torch

from kvtransfer import checksum, wire
from kvtransfer.api import (
    BackendSpec,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferOptions,
    ListenAddress,
    TransferError,
    check_options,
    option,
)
from kvtransfer.blocks import block_runs, byte_view
from kvtransfer.control import await_ack, control_receiver, control_sender, tune_socket
from kvtransfer.lifecycle import ExpectedTransfer, TransferStateMachine
from kvtransfer.stream import BlockStream

SCHEME = "tcp"


@dataclass(frozen=True)
class TcpOptions:
    socket_buffer_bytes: int = option(8 << 20, "send and receive buffer of each connection "
                                               "(SO_SNDBUF / SO_RCVBUF)", minimum=4096)

    def __post_init__(self) -> None:
        check_options(self)


def _tuner(options: TcpOptions):
    def tune(sock: socket.socket) -> None:
        tune_socket(sock)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, options.socket_buffer_bytes)
            except OSError:
                pass
    return tune


class TcpPayloadSender:
    """Writes each ready part's block runs straight from the cache onto the connection."""

    eager = False

    def __init__(self, cache: torch.Tensor, layout: KVLayout) -> None:
        self._cache = cache
        self._view = byte_view(cache)
        self._layout = layout

    async def send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, endpoint: str,
                   sm: TransferStateMachine, blocks: BlockStream) -> None:
        bb = self._layout.block_bytes
        sums = checksum.SourceSums(self._cache)
        try:
            async for ids in blocks.ready_parts(watch=sock):  # the receiver reads in order
                if sm.checksums:
                    sums.add(ids)  # in a helper thread while the data goes out
                for run in block_runs(ids):
                    data = self._view[run.start * bb:(run.start + run.count) * bb]
                    if sm.corrupt and sm.num_bytes == 0:
                        data = _flipped(data, sm.transfer_id)
                    await loop.sock_sendall(sock, data)
                    sm.num_bytes += run.count * bb
            if sm.checksums:
                await checksum.send_checksums(loop, sock, await sums.collect(watch=sock))
        except OSError as exc:  # the receiver hung up; it may have said why
            raise TransferError(await _peer_reason(loop, sock, exc)) from exc
        await await_ack(loop, sock, sm)

    def close(self) -> None:
        pass


class TcpPayloadReceiver:
    """Receives the payload straight into the destination blocks, run by run."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout) -> None:
        self._cache = cache
        self._view = byte_view(cache)
        self._layout = layout

    async def start(self) -> None:
        pass

    async def receive(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      entry: ExpectedTransfer) -> None:
        bb = self._layout.block_bytes
        landing = checksum.LandingSums(self._cache, entry.dst_block_ids) \
            if entry.checksums else None
        for run in block_runs(entry.dst_block_ids):
            region = self._view[run.start * bb:(run.start + run.count) * bb]
            got = 0
            while got < len(region):
                n = await loop.sock_recv_into(conn, region[got:])
                if n == 0:
                    raise wire.PeerClosed(
                        f"sender closed the connection after "
                        f"{entry.num_bytes + got} of {len(entry.dst_block_ids) * bb} bytes")
                got += n
                entry.add_bytes(n)
                if landing is not None:
                    landing.landed(run.pos + got // bb)
        if landing is not None:
            await checksum.check_arrived(loop, conn, self._cache, entry.dst_block_ids,
                                         landing=landing)

    def close(self) -> None:
        pass


def _flipped(data: memoryview, transfer_id: str) -> bytes:
    """Fault injection: a copy of ``data`` with its first byte flipped."""
    out = bytearray(data)
    out[0] ^= 0xFF
    checksum.note_fault(transfer_id, "the first block sent")
    return bytes(out)


async def _peer_reason(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       exc: OSError) -> str:
    try:
        async with asyncio.timeout(0.2):
            status, _, message = await wire.read_reply(loop, sock)
        if status == wire.ERROR:
            return f"receiver aborted the transfer: {message}"
    except (OSError, EOFError, TransferError):
        pass
    return f"connection lost while sending: {type(exc).__name__}: {exc}"


def make_sender(cache: torch.Tensor, layout: KVLayout, options: TcpOptions,
                shared: KVTransferOptions) -> KVSender:
    layout.validate(cache, need_contiguous_cpu=True)
    return control_sender(cache, layout, SCHEME, wire.KIND_TCP,
                          TcpPayloadSender(cache, layout), shared, _tuner(options))


def make_receiver(cache: torch.Tensor, layout: KVLayout, options: TcpOptions,
                  shared: KVTransferOptions, listen: ListenAddress | None) -> KVReceiver:
    layout.validate(cache, need_contiguous_cpu=True)
    return control_receiver(cache, layout, SCHEME, wire.KIND_TCP,
                            TcpPayloadReceiver(cache, layout), shared, listen,
                            _tuner(options))


BACKEND = BackendSpec(name=SCHEME, devices=("cpu",), listener=True, options=TcpOptions,
                      sender=make_sender, receiver=make_receiver)
