"""NCCL backend: GPU -> GPU over NVLink / the network, one communicator per sender/receiver pair.

Per transfer, on the control connection (see :mod:`kvtransfer.control`)::

    sender (rank 0)                               receiver (rank 1)
    HELLO                                     ->  claim            <- OK
    per part of the sender's BlockStream (one part when the prompt was already computed):
    BLOB {sender id, unique id if the pair has    [new pair: init rank 1, wait for it]
          no communicator yet, src block ids} ->  enqueue one ncclRecv per segment
    [new pair: init rank 0 before the BLOB]   <-  OK (receives posted)
    stream waits for the part's prefill event,
    enqueue one ncclSend per segment
    after the last part:                          wait for the receives (CUDA event)
                                              <-  OK (blocks in place)
    wait for the sends (CUDA event)

The sender's NCCL stream waits on the prefill's event itself, so a part is queued as soon as
the chunk that computed it was launched, and moves while the next chunk computes.

Segments are runs contiguous in both caches (block-major: one segment = one message), so a
freshly prefilled prompt is usually ONE message. A pair's sends and receives must be queued
in the same order on both sides: the sender holds a per-pair lock from its BLOB until its
sends are queued, and the receiver queues its receives before it answers, so at most one
transfer per pair is between those two points.

Communicators are non-blocking: nothing here waits on a peer except through ``poll_until`` /
``wait_event``, which the transfer's timeout / cancellation interrupts. Any failure after a
communicator was touched aborts it (ending queued kernels, so a dead peer never wedges the GPU stream) and
drops it; the next transfer to that peer creates a new one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import uuid

import torch

from kvtransfer import protocol as proto
from kvtransfer.base import KVLayout, TransferState, TransferStateMachine
from kvtransfer.control import (
    ControlReceiver,
    ControlSender,
    await_ack,
    poll_until,
    require_cuda,
    segments,
    wait_event,
)
from kvtransfer.stream import BlockStream
from kvtransfer.tracking import ExpectedTransfer, TransferError

logger = logging.getLogger(__name__)


class _Comm:
    """One pair's communicator, its stream and its device."""

    def __init__(self, device: torch.device, uid: bytes, rank: int) -> None:
        self.lib = _lib()
        self.device = device
        self.ready = False
        self.aborted = False
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.handle = _checked(self.lib.init_rank, uid, 2, rank)

    def state(self) -> int:
        return _checked(self.lib.state, self.handle)

    def check(self) -> None:
        """After our work completed: it only counts if the communicator was not aborted
        meanwhile (an abort also 'completes' queued kernels, without the data)."""
        if self.aborted:
            raise TransferError("NCCL communicator was aborted (another transfer on this "
                                "pair failed or the worker is closing)")
        self.state()

    async def wait_idle(self, watch: socket.socket | None, what: str) -> None:
        from kvtransfer.nccl_lib import IN_PROGRESS

        await poll_until(lambda: self.state() != IN_PROGRESS, watch=watch, what=what)

    def post(self, ops: list[tuple[str, int, int]], peer: int) -> None:
        """Start queueing ``ops`` as one group. On a pair's first transfer the group stays
        in progress until the PEER posts its matching group (connection setup), so the
        other side must be told to go ahead before :meth:`queued` is awaited."""
        with torch.cuda.device(self.device):
            _checked(self.lib.group, self.handle, ops, peer, self.stream.cuda_stream)

    async def queued(self, watch: socket.socket | None) -> torch.cuda.Event:
        """Wait until the posted group is on the stream; returns an event completing with it."""
        await self.wait_idle(watch, "NCCL enqueue")
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(self.stream)
        return event

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            try:
                self.lib.abort(self.handle)
            except Exception:  # noqa: BLE001
                logger.exception("ncclCommAbort failed")


