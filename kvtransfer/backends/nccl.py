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
    checksums of the part's blocks (copy          one more ncclRecv: the checksums; compare
    stream), one more ncclSend                    them with the landed blocks' own (GPU)
    after the last part:                          wait for the receives and comparisons
                                              <-  OK (blocks in place and intact)
    wait for the sends (CUDA event)

The sender's NCCL stream waits on the prefill's event itself, so a part is queued as soon as
the chunk that computes it was launched. A part handed over with per-layer events (the
prefill worker's chunks) moves layer by layer: its BLOB names layer groups (``layers``, 4
layers per message by default), the receiver posts one receive per group into a staging
buffer and scatters it into its blocks, and the sender queues, per group, a wait on the
group's last layer, a gather of those layers of the part's blocks into a staging buffer,
and the send. So the KV moves while the later layers still compute, and after the forward
pass only the last group is left to move. Gathers and scatters run on a second stream of
the pair into / out of two staging buffers per side, so one group's gather or scatter
overlaps its neighbour's message.

Segments are runs contiguous in both caches (block-major: one segment = one message), so a
freshly prefilled prompt is usually ONE message. A part whose KV is already written (a
cached prefix, a retry) is offered ``pack`` layer groups as well: when its segments are
short (scattered blocks) the receiver answers ``layers`` and the part moves as a few large
gathered messages instead of one message per block. A pair's sends and receives must be queued
in the same order on both sides: the sender holds a per-pair lock from its BLOB until its
sends are queued, and the receiver queues its receives before it answers, so at most one
transfer per pair is between those two points.

Communicators are non-blocking: nothing here waits on a peer except through
``poll_in_thread`` / ``wait_event``, which the transfer's timeout / cancellation interrupts.
Any failure after a communicator was touched aborts it (ending queued kernels, so a dead peer
never wedges the GPU stream) and drops it; the next transfer to that peer creates a new one.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
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
    ListenAddress,
    TransferError,
    TransferState,
    check_options,
    option,
)
from kvtransfer.backends.nccl_comm import (
    Comm,
    Pairs,
    checked,
    load_lib,
    per_layer,
    staging_buffers,
    try_staging,
)
from kvtransfer.blocks import (
    check_layer_groups,
    device_index,
    gather_layers,
    layer_groups,
    pack_groups,
    scatter_layers,
    segments,
    staging_view,
)
from kvtransfer.control import await_ack, control_receiver, control_sender, require_cuda
from kvtransfer.lifecycle import ExpectedTransfer, TransferStateMachine
from kvtransfer.stream import BlockStream, Part
from kvtransfer.waits import wait_event

logger = logging.getLogger(__name__)

LAYERED = "layers"  # the receiver's reply to a part sent layer group by layer group
# A part whose blocks are all written (a prefix-cache hit, a retry) is offered packed: its
# messages average under PACK_BELOW_BYTES when its blocks are scattered (one 2 MiB message
# per block for Llama-3-8B), and NCCL moves short messages at a fraction of the link's rate
# (docs/performance.md: NCCL's rate by message size). The receiver then takes it as
# layer groups of about PACK_MESSAGE_BYTES each, gathered / scattered on both sides.
PACK_BELOW_BYTES = 32 << 20
PACK_MESSAGE_BYTES = 128 << 20


