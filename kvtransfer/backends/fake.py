"""In-process backend for engine and worker unit tests: no sockets, same semantics.

Receivers register under ``fake://<n>`` in a process-wide dict; a sender looks the endpoint
up, the receiver checks the transfer exactly like a real backend (unknown id, layout, block
count, checksum setting) and copies the blocks tensor-to-tensor (any device), then verifies
their checksums. ``stall=True`` makes a receiver
that accepts transfers but never acknowledges them (to test sender timeouts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
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
from kvtransfer.blocks import block_runs, scatter
from kvtransfer.lifecycle import (
    ExpectedTransfer,
    Receiver,
    ReceiverTracker,
    Sender,
    TransferStateMachine,
)
from kvtransfer.stream import BlockStream
from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FakeOptions:
    stall: bool = option(False, "tests: the receiver accepts transfers but never "
                                "acknowledges them (sender timeouts)")

    def __post_init__(self) -> None:
        check_options(self)


_ENDPOINTS: dict[str, FakeServer] = {}
_NEXT = itertools.count()


class FakeServer:
    """A receiver's channel: registered under ``fake://<n>`` while started."""

    def __init__(self, tracker: ReceiverTracker, cache: torch.Tensor, layout: KVLayout,
                 stall: bool = False) -> None:
        self._tracker = tracker
        self._cache = cache
        self._layout = layout
        self._stall = stall
        self._endpoint: str | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._endpoint = f"fake://{next(_NEXT)}"
        _ENDPOINTS[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("receiver not started")
        return self._endpoint

    async def close(self) -> None:
        if self._endpoint is not None:
            _ENDPOINTS.pop(self._endpoint, None)
        await cancel_and_wait(list(self._tasks))

    async def deliver(self, transfer_id: str, layout: KVLayout, total: int, checksums: bool,
                      source: Callable[[], Awaitable[tuple[torch.Tensor, np.ndarray | None]]]
                      ) -> None:
        """Runs as its own task; raises TransferError when the transfer is rejected/failed.
        Claims the transfer at once (the "handshake"), then awaits the sender's blocks (and
        their checksums, with ``checksums``)."""
        error = None if layout == self._layout else (
            f"layout mismatch: sender {layout} != receiver {self._layout}")
        if error is None:
            error = wire.checksum_setting_error(checksums, self._tracker.options.checksums)
        entry: ExpectedTransfer = self._tracker.claim(
            transfer_id, total, error, owner=asyncio.current_task())
        try:
            try:
                blocks, sums = await source()
            except TransferError as exc:
                entry.finish(TransferState.FAILED, f"sender failed: {exc}")
                raise
            if self._stall:
                await asyncio.Event().wait()  # never acks; ends by timeout or cancel
            await asyncio.sleep(0)  # a transfer takes at least one loop turn, like a real one
            dst = await entry.destination()
            scatter(self._cache, dst, blocks.to(self._cache.device))
            entry.add_bytes(blocks.numel() * blocks.element_size())
            if entry.checksums:
                try:
                    checksum.verify(sums, await checksum.host_checksums(self._cache, dst), dst)
                except TransferError as exc:
                    entry.finish(TransferState.FAILED, str(exc))
                    raise
            entry.finish(TransferState.DONE)
        except asyncio.CancelledError:
            if not entry.state.terminal:  # the sender went away
                entry.finish(TransferState.FAILED, "sender cancelled the transfer")
            raise

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class FakeClient:
    """A sender's channel: hands a copy of the blocks to the receiver registered there."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout) -> None:
        self._cache = cache
        self._layout = layout

    async def send(self, sm: TransferStateMachine, endpoint: str, stream: BlockStream) -> int:
        receiver = _ENDPOINTS.get(endpoint)
        if receiver is None:
            raise TransferError(f"no fake receiver at {endpoint!r}")

        async def source() -> tuple[torch.Tensor, np.ndarray | None]:
            sm.advance(TransferState.TRANSFERRING)  # the receiver claimed the transfer
            ids = await stream.all()
            blocks = torch.cat([self._cache[r.start:r.start + r.count] for r in block_runs(ids)])
            sums = await checksum.host_checksums(self._cache, ids) if sm.checksums else None
            if sm.corrupt:  # the copy is what travels
                checksum.corrupt_first_byte(blocks, 0, sm.transfer_id)
            return blocks, sums

        task = receiver.spawn(receiver.deliver(sm.transfer_id, self._layout, stream.total,
                                               sm.checksums, source))
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current and current.cancelling()):
                raise TransferError("receiver aborted the transfer") from None
            task.cancel()  # we were cancelled: the receiver must not wait for our blocks
            raise
        return stream.total * self._layout.block_bytes

    async def close(self) -> None:
        pass


def make_sender(cache: torch.Tensor, layout: KVLayout, options: FakeOptions,
                shared: KVTransferOptions) -> KVSender:
    return Sender(cache, layout, FakeClient(cache, layout), shared)


def make_receiver(cache: torch.Tensor, layout: KVLayout, options: FakeOptions,
                  shared: KVTransferOptions, listen: None) -> KVReceiver:
    layout.validate(cache)
    tracker = ReceiverTracker(cache.shape[0], layout.block_bytes, shared)
    return Receiver(tracker, FakeServer(tracker, cache, layout, options.stall))


BACKEND = BackendSpec(name="fake", devices=("cpu", "cuda"), listener=False,
                      options=FakeOptions, sender=make_sender, receiver=make_receiver)