class _Pairs:
    """A side's communicators by peer (sender id / receiver endpoint) and the per-peer locks
    that keep one transfer at a time between posting and queueing."""

    def __init__(self) -> None:
        self.comms: dict[str, _Comm] = {}
        self.locks: dict[str, asyncio.Lock] = {}

    def lock(self, peer: str) -> asyncio.Lock:
        return self.locks.setdefault(peer, asyncio.Lock())

    def drop(self, peer: str, comm: _Comm) -> None:
        """Abort ``comm`` and forget it, unless a newer one for the peer replaced it."""
        comm.abort()
        if self.comms.get(peer) is comm:
            del self.comms[peer]

    def close(self) -> None:
        for peer, comm in list(self.comms.items()):
            self.drop(peer, comm)


def _lib():
    from kvtransfer import nccl_lib

    try:
        return nccl_lib.lib()
    except (OSError, RuntimeError) as exc:
        raise TransferError(f"NCCL unavailable: {exc}") from None


def _checked(fn, *args):
    """Call into NCCL; its errors fail the transfer (TransferError), they never escape."""
    from kvtransfer.nccl_lib import NcclError

    try:
        return fn(*args)
    except NcclError as exc:
        raise TransferError(str(exc)) from None


def _ops(cache: torch.Tensor, layout: KVLayout, segs, op: str, side: int):
    base, bb = cache.data_ptr(), layout.block_bytes
    return [(op, base + seg[side] * bb, seg[2] * bb) for seg in segs]


class NcclReceiver(ControlReceiver):
    scheme = "nccl"
    kind = proto.KIND_NCCL

    def __init__(self, cache: torch.Tensor, layout: KVLayout, **opts) -> None:
        require_cuda(cache, "nccl")
        super().__init__(cache, layout, **opts)
        self._pairs = _Pairs()  # by sender id

    def _settle(self, key: str, comm: _Comm, entry: ExpectedTransfer) -> None:
        """When a transfer ends other than DONE (timeout, cancel, failure), abort the pair's
        communicator and wait for its stream, so no receive writes into the blocks after
        the waiter learned the result (this runs before the waiter is woken)."""
        if entry.state is not TransferState.DONE:
            self._pairs.drop(key, comm)
            comm.stream.synchronize()

    async def _receive_payload(self, loop, conn: socket.socket,
                               entry: ExpectedTransfer) -> None:
        dst, got = entry.dst_block_ids, 0
        key, comm, event = "", None, None
        try:
            while got < len(dst):  # one BLOB per part the sender's stream handed over
                try:
                    meta = json.loads(await proto.read_blob(loop, conn))
                    src = [int(i) for i in meta["src"]]
                    uid = base64.b64decode(meta["uid"]) if meta.get("uid") else b""
                    if comm is None:
                        key = str(meta["sender"])
                    elif uid:
                        raise ValueError("a new communicator in the middle of a transfer")
                    segs = segments(src, dst[got:got + len(src)])
                except (ValueError, KeyError, TypeError) as exc:
                    raise TransferError(f"bad nccl transfer metadata: {exc}") from None
                if not src or got + len(src) > len(dst):
                    raise TransferError(f"nccl sender sent {got + len(src)} of {len(dst)} blocks")
                async with self._pairs.lock(key):
                    if comm is None:
                        comm = await self._join(key, uid, conn)
                        pair = comm
                        entry.on_end(lambda: self._settle(key, pair, entry))
                    elif self._pairs.comms.get(key) is not comm or comm.aborted:
                        raise TransferError("NCCL communicator was replaced mid-transfer")
                    comm.post(_ops(self._cache, self._layout, segs, "recv", 1), peer=0)
                    # receives posted: the sender cuts its blocks into the same messages
                    counts = ",".join(str(n) for _, _, n in segs)
                    await loop.sock_sendall(conn, proto.encode_reply(proto.OK, len(segs), counts))
                    event = await comm.queued(watch=conn)
                got += len(src)
            await wait_event(event, watch=conn, what="NCCL receive")
            comm.check()
            entry.add_bytes(len(dst) * self._layout.block_bytes)
        except BaseException:
            if comm is not None:
                self._pairs.drop(key, comm)
            raise

    async def _join(self, key: str, uid: bytes, conn: socket.socket) -> _Comm:
        """The pair's communicator: a new one when the sender sent a unique id."""
        comm = self._pairs.comms.get(key)
        if uid:
            if comm is not None:  # the sender started over (it aborted its side)
                self._pairs.drop(key, comm)
            comm = _Comm(self._cache.device, uid, rank=1)
            self._pairs.comms[key] = comm
            await comm.wait_idle(conn, "NCCL communicator init")
            comm.ready = True
        elif comm is None:
            raise TransferError(f"no NCCL communicator with sender {key} "
                                "(receiver restarted?); the next transfer creates one")
        return comm

    def _close_backend(self) -> None:
        self._pairs.close()


