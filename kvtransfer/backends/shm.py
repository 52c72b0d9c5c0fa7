"""Shared-memory backend: two processes on one host.

The payload goes through an anonymous ``memfd`` ring, not the socket: the sender creates
the memfd, passes its file descriptor to the receiver over a unix socket (SCM_RIGHTS) with
the HELLO, and both map it. The ring holds ``num_slots`` chunks of ``chunk_blocks`` blocks:

    sender:   gather chunk c into slot c % S  ->  "READY c" (4 bytes on the socket)
    receiver: copy slot c % S into the dst blocks  ->  FREED c  (so the slot can be reused)
    receiver: after the last chunk: OK (ack; the data is in place)

so the sender's gather of chunk c+1 overlaps the receiver's scatter of chunk c, and the
shared memory stays bounded by the ring, whatever the transfer size; the blocks' checksums
follow the last chunk. After a DONE transfer the sender keeps the ring (up to
MAX_IDLE_RINGS) for the next one: a fresh memfd costs a page fault and zeroing per page. The
memfd has no name in /dev/shm: nothing can leak there, and the kernel frees it as soon as
both sides closed or died. A GPU cache's chunks are copied between the device and the ring
on a stream (both sides page-lock their mapping of the ring, so the copies are asynchronous
and awaited without blocking the event loop): GPUs of one host without NVLink between them
still disaggregate. The control socket is an abstract unix socket (``shm://<name>``) or,
when the name starts with '/', a socket file that the receiver removes on close.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import struct
import uuid
from dataclasses import dataclass

import torch

from kvtransfer import checksum, wire
from kvtransfer.api import (
    BackendSpec,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferOptions,
    TransferError,
    TransferState,
    check_options,
    option,
)
from kvtransfer.blocks import gather, scatter
from kvtransfer.control import Listener
from kvtransfer.lifecycle import (
    ExpectedTransfer,
    Receiver,
    ReceiverTracker,
    Sender,
    TransferStateMachine,
)
from kvtransfer.staging import queue_copy, register_host, unregister_host
from kvtransfer.stream import BlockStream
from kvtransfer.waits import wait_event

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 30.0
_READY = struct.Struct("!I")
MAX_RING_BYTES = 1 << 30
MAX_IDLE_RINGS = 2  # per sender; an idle ring is mapped memory, so keep few


@dataclass(frozen=True)
class ShmOptions:
    chunk_bytes: int = option(8 << 20, "sender: bytes per ring slot (whole blocks, at least "
                                       "one)", minimum=1)
    num_slots: int = option(4, "sender: ring slots, so gathering a chunk overlaps the "
                               "receiver's scatter of the last", minimum=1)
    socket_name: str = option("", "receiver: its unix socket (abstract, or a file when it "
                                  "starts with '/'); empty: a unique abstract name")

    def __post_init__(self) -> None:
        check_options(self)


def _address(name: str) -> str:
    return name if name.startswith("/") else "\0" + name


class _Ring:
    """A mapped memfd seen as ``[num_slots, chunk_blocks, *block_shape]`` blocks; ``pin``
    page-locks it (a GPU cache's copies to and from it are then asynchronous)."""

    def __init__(self, fd: int, layout: KVLayout, chunk_blocks: int, num_slots: int,
                 pin: bool = False) -> None:
        size = num_slots * chunk_blocks * layout.block_bytes
        if os.fstat(fd).st_size < size:
            raise TransferError(f"shared memory segment smaller than the ring ({size} bytes)")
        # MAP_POPULATE: fault the whole ring in one go instead of page by page
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.geometry = (chunk_blocks, num_slots)
        self._flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._pinned = pin and register_host(self._flat)
        self.slots = self._flat.view(layout.torch_dtype).view(
            num_slots, chunk_blocks, *layout.block_shape)

    def rows(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as ``[chunk_blocks, block_bytes]`` bytes."""
        return self._flat.view(self.geometry[1], self.geometry[0], -1)[slot]

    def close(self) -> None:
        if self._pinned:
            unregister_host(self._flat)
            self._pinned = False
        del self.slots
        del self._flat
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            logger.warning("shm ring still referenced; unmapped later")


class ShmServer:
    """A receiver's channel: a unix socket listener; one transfer per connection, its
    payload read out of the sender's ring."""

    def __init__(self, tracker: ReceiverTracker, cache: torch.Tensor, layout: KVLayout,
                 name: str | None = None, staged: bool = False) -> None:
        self._tracker = tracker
        self._cache = cache
        self._layout = layout
        # a GPU cache's chunks are copied out of the (page-locked) ring on a stream
        self._staged = staged or cache.is_cuda
        self._stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._name = name or f"pdkv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.listener: Listener | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(_address(self._name))
        sock.listen(128)
        self.listener = Listener(sock, self._serve, "shm", lambda c: c.setblocking(False))
        self.listener.start()
        logger.debug("shm receiver listening on %s", self.endpoint)

    @property
    def endpoint(self) -> str:
        if self.listener is None:
            raise RuntimeError("receiver not started")
        return f"shm://{self._name}"

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()
            self.listener = None
            if self._name.startswith("/"):
                try:
                    os.unlink(self._name)
                except FileNotFoundError:
                    pass

    async def _read_hello(self, conn: socket.socket) -> tuple[wire.Hello, int | None]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                head, fds, _, _ = socket.recv_fds(conn, wire.HELLO_SIZE, 1)
                break
            except BlockingIOError:
                await wire.wait_readable(loop, conn)
        fd = fds[0] if fds else None
        try:
            if not head:
                raise wire.PeerClosed("peer closed the connection before HELLO")
            head += await wire.recv_exact(loop, conn, wire.HELLO_SIZE - len(head))
            return await wire.read_hello(loop, conn, head), fd
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        entry: ExpectedTransfer | None = None
        ring: _Ring | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello, fd = await self._read_hello(conn)
            entry, ring = await self._accept(loop, conn, hello, fd)
            if entry is None:
                return
            landing = await self._receive_chunks(loop, conn, entry, ring, hello)
            if entry.checksums:
                await checksum.check_arrived(loop, conn, self._cache, entry.dst_block_ids,
                                             self._stream, landing)
            entry.finish(TransferState.DONE)
            await loop.sock_sendall(conn, wire.encode_reply(wire.OK))
        except asyncio.CancelledError:
            if entry is not None:
                wire.try_send_error(conn, f"transfer {entry.transfer_id} {entry.state.value} "
                                          "on receiver")
        except (OSError, EOFError, TransferError) as exc:
            if entry is not None:
                if entry.finish(TransferState.FAILED, f"{type(exc).__name__}: {exc}"):
                    wire.try_send_error(conn, str(exc))
            else:
                logger.debug("shm receiver dropped a connection: %s", exc)
        except Exception as exc:  # noqa: BLE001 - never leave a transfer hanging on a bug
            logger.exception("shm receiver: unexpected error")
            if entry is not None:
                entry.finish(TransferState.FAILED, f"receiver error: {exc!r}")
        finally:
            if ring is not None:
                if self._stream is not None:
                    self._stream.synchronize()  # no copy still reads the ring
                ring.close()
            conn.close()

    async def _accept(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      hello: wire.Hello, fd: int | None
                      ) -> tuple[ExpectedTransfer | None, _Ring | None]:
        """Claim the transfer and map the sender's ring, then answer OK; (None, None) after
        rejecting it with an ERROR. Closes ``fd`` either way (a mapping keeps the memory)."""
        entry = None
        try:
            error = wire.layout_error(hello, self._layout, self._tracker.options.checksums)
            if error is None and (fd is None or hello.kind != wire.KIND_SHM):
                error = "shm HELLO without a shared memory descriptor"
            if error is None and not (0 < hello.chunk_blocks and 0 < hello.num_slots):
                error = f"bad ring geometry {hello.chunk_blocks}x{hello.num_slots}"
            entry = self._tracker.claim(hello.transfer_id, hello.num_blocks, error,
                                        owner=asyncio.current_task())
            ring = _Ring(fd, self._layout, hello.chunk_blocks, hello.num_slots,
                         pin=self._cache.is_cuda)
        except (TransferError, OSError, ValueError) as exc:
            if entry is not None:
                entry.finish(TransferState.FAILED, str(exc))
            await loop.sock_sendall(conn, wire.encode_reply(wire.ERROR, 0, str(exc)))
            return None, None
        finally:
            if fd is not None:
                os.close(fd)
        await loop.sock_sendall(conn, wire.encode_reply(wire.OK))
        return entry, ring

    async def _receive_chunks(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                              entry: ExpectedTransfer, ring: _Ring, hello: wire.Hello
                              ) -> checksum.LandingSums | None:
        """Scatter each chunk the sender says is READY out of its slot; FREED the slot.
        Returns the landed blocks' checksums (being computed), with ``entry.checksums``."""
        ids = await entry.destination()
        landing = checksum.LandingSums(self._cache, ids) \
            if entry.checksums and not self._cache.is_cuda else None
        if self._stream is not None:  # copies into the blocks end before the waiter wakes
            entry.on_end(self._stream.synchronize)
        cb, slots = hello.chunk_blocks, hello.num_slots
        num_chunks = -(-len(ids) // cb)
        for c in range(num_chunks):
            try:
                (index,) = _READY.unpack(await wire.recv_exact(loop, conn, _READY.size))
            except wire.PeerClosed:
                raise wire.PeerClosed(
                    f"sender closed the connection after {c} of {num_chunks} chunks") from None
            if index != c:
                raise TransferError(f"protocol error: chunk {index} arrived, expected {c}")
            chunk_ids = ids[c * cb:(c + 1) * cb]
            if self._staged:  # the slot is FREED only once emptied
                copied = queue_copy(self._cache, chunk_ids, ring.rows(c % slots), True,
                                    self._stream)
                await wait_event(copied, watch=conn, what="the copy out of shared memory")
            else:
                scatter(self._cache, chunk_ids, ring.slots[c % slots, :len(chunk_ids)])
            entry.add_bytes(len(chunk_ids) * self._layout.block_bytes)
            if landing is not None:
                landing.landed(c * cb + len(chunk_ids))
            if c + slots < num_chunks:
                await loop.sock_sendall(conn, wire.encode_reply(wire.FREED, c))
        return landing


class ShmClient:
    """A sender's channel: gathers each chunk into a slot of a memfd ring it shares with
    the receiver (rings of DONE transfers are kept for the next one)."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout, options: ShmOptions,
                 staged: bool = False) -> None:
        self._cache = cache
        self._layout = layout
        # a GPU cache's chunks are copied into the (page-locked) ring on a stream
        self._staged = staged or cache.is_cuda
        self._stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._chunk_blocks = max(1, options.chunk_bytes // layout.block_bytes)
        self._num_slots = options.num_slots
        self._idle: list[tuple[int, _Ring]] = []  # (memfd, mapping) kept for reuse

    async def close(self) -> None:
        for fd, ring in self._idle:
            ring.close()
            os.close(fd)
        self._idle.clear()

    def _take_ring(self, cb: int, slots: int) -> tuple[int, _Ring]:
        """An idle ring of this geometry (already faulted in: no page zeroing), or a new one."""
        for i, (fd, ring) in enumerate(self._idle):
            if ring.geometry == (cb, slots):
                return self._idle.pop(i)
        fd = os.memfd_create("pdkv-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, slots * cb * self._layout.block_bytes)
            return fd, _Ring(fd, self._layout, cb, slots, pin=self._cache.is_cuda)
        except BaseException:
            os.close(fd)
            raise

    async def send(self, sm: TransferStateMachine, endpoint: str, blocks: BlockStream) -> int:
        loop = asyncio.get_running_loop()
        name = wire.parse_endpoint(endpoint, "shm")
        bb = self._layout.block_bytes
        total = blocks.total
        cb = min(self._chunk_blocks, total)
        num_chunks = -(-total // cb)
        slots = max(1, min(self._num_slots, num_chunks, MAX_RING_BYTES // (cb * bb)))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ring: tuple[int, _Ring] | None = None
        done = False
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, _address(name))
            ring = self._take_ring(cb, slots)
            hello = wire.encode_hello(wire.KIND_SHM, self._layout, sm.transfer_id, total,
                                      cb, slots, sm.checksums)
            await _send_with_fd(loop, sock, hello, ring[0])
            await wire.expect_ok(loop, sock, "rejected the transfer")
            sm.advance(TransferState.TRANSFERRING)
            sums = await self._send_chunks(loop, sock, sm, blocks, ring[1], cb, slots)
            if sm.checksums:
                await checksum.send_checksums(loop, sock, await sums.collect(watch=sock))
            await wire.expect_ok(loop, sock, "failed the transfer")
            done = True
            return total * bb
        finally:
            sock.close()
            if self._stream is not None:
                self._stream.synchronize()  # no copy reads our blocks once send() returns
            if ring is not None:
                # reuse only after DONE: then the receiver has finished reading every slot
                if done and len(self._idle) < MAX_IDLE_RINGS:
                    self._idle.append(ring)
                else:
                    ring[1].close()
                    os.close(ring[0])

    async def _send_chunks(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                           sm: TransferStateMachine, blocks: BlockStream, ring: _Ring,
                           cb: int, slots: int) -> checksum.SourceSums:
        """Gather chunk ``c`` into slot ``c % slots`` once its blocks are ready and the slot
        was FREED, then say READY ``c``; returns the blocks' checksums, to collect."""
        total = blocks.total
        sums = checksum.SourceSums(self._cache, self._stream)
        ids: list[int] = []  # handed over so far (the stream may still be computing)
        parts = blocks.ready_parts(watch=sock)
        for c in range(-(-total // cb)):
            while len(ids) < min((c + 1) * cb, total):
                ids.extend(await anext(parts))
            if c >= slots:  # wait until the receiver has emptied this slot
                status, value, message = await wire.read_reply(loop, sock)
                if status == wire.ERROR:
                    raise TransferError(f"receiver aborted the transfer: {message}")
                if status != wire.FREED or value != c - slots:
                    raise TransferError(f"protocol error: reply {status}/{value}")
            chunk_ids = ids[c * cb:(c + 1) * cb]
            if self._staged:
                copied = queue_copy(self._cache, chunk_ids, ring.rows(c % slots), False,
                                    self._stream)
                await wait_event(copied, watch=sock, what="the copy into shared memory")
            else:
                gather(self._cache, chunk_ids, ring.slots[c % slots, :len(chunk_ids)])
            if sm.corrupt and c == 0:
                checksum.corrupt_first_byte(ring.slots[0], 0, sm.transfer_id)
            if sm.checksums:
                sums.add(chunk_ids)
            await loop.sock_sendall(sock, _READY.pack(c))
            sm.num_bytes += len(chunk_ids) * self._layout.block_bytes
        return sums


async def _send_with_fd(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes,
                        fd: int) -> None:
    """Send ``data`` with ``fd`` attached (SCM_RIGHTS) on a non-blocking unix socket."""
    while True:
        try:
            sent = socket.send_fds(sock, [data], [fd])
            break
        except BlockingIOError:
            await asyncio.sleep(0.001)
    if sent < len(data):
        await loop.sock_sendall(sock, data[sent:])


def make_sender(cache: torch.Tensor, layout: KVLayout, options: ShmOptions,
                shared: KVTransferOptions, staged: bool = False) -> KVSender:
    """``staged``: copy through the ring as a GPU cache's blocks are, even for a CPU cache
    (tests of the GPU path)."""
    _check(cache, layout)
    return Sender(cache, layout, ShmClient(cache, layout, options, staged), shared)


def make_receiver(cache: torch.Tensor, layout: KVLayout, options: ShmOptions,
                  shared: KVTransferOptions, listen: None, staged: bool = False) -> KVReceiver:
    _check(cache, layout)
    tracker = ReceiverTracker(cache.shape[0], layout.block_bytes, shared)
    return Receiver(tracker, ShmServer(tracker, cache, layout, options.socket_name or None,
                                       staged))


def _check(cache: torch.Tensor, layout: KVLayout) -> None:
    layout.validate(cache)
    if not cache.is_contiguous():
        raise ValueError("the shm backend needs a contiguous cache tensor")


BACKEND = BackendSpec(name="shm", devices=("cpu", "cuda"), listener=False, options=ShmOptions,
                      sender=make_sender, receiver=make_receiver)