@dataclass(frozen=True)
class NcclOptions:
    layers_per_message: int = option(
        4, "sender: a part handed over with per-layer events (a prefill chunk still "
           "computing) moves as one message per this many layers, each sent as soon as its "
           "layers are written; 0 sends whole parts only", minimum=0)
    pack_message_bytes: int = option(
        PACK_MESSAGE_BYTES, "sender: a written part of scattered blocks moves packed, in "
                            "layer-group messages of about this size; 0: never", minimum=0)
    library: str = option("", "path of libnccl to load; empty: the one PyTorch loaded, else "
                              "the nvidia-nccl wheel's")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class _PartMeta:
    """A part's BLOB as the receiver reads it: who sends, the source ids, the unique id of a
    new communicator, and the layer groups it is sent in (``groups``) or may be packed in
    (``pack``)."""

    sender: str
    src: list[int]
    uid: bytes
    groups: list[tuple[int, int]] | None
    pack: list[tuple[int, int]] | None

    @classmethod
    def parse(cls, data: bytes, layout: KVLayout, first: bool) -> _PartMeta:
        """TransferError for anything malformed (a new communicator is only allowed with a
        transfer's ``first`` part)."""
        try:
            meta = json.loads(data)
            uid = base64.b64decode(meta["uid"]) if meta.get("uid") else b""
            if uid and not first:
                raise ValueError("a new communicator in the middle of a transfer")
            layers = layout.num_layers
            return cls(str(meta["sender"]), [int(i) for i in meta["src"]], uid,
                       check_layer_groups(meta["layers"], layers) if meta.get("layers") else None,
                       check_layer_groups(meta["pack"], layers) if meta.get("pack") else None)
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"bad nccl transfer metadata: {exc}") from None


def _ops(cache: torch.Tensor, layout: KVLayout, segs, op: str, side: int):
    base, bb = cache.data_ptr(), layout.block_bytes
    return [(op, base + seg[side] * bb, seg[2] * bb) for seg in segs]


