"""The control wire: messages every socket-connected backend exchanges, and socket helpers.

Sender -> receiver, once per transfer (a connection carries transfers one after another)::

    HELLO  !4sHH IIII 16s Q III H H  + transfer id (utf-8)
           magic b"PDKV", version, backend kind,
           num_layers, num_kv_heads, head_dim, block_size, dtype, block_bytes,
           num_blocks, chunk_blocks, num_slots (shm only; 0 for tcp), flags
           (FLAG_CHECKSUMS: block checksums follow the data), len(transfer id)

BLOB   !I + bytes                    backend metadata (nccl / nixl / cuda_ipc), either way;
                                     the block checksums (kvtransfer.checksum), sender to
                                     receiver, once the data is on its way

Receiver -> sender::

    REPLY  !BIH + message (utf-8)      status, value, len(message)
           OK after HELLO = accepted; OK after the payload = ack (the data is in place);
           ERROR = rejected / failed, the message says why; FREED (shm) = slot ``value`` free.

Everything is big-endian. All helpers use the loop's ``sock_*`` methods on non-blocking
sockets, so they run under asyncio and uvloop alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
from dataclasses import dataclass

from kvtransfer.api import KVLayout, TransferError

MAGIC = b"PDKV"
VERSION = 2  # 2: HELLO carries flags (block checksums)
KIND_TCP = 1
KIND_SHM = 2
KIND_NCCL = 3
KIND_NIXL = 4
KIND_CUDA_IPC = 5

FLAG_CHECKSUMS = 1

_HELLO = struct.Struct("!4sHHIIII16sQIIIHH")
_REPLY = struct.Struct("!BIH")
_BLOB = struct.Struct("!I")
MAX_BLOB_BYTES = 16 << 20
HELLO_SIZE = _HELLO.size

OK = 0
ERROR = 1
FREED = 2


class PeerClosed(ConnectionError):
    """The other side closed the connection before the message was complete."""


@dataclass(frozen=True)
class Hello:
    kind: int
    layout: KVLayout | None  # None when the fields do not even form a valid layout
    layout_text: str
    block_bytes: int
    num_blocks: int
    chunk_blocks: int
    num_slots: int
    transfer_id: str
    flags: int = 0

    @property
    def checksums(self) -> bool:
        return bool(self.flags & FLAG_CHECKSUMS)


def encode_hello(kind: int, layout: KVLayout, transfer_id: str, num_blocks: int,
                 chunk_blocks: int = 0, num_slots: int = 0, checksums: bool = True) -> bytes:
    tid = transfer_id.encode()
    flags = FLAG_CHECKSUMS if checksums else 0
    head = _HELLO.pack(MAGIC, VERSION, kind, layout.num_layers, layout.num_kv_heads,
                       layout.head_dim, layout.block_size, layout.dtype.encode(),
                       layout.block_bytes, num_blocks, chunk_blocks, num_slots, flags, len(tid))
    return head + tid


def decode_hello_head(head: bytes) -> tuple[Hello, int]:
    """Parse the fixed part; returns the Hello (transfer id still empty) and the id length."""
    (magic, version, kind, layers, heads, head_dim, block_size, dtype, block_bytes,
     num_blocks, chunk_blocks, num_slots, flags, tid_len) = _HELLO.unpack(head)
    if magic != MAGIC:
        raise TransferError(f"bad magic {magic!r}: not a kvtransfer peer")
    if version != VERSION:
        raise TransferError(f"protocol version {version} not supported (this side: {VERSION})")
    dtype_s = dtype.rstrip(b"\0").decode(errors="replace")
    text = (f"KVLayout(num_layers={layers}, num_kv_heads={heads}, head_dim={head_dim}, "
            f"block_size={block_size}, dtype='{dtype_s}')")
    try:
        layout = KVLayout(layers, heads, head_dim, block_size, dtype_s)
    except ValueError:
        layout = None
    hello = Hello(kind, layout, text, block_bytes, num_blocks, chunk_blocks, num_slots, "",
                  flags)
    return hello, tid_len


def layout_error(hello: Hello, mine: KVLayout, checksums: bool = True) -> str | None:
    """Why this receiver (``mine``, verifying ``checksums`` or not) cannot take the
    transfer, or None: both sides then fail it with that message."""
    if hello.layout != mine or hello.block_bytes != mine.block_bytes:
        return f"layout mismatch: sender {hello.layout_text} != receiver {mine}"
    return checksum_setting_error(hello.checksums, checksums)


def checksum_setting_error(sender: bool, receiver: bool) -> str | None:
    """Both sides must agree on block checksums (KVTransferOptions.checksums)."""
    if sender == receiver:
        return None
    return (f"checksum setting mismatch: block checksums are {'on' if sender else 'off'} at "
            f"the sender, {'on' if receiver else 'off'} at the receiver (both must agree)")


def encode_reply(status: int, value: int = 0, message: str = "") -> bytes:
    text = message.encode()[:60000]
    return _REPLY.pack(status, value, len(text)) + text


def encode_blob(data: bytes) -> bytes:
    """A length-prefixed opaque message (backend metadata: NCCL unique ids, NIXL agent
    metadata, CUDA IPC handles) sent on a transfer's control connection."""
    if len(data) > MAX_BLOB_BYTES:
        raise ValueError(f"control message of {len(data)} bytes exceeds {MAX_BLOB_BYTES}")
    return _BLOB.pack(len(data)) + data


