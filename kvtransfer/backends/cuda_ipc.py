"""CUDA IPC backend: same-host GPU -> GPU, the receiver pulls over NVLink.

The sender exports its cache's memory once (a CUDA IPC handle, through PyTorch's storage
sharing); per transfer it sends that handle on the control connection (see
:mod:`kvtransfer.control`), then the source block ids of each part of its BlockStream once
the part's KV is written. The receiver maps the sender's cache once per sender (cached),
queues the copies of each part as it arrives (so the blocks of finished prefill chunks move
while the next chunk computes): segments (runs contiguous in both caches), copied by the
copy engines, or, when they are many short runs (scattered blocks), by one kernel on our GPU
reading the mapping (:mod:`kvtransfer.backends.cuda_copy`; ``copy_lanes`` > 1 spreads
copy-engine copies over several streams instead), then waits for the copies' event, counts
the transfer DONE and acks; the sender's ``send`` returns.

The copy is one-sided: the receiver reads the sender's blocks, which the sender's caller
may reuse once ``send()`` returned. So a send that fails after its first part went out
(timeout, cancel, error) does not return at once: it tells the receiver and waits until the
receiver hung up or answered (:func:`~kvtransfer.control.until_receiver_stopped`), and a
receiver that hears of it (or loses the connection) waits for its queued copies before it
hangs up. Every copy a receiver completes therefore ran while the sender still held its
blocks, and DONE needs no confirmation round trip. No communicator exists, so there is
nothing to abort: a cancelled receive stops after the copies already queued (they only write
blocks the receiver still owns, since ``cancel`` returns only after them).

Checksums: the sender computes its parts' block checksums on a stream of its own GPU while
the receiver copies, and sends them after the last part; the receiver computes those of the
landed blocks on its copy stream before the one wait it does anyway, and compares them
before it counts the transfer DONE.

Requirements: both processes on one host and both GPUs visible to both processes (the
sender's device is matched by UUID, so CUDA_VISIBLE_DEVICES orderings may differ).

Its copies are the fastest of the GPU backends, but a part moves only once its prefill
chunk is computed (the sender waits for the chunk's event on the host), while nccl moves a
chunk layer by layer as it computes: list nccl first.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
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
    check_options,
    option,
)
from kvtransfer.backends.cuda_copy import KERNEL_BELOW_RUN_BYTES, copy_blocks, copy_runs
from kvtransfer.blocks import segments
from kvtransfer.control import (
    await_ack,
    control_receiver,
    control_sender,
    hold_lease,
    require_cuda,
)
from kvtransfer.lifecycle import ExpectedTransfer, TransferStateMachine
from kvtransfer.stream import BlockStream
from kvtransfer.waits import wait_event

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 5.0  # how often mappings of exited senders are dropped
_LOCAL_CACHES: dict[str, torch.Tensor] = {}  # sender id -> cache, for a same-process receiver


@dataclass(frozen=True)
class CudaIpcOptions:
    copy_lanes: int = option(1, "receiver: streams one transfer's copy-engine copies are "
                                "spread over", minimum=1, maximum=64)
    batch_copy: bool = option(True, "receiver: scattered runs go to the copy engines in one "
                                    "cuMemcpyBatchAsync call where the driver has it")
    driver_copy: bool = option(True, "receiver: one cuMemcpyDtoDAsync per run (off: "
                                     "Tensor.copy_, several times the host time per run)")
    kernel_copy_below_bytes: int = option(
        KERNEL_BELOW_RUN_BYTES, "receiver, without the batched call: runs averaging under "
                                "this many bytes are copied by one kernel on the decode GPU "
                                "(0: never)", minimum=0)

    def __post_init__(self) -> None:
        check_options(self)


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _b64(x) -> str:
    return base64.b64encode(x if isinstance(x, bytes) else bytes(x)).decode()


class CudaIpcPayloadSender:
    """Exports the cache once; per transfer sends the export, then each ready part's ids."""

    eager = True

    def __init__(self, cache: torch.Tensor, layout: KVLayout) -> None:
        self._cache = cache
        self._sums_stream = torch.cuda.Stream(cache.device)  # the source blocks' checksums
        self._id = uuid.uuid4().hex
        _LOCAL_CACHES[self._id] = cache
        storage = cache.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
        self._export = {
            "sender": self._id, "pid": os.getpid(), "device_uuid": _uuid(device),
            "handle": _b64(handle), "size": size, "offset": offset,
            "ref_handle": _b64(ref_handle), "ref_offset": ref_offset,
            "event_handle": _b64(event_handle) if event_handle else "",
            "event_sync": bool(event_sync),
            "storage_offset": cache.storage_offset() * cache.element_size(),
            "cache_bytes": cache.numel() * cache.element_size(),
        }

    async def send(self, loop, sock: socket.socket, endpoint: str, sm: TransferStateMachine,
                   blocks: BlockStream) -> None:
        # the export first: the receiver maps our cache while the prompt still computes
        await loop.sock_sendall(sock, wire.encode_blob(json.dumps(self._export).encode()))
        reading = False  # the receiver may be copying out of our blocks
        sums = checksum.SourceSums(self._cache, self._sums_stream)
        try:
            async for ids in blocks.ready_parts(watch=sock):  # each once its KV is written
                reading = True
                await loop.sock_sendall(sock, wire.encode_blob(
                    json.dumps({"src": ids}).encode()))
                sm.mark("part")
                if sm.checksums:  # computed while the receiver copies
                    sums.add(ids)
            if sm.checksums:
                await checksum.send_checksums(loop, sock, await sums.collect(watch=sock))
            done = await await_ack(loop, sock, sm)  # copies complete, transfer DONE over there
        except BaseException as exc:
            if reading:  # keep the blocks leased until the receiver stopped copying
                await hold_lease(loop, sock, sm, exc)
            raise
        sm.data_seconds = wire.parse_data_seconds(done)

    def close(self) -> None:
        _LOCAL_CACHES.pop(self._id, None)