class NcclSender(ControlSender):
    scheme = "nccl"
    kind = proto.KIND_NCCL

    def __init__(self, cache: torch.Tensor, layout: KVLayout) -> None:
        require_cuda(cache, "nccl")
        super().__init__(cache, layout)
        self._id = uuid.uuid4().hex
        self._pairs = _Pairs()  # by receiver endpoint

    async def _send_payload(self, loop, sock: socket.socket, endpoint: str,
                            sm: TransferStateMachine, blocks: BlockStream) -> None:
        comm: _Comm | None = None
        timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        try:
            async for ids, ready in blocks.parts():
                async with self._pairs.lock(endpoint):
                    comm, uid = self._pair_for(endpoint, comm)
                    meta = {"sender": self._id, "src": ids,
                            "uid": base64.b64encode(uid).decode() if uid else ""}
                    await loop.sock_sendall(sock, proto.encode_blob(json.dumps(meta).encode()))
                    # the receiver answers once its receives are queued (after joining the
                    # comm), with the message sizes it posted (runs contiguous in both caches)
                    status, nsegs, text = await proto.read_reply(loop, sock)
                    if status == proto.ERROR:
                        raise TransferError(f"receiver could not post the receives: {text}")
                    segs = _source_segments(ids, status, nsegs, text)
                    if not comm.ready:
                        await comm.wait_idle(sock, "NCCL communicator init")
                        comm.ready = True
                    if ready is not None:  # the part's KV is written once the prefill's
                        comm.stream.wait_event(ready)  # event completes: the GPU waits, not us
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(comm.stream)
                    comm.post(_ops(self._cache, self._layout, segs, "send", 0), peer=1)
                    timings.append((start, await comm.queued(watch=sock)))
            await await_ack(loop, sock)
            await wait_event(timings[-1][1], what="NCCL send")
            comm.check()
            sm.data_seconds = sum(a.elapsed_time(b) for a, b in timings) / 1000.0
        except BaseException:
            if comm is not None:  # abort, then let the aborted kernels drain: the caller
                self._pairs.drop(endpoint, comm)  # frees the source blocks when send() returns
                comm.stream.synchronize()
            raise

    def _pair_for(self, endpoint: str, current: _Comm | None) -> tuple[_Comm, bytes]:
        """The communicator for this part (and the unique id to send, for a new one). A
        transfer keeps one communicator: if it was aborted meanwhile the transfer fails."""
        comm = self._pairs.comms.get(endpoint)
        if current is not None:
            if comm is not current or current.aborted:
                raise TransferError("NCCL communicator was aborted mid-transfer "
                                    "(another transfer on this pair failed)")
            return current, b""
        if comm is not None:
            return comm, b""
        uid = _checked(_lib().unique_id)
        comm = _Comm(self._cache.device, uid, rank=0)
        self._pairs.comms[endpoint] = comm
        return comm, uid

    def _close_backend(self) -> None:
        self._pairs.close()


def _source_segments(ids: list[int], status: int, nsegs: int,
                     text: str) -> list[tuple[int, int, int]]:
    """``(src_start, 0, count)`` messages from the receiver's comma-separated counts."""
    try:
        counts = [int(c) for c in text.split(",")] if text else []
    except ValueError:
        counts = []
    if status != proto.OK or len(counts) != nsegs or sum(counts) != len(ids) or \
            any(c <= 0 for c in counts):
        raise TransferError(f"protocol error: bad segment list from receiver ({text[:80]!r})")
    segs, pos = [], 0
    for n in counts:
        run = ids[pos:pos + n]
        if run != list(range(run[0], run[0] + n)):
            raise TransferError("protocol error: receiver segment is not contiguous here")
        segs.append((run[0], 0, n))
        pos += n
    return segs