class NcclPayloadReceiver:
    """Posts each part's receives on the pair's communicator (one per segment, or one per
    layer group into staging buffers) and waits for the last one."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout, options: NcclOptions) -> None:
        self._cache = cache
        self._layout = layout
        self._library = options.library
        self._pairs = Pairs()  # by sender id

    async def start(self) -> None:
        pass

    def close(self) -> None:
        self._pairs.close()

    def _settle(self, key: str, comm: Comm, entry: ExpectedTransfer) -> None:
        """When a transfer ends other than DONE (timeout, cancel, failure), abort the pair's
        communicator and wait for its stream, so no receive writes into the blocks after
        the waiter learned the result (this runs before the waiter is woken)."""
        if entry.state is not TransferState.DONE:
            self._pairs.drop(key, comm)
            comm.drain()

    async def receive(self, loop, conn: socket.socket, entry: ExpectedTransfer) -> None:
        dst, got = entry.dst_block_ids, 0
        key, comm, event = "", None, None
        verifier: _Verifier | None = None
        try:
            while got < len(dst):  # one BLOB per part the sender's stream handed over
                part = _PartMeta.parse(await wire.read_blob(loop, conn), self._layout,
                                       first=comm is None)
                entry.mark("blob")
                if not part.src or got + len(part.src) > len(dst):
                    raise TransferError(f"nccl sender sent {got + len(part.src)} of "
                                        f"{len(dst)} blocks")
                key = part.sender if comm is None else key
                part_dst = dst[got:got + len(part.src)]
                async with self._pairs.lock(key):
                    if comm is None:
                        comm = await self._join(key, part.uid, conn)
                        pair = comm
                        entry.on_end(lambda: self._settle(key, pair, entry))
                    elif self._pairs.comms.get(key) is not comm or comm.aborted:
                        raise TransferError("NCCL communicator was replaced mid-transfer")
                    event = await self._post_part(loop, conn, comm, entry, part, part_dst)
                    if entry.checksums:
                        verifier = verifier or _Verifier(self._cache, comm, len(dst))
                        event = await verifier.part(conn, part_dst, got, event)
                entry.mark("queued")
                got += len(part.src)
            if verifier is not None:
                event = verifier.finish()
            await wait_event(event, watch=conn, what="NCCL receive", mark=entry.mark)
            entry.mark("received")
            comm.check()
            if verifier is not None:
                verifier.verdict(dst)
            entry.add_bytes(len(dst) * self._layout.block_bytes)
        except BaseException:
            if comm is not None:
                self._pairs.drop(key, comm)
            raise

    async def _post_part(self, loop, conn: socket.socket, comm: Comm, entry: ExpectedTransfer,
                         part: _PartMeta, dst: list[int]) -> torch.cuda.Event:
        """Post one part's receives and tell the sender how to cut its messages (OK with the
        segment counts, or LAYERED); returns an event completing with the receives."""
        segs = segments(part.src, dst)
        entry.add_pieces(len(segs))
        pack = None  # taken when the segments are short (scattered blocks)
        if part.groups is None and part.pack and len(segs) > 1 and \
                len(part.src) * self._layout.block_bytes < PACK_BELOW_BYTES * len(segs):
            pack = part.pack
        groups = part.groups or pack
        staged = None
        if groups:
            staged = try_staging(self._layout, len(part.src), groups, comm)
            if staged is None and part.groups:
                raise TransferError("no GPU memory for the layer groups' staging buffers")
        if staged is not None:  # else no memory to pack: whole messages
            return await self._receive_layers(loop, conn, comm, dst, groups, staged)
        comm.post(_ops(self._cache, self._layout, segs, "recv", 1), peer=0)
        # receives posted: the sender cuts its blocks into the same messages
        counts = ",".join(str(n) for _, _, n in segs)
        await loop.sock_sendall(conn, wire.encode_reply(wire.OK, len(segs), counts))
        return await comm.queued(watch=conn)

    async def _receive_layers(self, loop, conn: socket.socket, comm: Comm, dst: list[int],
                              groups: list[tuple[int, int]],
                              bufs: list[torch.Tensor]) -> torch.cuda.Event:
        """A part sent layer group by layer group (while the prefill computes it, or packed):
        per group one message into one of two staging buffers, scattered into the
        destination blocks on the pair's copy stream while the next group's message lands
        in the other buffer (a buffer is reused once its last scatter ran). ``bufs``:
        :func:`_try_staging`'s."""
        with comm.current():
            idx = device_index(dst, comm.device)
            idx.record_stream(comm.copy_stream)
        layer_elems = per_layer(self._layout)
        scattered: list[torch.cuda.Event | None] = [None, None]
        for k, (lo, hi) in enumerate(groups):
            slot = k % 2
            if scattered[slot] is not None:
                comm.stream.wait_event(scattered[slot])
            staging = staging_view(bufs[slot], len(dst), hi - lo, layer_elems)
            comm.post([("recv", staging.data_ptr(), staging.nbytes)], peer=0)
            if k == 0:  # posted: the sender may start (a new pair's set-up needs both sides)
                await loop.sock_sendall(conn, wire.encode_reply(wire.OK, len(groups),
                                                                 LAYERED))
            received = await comm.queued(watch=conn)
            with torch.cuda.device(comm.device), torch.cuda.stream(comm.copy_stream):
                comm.copy_stream.wait_event(received)
                scatter_layers(self._cache, idx, lo, hi, staging)
                scattered[slot] = torch.cuda.Event()
                scattered[slot].record(comm.copy_stream)
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(comm.copy_stream)
        return event

    async def _join(self, key: str, uid: bytes, conn: socket.socket) -> Comm:
        """The pair's communicator: a new one when the sender sent a unique id."""
        comm = self._pairs.comms.get(key)
        if uid:
            if comm is not None:  # the sender started over (it aborted its side)
                self._pairs.drop(key, comm)
            comm = Comm(self._cache.device, uid, rank=1, library=self._library)
            self._pairs.comms[key] = comm
            await comm.wait_idle(conn, "NCCL communicator init")
            comm.ready = True
        elif comm is None:
            raise TransferError(f"no NCCL communicator with sender {key} "
                                "(receiver restarted?); the next transfer creates one")
        return comm

