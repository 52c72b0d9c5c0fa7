"""The nccl backend's communicators and GPU buffers: one non-blocking NCCL communicator per
sender/receiver pair with its two streams, the per-pair locks, and the staging buffers layer
groups travel through. Nothing here talks to the peer except through NCCL itself."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading

import torch

from kvtransfer.api import KVLayout, TransferError
from kvtransfer.backends import nccl_lib
from kvtransfer.waits import poll_in_thread

logger = logging.getLogger(__name__)


class Comm:
    """One pair's communicator, its stream and its device."""

    def __init__(self, device: torch.device, uid: bytes, rank: int, library: str) -> None:
        self.lib = load_lib(library)
        self.device = device
        self.ready = False
        self.aborted = False
        # state polls run in a helper thread (poll_in_thread): the guard keeps every NCCL
        # call on this communicator from overlapping or following its abort
        self._guard = threading.Lock()
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            # gathers into / scatters out of the staging buffers of layer-group messages,
            # overlapping the neighbouring groups' messages on ``stream``
            self.copy_stream = torch.cuda.Stream(device)
            self.handle = checked(self.lib.init_rank, uid, 2, rank)

    @contextlib.contextmanager
    def current(self):
        """This communicator's device and stream as the current ones (torch work queued
        inside runs in order with its sends and receives)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def state(self) -> int:
        with self._guard:
            if self.aborted:
                raise TransferError("NCCL communicator was aborted")
            return checked(self.lib.state, self.handle)

    def check(self) -> None:
        """After our work completed: it only counts if the communicator was not aborted
        meanwhile (an abort also 'completes' queued kernels, without the data)."""
        if self.aborted:
            raise TransferError("NCCL communicator was aborted (another transfer on this "
                                "pair failed or the worker is closing)")
        self.state()

    async def wait_idle(self, watch: socket.socket | None, what: str) -> None:
        # enqueueing a group takes a few hundred microseconds: poll at most 50 us apart
        await poll_in_thread(lambda: self.state() != nccl_lib.IN_PROGRESS,
                             max_interval_s=0.00005, watch=watch, what=what)

    def post(self, ops: list[tuple[str, int, int]], peer: int) -> None:
        """Start queueing ``ops`` as one group. On a pair's first transfer the group stays
        in progress until the PEER posts its matching group (connection setup), so the
        other side must be told to go ahead before :meth:`queued` is awaited."""
        with self._guard, torch.cuda.device(self.device):
            if self.aborted:
                raise TransferError("NCCL communicator was aborted")
            checked(self.lib.group, self.handle, ops, peer, self.stream.cuda_stream)

    async def queued(self, watch: socket.socket | None) -> torch.cuda.Event:
        """Wait until the posted group is on the stream; returns an event completing with it."""
        await self.wait_idle(watch, "NCCL enqueue")
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(self.stream)
        return event

    def drain(self) -> None:
        """Wait for everything queued on the pair's streams (after an abort: the aborted
        messages and the gathers / scatters around them)."""
        self.stream.synchronize()
        self.copy_stream.synchronize()

    def abort(self) -> None:
        with self._guard:
            if self.aborted:
                return
            self.aborted = True
            try:
                self.lib.abort(self.handle)
            except Exception:  # noqa: BLE001
                logger.exception("ncclCommAbort failed")


class Pairs:
    """A side's communicators by peer (sender id / receiver endpoint) and the per-peer locks
    that keep one transfer at a time between posting and queueing."""

    def __init__(self) -> None:
        self.comms: dict[str, Comm] = {}
        self.locks: dict[str, asyncio.Lock] = {}

    def lock(self, peer: str) -> asyncio.Lock:
        return self.locks.setdefault(peer, asyncio.Lock())

    def drop(self, peer: str, comm: Comm) -> None:
        """Abort ``comm`` and forget it, unless a newer one for the peer replaced it."""
        comm.abort()
        if self.comms.get(peer) is comm:
            del self.comms[peer]

    def close(self) -> None:
        for peer, comm in list(self.comms.items()):
            self.drop(peer, comm)


def load_lib(library: str):
    try:
        return nccl_lib.lib(library)
    except (OSError, RuntimeError) as exc:
        raise TransferError(f"NCCL unavailable: {exc}") from None


def checked(fn, *args):
    """Call into NCCL; its errors fail the transfer (TransferError), they never escape."""
    try:
        return fn(*args)
    except nccl_lib.NcclError as exc:
        raise TransferError(str(exc)) from None


def per_layer(layout: KVLayout) -> int:
    """Elements of one layer of one block."""
    return layout.block_bytes // layout.num_layers // layout.torch_dtype.itemsize


def staging_buffers(layout: KVLayout, num_blocks: int, groups: list[tuple[int, int]],
                     comm: Comm) -> list[torch.Tensor]:
    """Two flat buffers (one for a single group), each with room for the largest layer
    group of ``num_blocks`` blocks, allocated on the pair's stream and marked as used by
    its copy stream too (the allocator reuses them only after both passed this transfer's
    work)."""
    size = num_blocks * max(hi - lo for lo, hi in groups) * per_layer(layout)
    with comm.current():
        bufs = [torch.empty(size, dtype=layout.torch_dtype, device=comm.device)
                for _ in range(min(2, len(groups)))]
    for buf in bufs:
        buf.record_stream(comm.copy_stream)
    return bufs


def try_staging(layout: KVLayout, num_blocks: int, groups: list[tuple[int, int]],
                 comm: Comm) -> list[torch.Tensor] | None:
    """:func:`_staging_buffers`, or None when the GPU has no memory for them (a packed part
    then moves as whole messages; layer groups fail the transfer)."""
    try:
        return staging_buffers(layout, num_blocks, groups, comm)
    except torch.cuda.OutOfMemoryError:
        logger.warning("no GPU memory for %d staging buffers of %d layer groups (%d blocks)",
                       min(2, len(groups)), len(groups), num_blocks)
        return None
