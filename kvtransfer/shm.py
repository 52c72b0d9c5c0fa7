"""Shared-memory backend: two processes on one host, CPU caches.

The payload goes through an anonymous ``memfd`` ring, not the socket: the sender creates
the memfd, passes its file descriptor to the receiver over a unix socket (SCM_RIGHTS) with
the HELLO, and both map it. The ring holds ``num_slots`` chunks of ``chunk_blocks`` blocks:

    sender:   gather chunk c into slot c % S  ->  "READY c" (4 bytes on the socket)
    receiver: copy slot c % S into the dst blocks  ->  FREED c  (so the slot can be reused)
    receiver: after the last chunk: OK (ack; the data is in place)

so the sender's gather of chunk c+1 overlaps the receiver's scatter of chunk c, and the
shared memory stays bounded by the ring, whatever the transfer size. After a DONE transfer the
sender keeps the ring (up to MAX_IDLE_RINGS) for the next one: a fresh memfd costs a page
fault and zeroing per page, which was most of the time of a 180 MiB transfer. The memfd has no name
in /dev/shm: nothing can leak there, and the kernel frees it as soon as both sides closed
or died. The control socket is an abstract unix socket (``shm://<name>``) or, when the name
starts with '/', a socket file that the receiver removes on close.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import struct
import uuid

import torch

from kvtransfer import protocol as proto
from kvtransfer.base import (
    KVLayout,
    TransferState,
    TransferStateMachine,
)
from kvtransfer.blocks import gather, scatter
from kvtransfer.stream import BlockStream
from kvtransfer.tracking import (
    TrackedReceiver,
    ExpectedTransfer,
    ReceiverTracker,
    RunnerSender,
    TransferError,
)
from services.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 30.0
_READY = struct.Struct("!I")
MAX_RING_BYTES = 1 << 30
MAX_IDLE_RINGS = 2  # per sender; an idle ring is mapped memory, so keep few


def _address(name: str) -> str:
    return name if name.startswith("/") else "\0" + name


class _Ring:
    """A mapped memfd seen as ``[num_slots, chunk_blocks, *block_shape]`` blocks."""

    def __init__(self, fd: int, layout: KVLayout, chunk_blocks: int, num_slots: int) -> None:
        size = num_slots * chunk_blocks * layout.block_bytes
        if os.fstat(fd).st_size < size:
            raise TransferError(f"shared memory segment smaller than the ring ({size} bytes)")
        # MAP_POPULATE: fault the whole ring in one go instead of page by page
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.geometry = (chunk_blocks, num_slots)
        self.slots = torch.frombuffer(self._mm, dtype=torch.uint8).view(layout.torch_dtype).view(
            num_slots, chunk_blocks, *layout.block_shape)

    def close(self) -> None:
        del self.slots
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            logger.warning("shm ring still referenced; unmapped later")


class ShmReceiver(TrackedReceiver):
    def __init__(self, cache: torch.Tensor, layout: KVLayout, name: str | None = None) -> None:
        layout.validate(cache)
        self._cache = cache
        self._layout = layout
        self._name = name or f"pdkv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._tracker = ReceiverTracker(cache.shape[0], layout.block_bytes)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(_address(self._name))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())
        logger.debug("shm receiver listening on %s", self.endpoint)

    @property
    def endpoint(self) -> str:
        if self._listener is None:
            raise RuntimeError("receiver not started")
        return f"shm://{self._name}"

    async def close(self) -> None:
        self._tracker.close()
        tasks = [t for t in (self._accept_task, *self._conns) if t is not None]
        await cancel_and_wait(tasks)
        if self._listener is not None:
            self._listener.close()
            if self._name.startswith("/"):
                try:
                    os.unlink(self._name)
                except FileNotFoundError:
                    pass
        self._accept_task = None

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                logger.warning("shm receiver accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _read_hello(self, conn: socket.socket) -> tuple[proto.Hello, int | None]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                head, fds, _, _ = socket.recv_fds(conn, proto.HELLO_SIZE, 1)
                break
            except BlockingIOError:
                await proto.wait_readable(loop, conn)
        fd = fds[0] if fds else None
        try:
            if not head:
                raise proto.PeerClosed("peer closed the connection before HELLO")
            head += await proto.recv_exact(loop, conn, proto.HELLO_SIZE - len(head))
            return await proto.read_hello(loop, conn, head), fd
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        entry: ExpectedTransfer | None = None
        ring: _Ring | None = None
        fd: int | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello, fd = await self._read_hello(conn)
            try:
                error = proto.layout_error(hello, self._layout)
                if error is None and (fd is None or hello.kind != proto.KIND_SHM):
                    error = "shm HELLO without a shared memory descriptor"
                if error is None and not (0 < hello.chunk_blocks and 0 < hello.num_slots):
                    error = f"bad ring geometry {hello.chunk_blocks}x{hello.num_slots}"
                entry = self._tracker.claim(hello.transfer_id, hello.num_blocks, error,
                                            owner=asyncio.current_task())
                ring = _Ring(fd, self._layout, hello.chunk_blocks, hello.num_slots)
            except (TransferError, OSError, ValueError) as exc:
                if entry is not None:
                    entry.finish(TransferState.FAILED, str(exc))
                await loop.sock_sendall(conn, proto.encode_reply(proto.ERROR, 0, str(exc)))
                return
            finally:
                if fd is not None:
                    os.close(fd)  # the mapping (if any) keeps the memory alive
            await loop.sock_sendall(conn, proto.encode_reply(proto.OK))
            ids = await entry.destination()
            cb, slots = hello.chunk_blocks, hello.num_slots
            num_chunks = -(-len(ids) // cb)
            for c in range(num_chunks):
                try:
                    (index,) = _READY.unpack(await proto.recv_exact(loop, conn, _READY.size))
                except proto.PeerClosed:
                    raise proto.PeerClosed(
                        f"sender closed the connection after {c} of {num_chunks} chunks") from None
                if index != c:
                    raise TransferError(f"protocol error: chunk {index} arrived, expected {c}")
                chunk_ids = ids[c * cb:(c + 1) * cb]
                scatter(self._cache, chunk_ids, ring.slots[c % slots, :len(chunk_ids)])
                entry.add_bytes(len(chunk_ids) * self._layout.block_bytes)
                if c + slots < num_chunks:
                    await loop.sock_sendall(conn, proto.encode_reply(proto.FREED, c))
            entry.finish(TransferState.DONE)
            await loop.sock_sendall(conn, proto.encode_reply(proto.OK))
        except asyncio.CancelledError:
            if entry is not None:
                proto.try_send_error(conn, f"transfer {entry.transfer_id} {entry.state.value} "
                                           "on receiver")
        except (OSError, EOFError, TransferError) as exc:
            if entry is not None:
                entry.finish(TransferState.FAILED, f"{type(exc).__name__}: {exc}")
            else:
                logger.debug("shm receiver dropped a connection: %s", exc)
        except Exception as exc:  # noqa: BLE001 - never leave a transfer hanging on a bug
            logger.exception("shm receiver: unexpected error")
            if entry is not None:
                entry.finish(TransferState.FAILED, f"receiver error: {exc!r}")
        finally:
            if ring is not None:
                ring.close()
            conn.close()


class ShmSender(RunnerSender):
    def __init__(self, cache: torch.Tensor, layout: KVLayout, chunk_bytes: int = 8 << 20,
                 num_slots: int = 4) -> None:
        super().__init__(cache, layout)
        if chunk_bytes <= 0 or num_slots <= 0:
            raise ValueError("chunk_bytes and num_slots must be positive")
        self._chunk_blocks = max(1, chunk_bytes // layout.block_bytes)
        self._num_slots = num_slots
        self._idle: list[tuple[int, _Ring]] = []  # (memfd, mapping) kept for reuse

    def _close_backend(self) -> None:
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
            return fd, _Ring(fd, self._layout, cb, slots)
        except BaseException:
            os.close(fd)
            raise

    async def _send(self, sm: TransferStateMachine, endpoint: str, blocks: BlockStream) -> int:
        loop = asyncio.get_running_loop()
        name = proto.parse_endpoint(endpoint, "shm")
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
            fd, slot_tensor = ring[0], ring[1].slots
            hello = proto.encode_hello(proto.KIND_SHM, self._layout, sm.transfer_id, total,
                                       cb, slots)
            await _send_with_fd(loop, sock, hello, fd)
            await proto.expect_ok(loop, sock, "rejected the transfer")
            sm.advance(TransferState.TRANSFERRING)
            ids: list[int] = []  # handed over so far (the stream may still be computing)
            parts = blocks.ready_parts(watch=sock)
            for c in range(num_chunks):
                while len(ids) < min((c + 1) * cb, total):
                    ids.extend(await anext(parts))
                if c >= slots:  # wait until the receiver has emptied this slot
                    status, value, message = await proto.read_reply(loop, sock)
                    if status == proto.ERROR:
                        raise TransferError(f"receiver aborted the transfer: {message}")
                    if status != proto.FREED or value != c - slots:
                        raise TransferError(f"protocol error: reply {status}/{value}")
                chunk_ids = ids[c * cb:(c + 1) * cb]
                gather(self._cache, chunk_ids, slot_tensor[c % slots, :len(chunk_ids)])
                await loop.sock_sendall(sock, _READY.pack(c))
                sm.num_bytes += len(chunk_ids) * bb
            await proto.expect_ok(loop, sock, "failed the transfer")
            done = True
            return total * bb
        finally:
            sock.close()
            slot_tensor = None
            if ring is not None:
                # reuse only after DONE: then the receiver has finished reading every slot
                if done and len(self._idle) < MAX_IDLE_RINGS:
                    self._idle.append(ring)
                else:
                    ring[1].close()
                    os.close(ring[0])


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