class CudaIpcPayloadReceiver:
    """Maps each sender's cache once and copies each part out of it as it arrives."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout, options: CudaIpcOptions) -> None:
        self._cache = cache
        self._layout = layout
        self._options = options
        lanes = options.copy_lanes
        self._stream = torch.cuda.Stream(cache.device)  # orders the lanes; the timing events
        self._lanes = [self._stream] + [torch.cuda.Stream(cache.device)
                                        for _ in range(lanes - 1)]
        self._peers: dict[str, tuple[int, torch.Tensor]] = {}  # sender id -> (pid, cache)
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self._forget_dead_senders()

    def _peer_cache(self, meta: dict) -> torch.Tensor:
        key = meta["sender"]
        if key in self._peers:
            return self._peers[key][1]
        self._forget_dead_senders()
        if meta["pid"] == os.getpid() and key in _LOCAL_CACHES:
            peer = _LOCAL_CACHES[key]  # same process: CUDA cannot open its own IPC handle
        else:
            index = next((i for i in range(torch.cuda.device_count())
                          if _uuid(i) == meta["device_uuid"]), None)
            if index is None:
                raise TransferError(f"sender GPU {meta['device_uuid']} is not visible here "
                                    "(cuda_ipc needs both GPUs visible to both processes)")
            # Opened on OUR device (peer access enabled by the driver), not the sender's: the
            # copies then run in our GPU's context, our copy engine pulling over NVLink. A
            # context of ours on the sender's GPU would be time-sliced with the prefill
            # worker's context there, stalling its forward passes under load.
            index = self._cache.device.index
            storage = torch.UntypedStorage._new_shared_cuda(
                index, base64.b64decode(meta["handle"]), int(meta["size"]),
                int(meta["offset"]), base64.b64decode(meta["ref_handle"]),
                int(meta["ref_offset"]),
                base64.b64decode(meta["event_handle"]) if meta["event_handle"] else None,
                bool(meta["event_sync"]))
            if int(meta["cache_bytes"]) + int(meta["storage_offset"]) > storage.nbytes():
                raise TransferError("sender's exported cache is smaller than announced")
            flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
            flat.set_(storage, int(meta["storage_offset"]), (int(meta["cache_bytes"]),))
            peer = flat
        peer = peer.reshape(-1).view(torch.uint8).view(-1, self._layout.block_bytes)
        self._peers[key] = (int(meta["pid"]), peer)
        return peer

    def _forget_dead_senders(self) -> None:
        """Unmap the caches of sender processes that exited: a mapping keeps the dead
        process's whole KV cache allocated on its GPU (a restarted prefill worker would
        find its GPU full)."""
        for key, (pid, _) in list(self._peers.items()):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                del self._peers[key]
            except PermissionError:
                pass

    async def receive(self, loop, conn: socket.socket, entry: ExpectedTransfer) -> str:
        try:
            peer = self._peer_cache(json.loads(await wire.read_blob(loop, conn)))
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise TransferError(f"cuda_ipc: cannot map the sender's cache: {exc}") from None
        copies = await self._copy_parts(loop, conn, entry, peer)
        dst_ids = entry.dst_block_ids
        mine = None
        with torch.cuda.device(self._cache.device), torch.cuda.stream(self._stream):
            if entry.corrupt:  # fault injection: as if a copy had damaged the first block
                checksum.corrupt_first_byte(self._cache, dst_ids[0], entry.transfer_id)
            if entry.checksums:  # on the copies' stream, before the one wait below
                mine = torch.empty(len(dst_ids), dtype=torch.int64, pin_memory=True)
                mine.copy_(checksum.block_checksums(self._cache, dst_ids), non_blocking=True)
            # a default-flag event: its synchronize() spins in the driver (no GIL held) for
            # the few milliseconds the copies take, where the blocking timing event would
            # sleep and wake the waiting thread late
            copied = torch.cuda.Event()
            copied.record(self._stream)
        await wait_event(copied, watch=conn, what="CUDA IPC copy", mark=entry.mark)
        entry.mark("copied")
        if mine is not None:
            theirs = checksum.decode(await wire.read_blob(loop, conn), len(dst_ids))
            checksum.verify(theirs, mine.numpy(), dst_ids)
        entry.add_bytes(len(dst_ids) * self._layout.block_bytes)
        seconds = sum(a.elapsed_time(b) for a, b in copies) / 1000.0
        return wire.data_seconds_message("copied", seconds)

    async def _copy_parts(self, loop, conn: socket.socket, entry: ExpectedTransfer,
                          peer: torch.Tensor) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """Queue each part's copies as its BLOB arrives; events around each part's."""
        dst_ids, got = entry.dst_block_ids, 0
        dst = self._cache.reshape(-1).view(torch.uint8).view(-1, self._layout.block_bytes)
        copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        while got < len(dst_ids):  # one BLOB per part of the sender's stream
            try:
                src = [int(i) for i in json.loads(await wire.read_blob(loop, conn))["src"]]
                entry.mark("part")
                if not src or got + len(src) > len(dst_ids):
                    raise ValueError(f"sender sent {got + len(src)} of {len(dst_ids)} blocks")
                segs = segments(src, dst_ids[got:got + len(src)])
                entry.add_pieces(len(segs))
            except (ValueError, KeyError, TypeError) as exc:
                raise TransferError(f"cuda_ipc: bad part from the sender: {exc}") from None
            if any(s + n > peer.shape[0] for s, _, n in segs):
                raise TransferError("cuda_ipc: source block ids beyond the sender's cache")
            start, event = self._copy(dst, peer, segs)
            entry.mark("launched")
            if not copies:
                # however the transfer ends (timeout and cancel included), the queued copies
                # finish before its waiter hears of it and may free the blocks: on_end runs
                # before that (the lanes join the ordering stream, so its last event is enough)
                entry.on_end(lambda: copies[-1][1].synchronize())
            copies.append((start, event))
            got += len(src)
        return copies

    def _copy(self, dst: torch.Tensor, peer: torch.Tensor,
              segs: list[tuple[int, int, int]]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue one part's copies (one lane: :func:`~kvtransfer.backends.cuda_copy.copy_blocks`
        picks a kernel or the copy engines; more: copy engines spread over the lanes);
        events around all of them."""
        main = self._stream
        with torch.cuda.device(self._cache.device):
            start = torch.cuda.Event(enable_timing=True)
            start.record(main)
            shares = lane_shares(segs, len(self._lanes))
            if len(shares) == 1:
                opts = self._options
                copy_blocks(dst, peer, segs, main, opts.kernel_copy_below_bytes,
                            opts.batch_copy, opts.driver_copy)
                shares = []
            for lane, share in zip(self._lanes, shares):
                if lane is not main:
                    lane.wait_event(start)
                copy_runs(dst, peer, share, lane, self._options.driver_copy)
                if lane is not main:
                    joined = torch.cuda.Event()
                    joined.record(lane)
                    main.wait_event(joined)
            event = torch.cuda.Event(enable_timing=True, blocking=True)
            event.record(main)
        return start, event

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._peers.clear()