class NcclPayloadSender:
    """Queues each part's sends on the pair's communicator, as one message per segment or
    per layer group (gathered into staging buffers), behind the part's events."""

    eager = False

    def __init__(self, cache: torch.Tensor, layout: KVLayout, options: NcclOptions) -> None:
        self._cache = cache
        self._layout = layout
        self._library = options.library
        self._id = uuid.uuid4().hex
        self._pairs = Pairs()  # by receiver endpoint
        per = options.layers_per_message
        self._groups = layer_groups(layout.num_layers, per) if 0 < per < layout.num_layers \
            else None
        self._pack_bytes = options.pack_message_bytes

    def close(self) -> None:
        self._pairs.close()

    async def send(self, loop, sock: socket.socket, endpoint: str, sm: TransferStateMachine,
                   blocks: BlockStream) -> None:
        comm: Comm | None = None
        timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # written-part sends
        last = None  # completes with the last send queued (the lease: nothing reads after)
        keep: list[torch.Tensor] = []  # buffers the queued sends read
        try:
            async for part in blocks.layered_parts():
                sm.mark("part")
                async with self._pairs.lock(endpoint):
                    comm, groups, segs, staged = await self._offer(loop, sock, endpoint, sm,
                                                                   comm, part)
                    if not comm.ready:
                        await comm.wait_idle(sock, "NCCL communicator init")
                        comm.ready = True
                    # fault injection damages the first part only
                    corrupt = sm.transfer_id if sm.corrupt else None
                    sm.corrupt = False
                    if groups:
                        first, last = await self._send_layers(sock, comm, part, groups,
                                                              staged, corrupt)
                        if part.layers is None:  # packed: the data was ready, time it
                            timings.append((first, last))
                    else:
                        first, last = await self._send_segments(sock, comm, part, segs,
                                                                corrupt, keep)
                        timings.append((first, last))
                    sm.mark("queued")
                    if sm.checksums:
                        last = await self._send_checksums(sock, comm, part, keep)
            await await_ack(loop, sock, sm)
            sm.mark("ack")
            await wait_event(last, what="NCCL send")
            comm.check()
            if timings:  # layer groups wait for the forward pass: no data-only time
                sm.data_seconds = sum(a.elapsed_time(b) for a, b in timings) / 1000.0
        except BaseException:
            if comm is not None:  # abort, then let the aborted kernels drain: the caller
                self._pairs.drop(endpoint, comm)  # frees the source blocks when send() returns
                comm.drain()
            raise

    async def _send_segments(self, sock: socket.socket, comm: Comm, part: Part, segs,
                             corrupt: str | None, keep: list[torch.Tensor]):
        """Queue one message per segment, behind the part's event (the GPU waits for the
        prefill's kernels, not the host); events before and after them. ``corrupt``: the
        transfer id, to damage (fault injection)."""
        if part.event is not None:  # the part's KV is written once the prefill's event
            comm.stream.wait_event(part.event)  # completes
        start = torch.cuda.Event(enable_timing=True)
        start.record(comm.stream)
        ops = _ops(self._cache, self._layout, segs, "send", 0)
        if corrupt:  # fault injection: the first segment goes out of a damaged copy
            s0, _, n0 = segs[0]
            with comm.current():
                bad = self._cache[s0:s0 + n0].clone()
                checksum.corrupt_first_byte(bad, 0, corrupt)
            keep.append(bad)
            ops[0] = ("send", bad.data_ptr(), ops[0][2])
        comm.post(ops, peer=1)
        return start, await comm.queued(watch=sock)

    async def _send_checksums(self, sock: socket.socket, comm: Comm, part: Part,
                              keep: list[torch.Tensor]) -> torch.cuda.Event:
        """One more message after the part's data: its blocks' checksums, computed on the
        pair's copy stream once the part is written (overlapping the data messages)."""
        with torch.cuda.device(comm.device), torch.cuda.stream(comm.copy_stream):
            if part.event is not None:  # layered parts too: it completes after every layer
                comm.copy_stream.wait_event(part.event)
            sums = checksum.block_checksums(self._cache, part.ids)
            ready = torch.cuda.Event()
            ready.record(comm.copy_stream)
        sums.record_stream(comm.stream)
        keep.append(sums)
        comm.stream.wait_event(ready)
        comm.post([("send", sums.data_ptr(), sums.nbytes)], peer=1)
        return await comm.queued(watch=sock)

    async def _offer(self, loop, sock: socket.socket, endpoint: str, sm: TransferStateMachine,
                     comm: Comm | None, part: Part):
        """Offer one part (BLOB) and read how the receiver posted its receives. Returns the
        communicator, the layer groups to send (None: whole segments), the segments and the
        staging buffers already taken for a packed part."""
        groups = self._groups if part.layers is not None and \
            len(part.layers) == self._layout.num_layers else None
        comm, uid = self._pair_for(endpoint, comm)
        meta = {"sender": self._id, "src": part.ids,
                "uid": base64.b64encode(uid).decode() if uid else ""}
        staged = None  # staging buffers for a packed part
        if groups:
            meta["layers"] = groups
        elif self._pack_bytes > 0:  # the receiver packs it if its blocks scatter
            pack = pack_groups(self._layout.num_layers, len(part.ids) * self._layout.block_bytes,
                               self._pack_bytes)
            staged = try_staging(self._layout, len(part.ids), pack, comm)
            if staged is not None:  # offered only when there is memory for it
                meta["pack"] = pack
        await loop.sock_sendall(sock, wire.encode_blob(json.dumps(meta).encode()))
        # the receiver answers once its receives are queued (after joining the comm), with
        # the message sizes it posted (runs contiguous in both caches)
        status, nsegs, text = await wire.read_reply(loop, sock)
        sm.mark("reply")
        if status == wire.ERROR:
            raise TransferError(f"receiver could not post the receives: {text}")
        if groups is None and staged is not None and text == LAYERED:
            groups = meta["pack"]  # the receiver took the part packed
        if groups:
            if status != wire.OK or nsegs != len(groups) or text != LAYERED:
                raise TransferError("protocol error: receiver did not post the "
                                    f"layer groups ({text[:80]!r})")
            return comm, groups, None, staged
        return comm, None, _source_segments(part.ids, status, nsegs, text), staged

    async def _send_layers(self, sock: socket.socket, comm: Comm, part: Part,
                           groups: list[tuple[int, int]], staged: list[torch.Tensor] | None,
                           corrupt: str | None = None
                           ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue one message per layer group: on the pair's copy stream, each group's layers
        of the part's blocks are gathered into one of two staging buffers (behind the event
        of the group's last layer when the part is still computing, else behind the part's
        event), and sent from it while the next group is gathered into the other buffer (a
        buffer is reused once its message left; ``staged``: buffers already taken, else
        they are allocated here). Returns events at the first gather and after the last
        send. ``corrupt``: the transfer id, to damage its first message (fault injection)."""
        bufs = staged or staging_buffers(self._layout, len(part.ids), groups, comm)
        with comm.current():
            idx = device_index(part.ids, comm.device)
            idx.record_stream(comm.copy_stream)
            indexed = torch.cuda.Event()
            indexed.record(comm.stream)
        copy = comm.copy_stream
        sent: list[torch.cuda.Event | None] = [None, None]
        first = torch.cuda.Event(enable_timing=True)
        done = None
        for k, (lo, hi) in enumerate(groups):
            slot = k % 2
            with torch.cuda.device(comm.device), torch.cuda.stream(copy):
                if k == 0:
                    copy.wait_event(indexed)
                    if part.layers is None and part.event is not None:
                        copy.wait_event(part.event)
                    first.record(copy)
                if part.layers is not None:
                    copy.wait_event(part.layers[hi - 1])
                if sent[slot] is not None:
                    copy.wait_event(sent[slot])
                staging = gather_layers(self._cache, idx, lo, hi, out=bufs[slot])
                if corrupt and k == 0:
                    checksum.corrupt_first_byte(staging, 0, corrupt)
                gathered = torch.cuda.Event()
                gathered.record(copy)
            comm.stream.wait_event(gathered)
            comm.post([("send", staging.data_ptr(), staging.nbytes)], peer=1)
            done = await comm.queued(watch=sock)
            sent[slot] = done
        return first, done

    def _pair_for(self, endpoint: str, current: Comm | None) -> tuple[Comm, bytes]:
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
        uid = checked(load_lib(self._library).unique_id)
        comm = Comm(self._cache.device, uid, rank=0, library=self._library)
        self._pairs.comms[endpoint] = comm
        return comm, uid



class _Verifier:
    """The receiving side of a transfer's checksums: after each part's data one more
    message (the sender's checksums of that part), compared on the pair's copy stream with
    the landed blocks' own into per-block flags; the flags reach the host with the final
    event the receive waits for anyway (no extra sync)."""

    def __init__(self, cache: torch.Tensor, comm: Comm, num_blocks: int) -> None:
        self._cache = cache
        self._comm = comm
        with torch.cuda.device(comm.device), torch.cuda.stream(comm.copy_stream):
            self._bad = torch.zeros(num_blocks, dtype=torch.bool, device=comm.device)
        self._host: torch.Tensor | None = None
        self._keep: list[torch.Tensor] = []

    async def part(self, conn: socket.socket, dst: list[int], offset: int,
                   landed: torch.cuda.Event) -> torch.cuda.Event:
        """Post the receive of the part's checksums (right behind its data, under the pair's
        lock) and queue the comparison; returns an event completing with it."""
        comm = self._comm
        with comm.current():
            theirs = torch.empty(len(dst), dtype=torch.int64, device=comm.device)
        theirs.record_stream(comm.copy_stream)
        self._keep.append(theirs)
        comm.post([("recv", theirs.data_ptr(), theirs.nbytes)], peer=0)
        arrived = await comm.queued(watch=conn)
        with torch.cuda.device(comm.device), torch.cuda.stream(comm.copy_stream):
            comm.copy_stream.wait_event(landed)  # the data (scattered, when layered)
            comm.copy_stream.wait_event(arrived)
            mine = checksum.block_checksums(self._cache, dst)
            self._bad[offset:offset + len(dst)] = mine != theirs
            compared = torch.cuda.Event(blocking=True)
            compared.record(comm.copy_stream)
        return compared

    def finish(self) -> torch.cuda.Event:
        """Queue the flags' copy to the host; the event completes once every part was
        compared and the flags are there."""
        comm = self._comm
        with torch.cuda.device(comm.device), torch.cuda.stream(comm.copy_stream):
            self._host = torch.empty(len(self._bad), dtype=torch.bool, pin_memory=True)
            self._host.copy_(self._bad, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(comm.copy_stream)
        return done

    def verdict(self, dst: list[int]) -> None:
        """After :meth:`finish`'s event: TransferError naming the first corrupted block."""
        checksum.verify_flags(self._host.numpy(), dst)


