"""BlockStream: a transfer's source blocks, handed to the sender as they become readable.

A prefill worker starts ``send()`` as soon as its request arrives, with a stream of the
prompt's block count; the control handshake (connect, HELLO, communicator / mapping set-up)
then overlaps the prompt's forward pass. After each prefill chunk the worker ``extend``s the
stream with the blocks that chunk completed (and, on a GPU, an event that completes once
their KV is written); backends that stream (tcp, shm, nccl, cuda_ipc) move each part while
the next chunk computes, so only the last part is left when the prompt is done::

    stream = BlockStream(len(dst_ids))
    task = create_task(sender.send(tid, endpoint, stream, timeout))   # handshake now
    stream.extend(first_chunk_ids, event)                              # moves during chunk 2
    stream.extend(rest_ids)                                            # after the last chunk
    result = await task                                                # DONE once all landed

``fail(reason)`` ends the transfer as FAILED (the prefill was preempted or aborted). A plain
list of ids is a stream that is complete from the start.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvtransfer.api import TransferError
from kvtransfer.waits import wait_event


@dataclass(frozen=True)
class Part:
    """Blocks handed over together: readable once ``event`` completes; with ``layers``,
    layer ``i`` of every block is readable once ``layers[i]`` completes."""

    ids: list[int]
    event: Any = None
    layers: list[Any] | None = None


class BlockStream:
    def __init__(self, total: int) -> None:
        if not isinstance(total, int) or total <= 0:
            raise ValueError(f"a transfer needs at least one block, got total={total!r}")
        self.total = total
        self._handed = 0  # ids given by the producer
        self._parts: deque[Part] = deque()
        self._error: str | None = None
        self._changed = asyncio.Event()
        self.completed_at: float | None = None  # time.monotonic() when the last id was handed
        self._num_blocks: int | None = None  # the sender's cache size, once bound

    def limit(self, num_blocks: int) -> None:
        """Block ids must be in ``[0, num_blocks)`` (the sender's cache): checked for the ids
        handed over so far (ValueError) and for every later ``extend``."""
        self._num_blocks = num_blocks
        for part in self._parts:
            self._check(part.ids)

    def _check(self, ids: list[int]) -> None:
        if self._num_blocks is not None:
            bad = [i for i in ids if not 0 <= i < self._num_blocks]
            if bad:
                raise ValueError(f"block ids out of range [0, {self._num_blocks}): {bad[:8]}")

    @classmethod
    def of(cls, ids: list[int]) -> BlockStream:
        stream = cls(len(ids))
        stream.extend(ids)
        return stream

    # ---------------------------------------------------------------- producer
    def extend(self, ids: list[int], event: Any = None, layers: list[Any] | None = None) -> None:
        """The next ``ids`` (in transfer order) are readable once ``event`` (an object with
        ``query()``, e.g. a CUDA event; None: now) completes. ``layers``: optionally one
        event per model layer, the ``i``-th completing once layer ``i`` of these blocks is
        written (earlier than ``event``): a sender may move the blocks layer by layer."""
        if self._error is not None:
            raise ValueError(f"stream already failed: {self._error}")
        if not ids:
            return
        if self._handed + len(ids) > self.total:
            raise ValueError(f"stream of {self.total} blocks extended to "
                             f"{self._handed + len(ids)}")
        ids = [int(i) for i in ids]
        self._check(ids)
        self._parts.append(Part(ids, event, list(layers) if layers else None))
        self._handed += len(ids)
        if self._handed == self.total:
            self.completed_at = time.monotonic()
        self._changed.set()

    def fail(self, reason: str) -> None:
        """End the stream: the sender fails the transfer with ``reason``."""
        if self._error is None:
            self._error = reason
            self._changed.set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def complete(self) -> bool:
        return self._handed == self.total

    def ready(self) -> bool:
        """Every block handed over and readable now (each untaken part's event complete)."""
        return self.complete and self._error is None and \
            all(p.event is None or p.event.query() for p in self._parts)

    # ---------------------------------------------------------------- consumer
    async def next_layered(self) -> Part | None:
        """Every id handed over since the last call, merged into one part with the last
        one's event and layer events (events of one stream complete in order: a later
        part's layer ``i`` completes after every earlier part); None once the whole stream
        was taken."""
        while True:
            if self._error is not None:
                raise TransferError(self._error)
            if self._parts:
                merged = self._parts.popleft()
                while self._parts:
                    part = self._parts.popleft()
                    merged = Part(merged.ids + part.ids,
                                  part.event if part.event is not None else merged.event,
                                  part.layers)
                return merged
            if self.complete:
                return None
            self._changed.clear()
            await self._changed.wait()

    async def next_part(self) -> tuple[list[int], Any] | None:
        """Like :meth:`next_layered`, as ``(ids, event)``."""
        part = await self.next_layered()
        return None if part is None else (part.ids, part.event)

    async def parts(self):
        """``async for ids, event in stream.parts()``: each part as it becomes available."""
        while (part := await self.next_part()) is not None:
            yield part

    async def layered_parts(self):
        """``async for part in stream.layered_parts()``: each :class:`Part` as it comes."""
        while (part := await self.next_layered()) is not None:
            yield part

    async def ready_parts(self, watch=None):
        """Like :meth:`parts`, but each part only once its event completed (host-side wait;
        ``watch``: a control socket whose peer giving up ends the wait)."""
        async for ids, event in self.parts():
            await wait_event(event, watch=watch, what="the prefill's forward pass")
            yield ids

    async def all(self, watch=None) -> list[int]:
        """Wait for the whole stream (and its events); its ids in order."""
        out: list[int] = []
        async for ids in self.ready_parts(watch):
            out.extend(ids)
        return out