async def read_blob(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    (n,) = _BLOB.unpack(await recv_exact(loop, sock, _BLOB.size))
    if n > MAX_BLOB_BYTES:
        raise TransferError(f"control message of {n} bytes exceeds {MAX_BLOB_BYTES}")
    return await recv_exact(loop, sock, n)


async def recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``; PeerClosed on end of stream."""
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise PeerClosed(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if n:
        await recv_into(loop, sock, memoryview(buf))
    return bytes(buf)


async def read_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     head: bytes | None = None) -> Hello:
    """Read a HELLO (``head``: its fixed part when already read, e.g. with an fd)."""
    if head is None:
        head = await recv_exact(loop, sock, HELLO_SIZE)
    hello, tid_len = decode_hello_head(head)
    tid = (await recv_exact(loop, sock, tid_len)).decode(errors="replace")
    return dataclasses.replace(hello, transfer_id=tid)


async def read_reply(loop: asyncio.AbstractEventLoop,
                     sock: socket.socket) -> tuple[int, int, str]:
    status, value, n = _REPLY.unpack(await recv_exact(loop, sock, _REPLY.size))
    return status, value, (await recv_exact(loop, sock, n)).decode(errors="replace")


async def expect_ok(loop: asyncio.AbstractEventLoop, sock: socket.socket, what: str) -> str:
    """Read a reply; return an OK's message, raise TransferError for anything else."""
    status, _, message = await read_reply(loop, sock)
    if status == ERROR:
        raise TransferError(f"receiver {what}: {message}")
    if status != OK:
        raise TransferError(f"protocol error: unexpected reply status {status} ({what})")
    return message


def data_seconds_message(what: str, seconds: float) -> str:
    """An OK message that carries how long the data movement itself took (``what <s>``)."""
    return f"{what} {seconds:.9f}"


def parse_data_seconds(message: str) -> float | None:
    try:
        return float(message.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return None


def try_send_error(sock: socket.socket, message: str) -> None:
    """Best effort, never blocks: tell the peer why we are hanging up."""
    try:
        sock.send(encode_reply(ERROR, 0, message))
    except OSError:
        pass


async def wait_readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())


def parse_endpoint(endpoint: str, scheme: str) -> str:
    prefix = f"{scheme}://"
    if not endpoint.startswith(prefix):
        raise TransferError(f"endpoint {endpoint!r} is not a {scheme}:// endpoint")
    return endpoint[len(prefix):]


def peer_failed(sock: socket.socket) -> bool:
    """Peek at a control socket: closed, reset or an ERROR reply next."""
    try:
        head = sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return head == b"" or head[0] == ERROR


async def peer_reason(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> str:
    """The reason a peer gave up (its ERROR's message), or "connection closed"."""
    try:
        async with asyncio.timeout(0.2):
            status, _, message = await read_reply(loop, sock)
        return message if status == ERROR else f"unexpected reply {status}"
    except (OSError, EOFError, TransferError, TimeoutError):
        return "connection closed"