def _source_segments(ids: list[int], status: int, nsegs: int,
                     text: str) -> list[tuple[int, int, int]]:
    """``(src_start, 0, count)`` messages from the receiver's comma-separated counts."""
    try:
        counts = [int(c) for c in text.split(",")] if text else []
    except ValueError:
        counts = []
    if status != wire.OK or len(counts) != nsegs or sum(counts) != len(ids) or \
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


def make_sender(cache: torch.Tensor, layout: KVLayout, options: NcclOptions,
                shared: KVTransferOptions) -> KVSender:
    require_cuda(cache, "nccl")
    layout.validate(cache)
    return control_sender(cache, layout, "nccl", wire.KIND_NCCL,
                          NcclPayloadSender(cache, layout, options), shared)


def make_receiver(cache: torch.Tensor, layout: KVLayout, options: NcclOptions,
                  shared: KVTransferOptions, listen: ListenAddress | None) -> KVReceiver:
    require_cuda(cache, "nccl")
    layout.validate(cache)
    return control_receiver(cache, layout, "nccl", wire.KIND_NCCL,
                            NcclPayloadReceiver(cache, layout, options), shared, listen)


BACKEND = BackendSpec(name="nccl", devices=("cuda",), listener=True, options=NcclOptions,
                      sender=make_sender, receiver=make_receiver)