def lane_shares(segs: list[tuple[int, int, int]], lanes: int) -> list[list[tuple[int, int, int]]]:
    """Cut ``(src, dst, count)`` segments into at most ``lanes`` shares of (nearly) equal block
    counts, splitting a segment where a share ends; empty shares are left out.

    ``lane_shares([(0, 10, 4), (8, 20, 2)], 2)`` -> ``[[(0, 10, 3)], [(3, 13, 1), (8, 20, 2)]]``.
    """
    total = sum(n for _, _, n in segs)
    lanes = max(1, min(lanes, total))
    quota = [total // lanes + (1 if i < total % lanes else 0) for i in range(lanes)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(lanes)]
    k = 0
    for s, d, n in segs:
        while n:
            while quota[k] == 0:
                k += 1
            take = min(n, quota[k])
            out[k].append((s, d, take))
            quota[k] -= take
            s, d, n = s + take, d + take, n - take
    return [share for share in out if share]


def make_sender(cache: torch.Tensor, layout: KVLayout, options: CudaIpcOptions,
                shared: KVTransferOptions) -> KVSender:
    require_cuda(cache, "cuda_ipc")
    layout.validate(cache)
    return control_sender(cache, layout, "cuda_ipc", wire.KIND_CUDA_IPC,
                          CudaIpcPayloadSender(cache, layout), shared)


def make_receiver(cache: torch.Tensor, layout: KVLayout, options: CudaIpcOptions,
                  shared: KVTransferOptions, listen: ListenAddress | None) -> KVReceiver:
    require_cuda(cache, "cuda_ipc")
    layout.validate(cache)
    return control_receiver(cache, layout, "cuda_ipc", wire.KIND_CUDA_IPC,
                            CudaIpcPayloadReceiver(cache, layout, options), shared, listen)


BACKEND = BackendSpec(name="cuda_ipc", devices=("cuda",), listener=True,
                      options=CudaIpcOptions, sender=make_sender, receiver=make_receiver)
