"""TCP backend: any two hosts. One connection at a time per transfer, kept for the next
transfer to the same receiver when this one ends DONE (see :mod:`kvtransfer.control`).

After the handshake the sender writes the payload straight from the cache's memory: one
``sock_sendall`` per run of consecutive source block ids (no gather copy), then the blocks'
checksums, then waits for the final OK (the receiver has the data). The receiver
``sock_recv_into``s straight into the destination blocks, one run of consecutive destination
ids at a time (inside TLS the pump encrypts from / decrypts into that memory:
:func:`kvtransfer.secure.sendall`), checks the checksums, then acks. A GPU cache's blocks
travel through pinned host buffers instead (:mod:`kvtransfer.staging`), so GPU hosts
without NVLink or RDMA still disaggregate. A peer that dies mid-transfer shows up as
end-of-stream / reset on the other side at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import torch

from kvtransfer import checksum, secure, wire
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
from kvtransfer.control import await_ack, control_receiver, control_sender, tune_socket
from kvtransfer.lifecycle import ExpectedTransfer, TransferStateMachine
from kvtransfer.staging import DirectBlocks, StagedBlocks, block_io
from kvtransfer.stream import BlockStream

SCHEME = "tcp"


@dataclass(frozen=True)
class TcpOptions:
    socket_buffer_bytes: int = option(8 << 20, "send and receive buffer of each connection "
                                               "(SO_SNDBUF / SO_RCVBUF)", minimum=4096)
    staging_bytes: int = option(8 << 20, "GPU caches: each of the two pinned host buffers a "
                                         "transfer's blocks travel through (whole blocks, at "
                                         "least one)", minimum=1)

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
    """Writes each ready part's blocks onto the connection: straight from a CPU cache, one
    write per run of consecutive blocks; from a GPU cache through pinned host buffers."""

    eager = False

    def __init__(self, cache: torch.Tensor, io: DirectBlocks | StagedBlocks) -> None:
        self._cache = cache
        self._io = io

    async def send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, endpoint: str,
                   sm: TransferStateMachine, blocks: BlockStream) -> None:
        sums = checksum.SourceSums(self._cache, getattr(self._io, "stream", None))
        try:
            async for ids in blocks.ready_parts(watch=sock):  # the receiver reads in order
                if sm.checksums:
                    sums.add(ids)  # in a helper thread / on the GPU while the data goes out
                async with contextlib.aclosing(self._io.outgoing(ids)) as pieces:
                    async for data in pieces:
                        if sm.corrupt and sm.num_bytes == 0:
                            data = _flipped(data, sm.transfer_id)
                        await secure.sendall(loop, sock, data)  # TLS: no socketpair
                        sm.num_bytes += len(data)
            if sm.checksums:
                await checksum.send_checksums(loop, sock, await sums.collect(watch=sock))
        except OSError as exc:  # the receiver hung up; it may have said why
            raise TransferError(await _peer_reason(loop, sock, exc)) from exc
        await await_ack(loop, sock, sm)

    def close(self) -> None:
        pass


class TcpPayloadReceiver:
    """Receives the payload into the destination blocks in transfer order: straight into a
    CPU cache, run by run; into a GPU cache through pinned host buffers."""

    def __init__(self, cache: torch.Tensor, io: DirectBlocks | StagedBlocks) -> None:
        self._cache = cache
        self._io = io

    async def start(self) -> None:
        pass

    async def receive(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      entry: ExpectedTransfer) -> None:
        dst = entry.dst_block_ids
        bb = self._cache[0].numel() * self._cache.element_size()
        landing = checksum.LandingSums(self._cache, dst) \
            if entry.checksums and not self._io.staged else None
        if self._io.staged:  # copies into the blocks end before the transfer's waiter wakes
            entry.on_end(self._io.synchronize)

        def landed(n: int) -> None:
            entry.add_bytes(n)
            if landing is not None:
                landing.landed(entry.num_bytes // bb)
        async with secure.reading(conn), contextlib.aclosing(self._io.incoming(dst)) as regions:
            async for region in regions:
                # TLS: the pump decrypts straight into the region (no socketpair)
                if await secure.recv_exactly(loop, conn, region, landed,
                                             entry.on_end) < len(region):
                    raise wire.PeerClosed(f"sender closed the connection after "
                                          f"{entry.num_bytes} of {len(dst) * bb} bytes")
        if entry.checksums:
            await checksum.check_arrived(loop, conn, self._cache, dst,
                                         getattr(self._io, "stream", None), landing)

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
                shared: KVTransferOptions, staged: bool | None = None) -> KVSender:
    """``staged``: through host buffers even for a CPU cache (tests of the GPU path);
    default: a GPU cache's only."""
    layout.validate(cache)
    return control_sender(cache, layout, SCHEME, wire.KIND_TCP,
                          TcpPayloadSender(cache, _io(cache, options, staged)), shared,
                          _tuner(options))


def make_receiver(cache: torch.Tensor, layout: KVLayout, options: TcpOptions,
                  shared: KVTransferOptions, listen: ListenAddress | None,
                  staged: bool | None = None) -> KVReceiver:
    layout.validate(cache)
    return control_receiver(cache, layout, SCHEME, wire.KIND_TCP,
                            TcpPayloadReceiver(cache, _io(cache, options, staged)), shared,
                            listen, _tuner(options))


def _io(cache: torch.Tensor, options: TcpOptions, staged: bool | None):
    return block_io(cache, options.staging_bytes, staged)


BACKEND = BackendSpec(name=SCHEME, devices=("cpu", "cuda"), listener=True, options=TcpOptions,
                      sender=make_sender, receiver=make_receiver)
