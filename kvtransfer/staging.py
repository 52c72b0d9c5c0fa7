"""How the socket backends (tcp, shm) reach a cache's bytes, on a CPU or on a GPU.

A CPU cache's blocks are read and written in place (:class:`DirectBlocks`: views of the
cache's memory, one per run of consecutive blocks). A GPU cache's travel through pinned host
memory (:class:`StagedBlocks`), so GPU hosts without NVLink or RDMA between them still
disaggregate over tcp (or shm on one host):

    sender:   D2H copy of chunk k+1 into buffer (k+1) % 2  ||  socket write of chunk k
    receiver: socket read of chunk k+1 into buffer (k+1) % 2  ||  H2D copy of chunk k

Copies are queued on a stream of the staging's own and awaited like any device work
(:func:`kvtransfer.waits.wait_event`: a helper thread, the event loop never blocks); chunks
are whole blocks, at most ``chunk_bytes`` each. The same code stages a CPU cache when asked
(copies are then synchronous ``copy_``\\s), which is how the CPU tests exercise it.

Both hand the caller memoryviews in transfer order: ``outgoing(ids)`` yields each chunk's
bytes to send, ``incoming(ids)`` yields each region to fill with the next bytes received
(for a staged cache, the chunk is copied into the blocks once the caller asks for the next
region, and the last one before the iteration ends). An iteration that stops early (the
transfer failed or was cancelled) waits for the copies it queued when it is closed, so no
copy touches the blocks afterwards; ``synchronize()`` waits for every copy queued.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import torch

from kvtransfer.blocks import Run, block_runs, byte_view
from kvtransfer.waits import wait_event

logger = logging.getLogger(__name__)


def chunks(ids: list[int], per_chunk: int) -> list[list[int]]:
    """``ids`` cut into consecutive pieces of at most ``per_chunk`` ids."""
    return [ids[i:i + per_chunk] for i in range(0, len(ids), per_chunk)]


class DirectBlocks:
    """A contiguous CPU cache, read and written in place."""

    staged = False

    def __init__(self, cache: torch.Tensor) -> None:
        self._view = byte_view(cache)
        self._block_bytes = cache[0].numel() * cache.element_size()

    def _region(self, run: Run) -> memoryview:
        bb = self._block_bytes
        return self._view[run.start * bb:(run.start + run.count) * bb]

    async def outgoing(self, ids: list[int]) -> AsyncIterator[memoryview]:
        for run in block_runs(ids):
            yield self._region(run)

    async def incoming(self, ids: list[int]) -> AsyncIterator[memoryview]:
        for run in block_runs(ids):
            yield self._region(run)

    def synchronize(self) -> None:
        pass


class StagedBlocks:
    """A cache (any device) whose blocks travel through host buffers of ``chunk_bytes``
    (pinned for a GPU cache; two per transfer, kept for the next one), copied on a stream of
    their own."""

    staged = True
    MAX_IDLE_PAIRS = 2  # buffer pairs kept between transfers (pinned memory: keep few)

    def __init__(self, cache: torch.Tensor, chunk_bytes: int) -> None:
        self._cache = cache
        self._block_bytes = cache[0].numel() * cache.element_size()
        self.chunk_blocks = max(1, chunk_bytes // self._block_bytes)
        self._idle: list[list[torch.Tensor]] = []
        self._stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None

    @property
    def stream(self):
        """The staging stream (None for a CPU cache): copies into the cache are on it, so
        work queued there afterwards sees them."""
        return self._stream

    @contextlib.contextmanager
    def _pair(self):
        """Two buffers for one transfer; back to the pool once nothing copies from them."""
        pair = self._idle.pop() if self._idle else [
            torch.empty((self.chunk_blocks, self._block_bytes), dtype=torch.uint8,
                        pin_memory=self._cache.is_cuda) for _ in range(2)]
        try:
            yield pair
        finally:
            self.synchronize()  # no copy still reads or writes the buffers or the blocks
            if len(self._idle) < self.MAX_IDLE_PAIRS:
                self._idle.append(pair)

    def _copy(self, buf: torch.Tensor, ids: list[int], into_cache: bool):
        return queue_copy(self._cache, ids, buf, into_cache, self._stream)

    async def outgoing(self, ids: list[int]) -> AsyncIterator[memoryview]:
        """Each chunk's bytes, the next chunk's copy out of the cache queued before this
        one is handed over (the blocks must be readable: their writers' events done)."""
        parts = chunks(ids, self.chunk_blocks)
        with self._pair() as bufs:
            events = [self._copy(bufs[0], parts[0], into_cache=False)]
            for k, part in enumerate(parts):
                if k + 1 < len(parts):  # its buffer held chunk k - 1, already sent
                    events.append(self._copy(bufs[(k + 1) % 2], parts[k + 1],
                                             into_cache=False))
                await wait_event(events[k], what="the copy to host memory")
                yield memoryview(bufs[k % 2][:len(part)].numpy()).cast("B")

    async def incoming(self, ids: list[int]) -> AsyncIterator[memoryview]:
        """Each region to fill, in order; a filled chunk's copy into the cache is queued
        when the next region is asked for (and the iteration ends once all landed)."""
        with self._pair() as bufs:
            pending = [None, None]  # the copy out of each buffer, still running
            for k, part in enumerate(chunks(ids, self.chunk_blocks)):
                slot = k % 2
                if pending[slot] is not None:  # the buffer is refilled once emptied
                    await wait_event(pending[slot], what="the copy from host memory")
                yield memoryview(bufs[slot][:len(part)].numpy()).cast("B")
                pending[slot] = self._copy(bufs[slot], part, into_cache=True)
            for event in pending:
                await wait_event(event, what="the copy from host memory")

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


def queue_copy(cache: torch.Tensor, ids: list[int], rows: torch.Tensor, into_cache: bool,
               stream=None):
    """Queue the copies between blocks ``ids`` of ``cache`` and host memory ``rows``
    (``[>= len(ids), block_bytes]`` uint8; row ``i`` is block ``ids[i]``), one per run of
    consecutive ids, on ``stream``; returns their event, or None for a CPU cache (the copies
    are done then). Asynchronous only when ``rows`` is pinned (or registered) memory."""
    blocks = cache.reshape(-1).view(torch.uint8).view(cache.shape[0], -1)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for run in block_runs(ids):
            cache_part = blocks[run.start:run.start + run.count]
            host_part = rows[run.pos:run.pos + run.count]
            if into_cache:
                cache_part.copy_(host_part, non_blocking=True)
            else:
                host_part.copy_(cache_part, non_blocking=True)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
    return event


def register_host(t: torch.Tensor) -> bool:
    """Page-lock memory that torch did not allocate (a shared-memory ring), so copies with a
    GPU are asynchronous; False (copies then stay synchronous) where CUDA refuses."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        logger.warning("cudaHostRegister refused %d bytes (CUDA error %d): copies through "
                       "them block", t.numel() * t.element_size(), int(rc))
        return False
    return True


def unregister_host(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def block_io(cache: torch.Tensor, chunk_bytes: int,
             staged: bool | None = None) -> DirectBlocks | StagedBlocks:
    """In place for a CPU cache, staged through pinned memory for a GPU one (``staged``:
    force either; staging a CPU cache is how the CPU tests run the GPU path)."""
    if not cache.is_contiguous():
        raise ValueError("the socket backends need a contiguous cache tensor")
    if staged if staged is not None else cache.device.type != "cpu":
        return StagedBlocks(cache, chunk_bytes)
    return DirectBlocks(cache)
