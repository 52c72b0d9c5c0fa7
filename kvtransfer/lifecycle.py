"""The lifecycle every transfer shares, whatever backend moves its bytes.

* :class:`TransferStateMachine`: one transfer's state, every change checked and logged.
* Receiver side: :class:`ReceiverTracker` holds the expected transfers
  (:class:`ExpectedTransfer`, each ending exactly once, at the latest at its deadline).
* Sender side: :class:`SendRunner` runs a backend's send body with a timeout, cancellation
  and one final state change (the lease on the source blocks ends when ``send()`` returns).
* :class:`Sender` / :class:`Receiver`: the one implementation of the interface, composed of
  the above and a backend's *channel* (what connects, listens and moves bytes):

      Sender(cache, layout, channel, options)
          channel.send(sm, endpoint, blocks) -> payload bytes; channel.close()
      Receiver(tracker, channel)
          channel.start() / channel.endpoint / channel.close()
          (the channel claims transfers from ``tracker``)

The options (:class:`~kvtransfer.api.KVTransferOptions`) reach each transfer here: a
transfer's state machine says whether its block checksums travel (``checksums``) and
whether fault injection damages it (``corrupt``); the backend honours both.

Backends only move bytes; timeouts, cancellation, state changes and statistics live here,
so every backend ends its transfers the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from kvtransfer.api import (
    ALLOWED_TRANSITIONS,
    IllegalTransition,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferOptions,
    ReceiverStats,
    TransferError,
    TransferHandle,
    TransferResult,
    TransferState,
)
from kvtransfer.stream import BlockStream
from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

class TransferStateMachine:
    """The state of one transfer; every change is checked and logged with the transfer id.

    With ``timeline`` (:attr:`KVTransferOptions.timeline`) the phases a backend marks are
    kept and logged when the transfer ends."""

    def __init__(self, transfer_id: str, side: str, timeline: bool = False) -> None:
        self.transfer_id = transfer_id
        self.side = side
        self.state = TransferState.PENDING
        self.num_bytes = 0  # payload bytes moved so far
        self.data_seconds: float | None = None  # the data movement alone, where measured
        self._timeline = timeline
        self.checksums = True  # send checksums with the data (KVTransferOptions.checksums)
        self.corrupt = False  # fault injection: damage this transfer's data on its way
        self._t0 = time.perf_counter() if timeline else 0.0
        self._marks: list[tuple[str, float]] = []
        self.accepted: asyncio.Event | None = None  # set on TRANSFERRING (sender side)
        logger.debug("%s transfer %s: pending", side, transfer_id)

    def mark(self, what: str) -> None:
        """Note that phase ``what`` was reached now (kept only with a timeline)."""
        if self._timeline:
            self._marks.append((what, time.perf_counter()))

    def advance(self, new: TransferState, reason: str | None = None) -> None:
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"transfer {self.transfer_id}: {self.state.value} -> {new.value} not allowed"
            )
        logger.debug(
            "%s transfer %s: %s -> %s%s", self.side, self.transfer_id, self.state.value,
            new.value, f" ({reason})" if reason else "",
        )
        self.state = new
        if new is TransferState.TRANSFERRING and self.accepted is not None:
            self.accepted.set()
        if self._timeline and new.terminal:
            logger.info("kv timeline %s %s %s: %s", self.side, self.transfer_id, new.value,
                        " ".join(f"{w}={1000 * (t - self._t0):.3f}" for w, t in self._marks))


class FaultInjector:
    """``KVTransferOptions.corrupt_every``: says yes for every ``every``-th transfer."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._count = 0

    def next(self) -> bool:
        if self.every <= 0:
            return False
        self._count += 1
        return self._count % self.every == 0


def check_block_ids(ids: list[int], num_blocks: int, *, unique: bool) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("a transfer needs at least one block id")
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"block ids out of range [0, {num_blocks}): {bad[:8]}")
    if unique and len(set(ids)) != len(ids):
        raise ValueError("destination block ids must be distinct")
    return ids


class ExpectedTransfer(TransferHandle):
    """One transfer the receiver waits for. Ends exactly once, at the latest at its deadline.

    The destination block ids may come later than the expectation (``assign``): the decode
    worker then asks for the prefill while it is still reserving the blocks, and a backend
    that starts receiving first awaits ``destination()`` (the handshake goes on meanwhile).
    """

    def __init__(self, tracker: ReceiverTracker, transfer_id: str,
                 dst_block_ids: list[int] | None, num_blocks: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.transfer_id = transfer_id
        self.dst_block_ids = dst_block_ids
        self.num_blocks = num_blocks
        self._assigned = asyncio.Event()
        if dst_block_ids is not None:
            self._assigned.set()
        self.num_bytes = 0
        self.num_pieces = 0  # contiguous-in-both-caches pieces (backends that count them)
        self.checksums = tracker.options.checksums  # verify the sender's block checksums
        self.corrupt = False  # fault injection (pull backends): damage the data that lands
        self._tracker = tracker
        self._sm = TransferStateMachine(transfer_id, "recv", tracker.options.timeline)
        self._t0 = time.monotonic()
        self._future: asyncio.Future[TransferResult] = loop.create_future()
        self._timer = loop.call_later(timeout_s, self._on_timeout, timeout_s)
        self._owner: asyncio.Task | None = None
        self._cleanups: list[Callable[[], None]] = []

    @property
    def state(self) -> TransferState:
        return self._sm.state

    async def wait(self) -> TransferResult:
        return await asyncio.shield(self._future)

    def assign(self, dst_block_ids: list[int]) -> None:
        """Give the destination block ids of a transfer expected by count."""
        if self.dst_block_ids is not None:
            raise ValueError(f"transfer {self.transfer_id} already has its destination blocks")
        ids = check_block_ids(dst_block_ids, self._tracker.num_blocks, unique=True)
        if len(ids) != self.num_blocks:
            raise ValueError(f"transfer {self.transfer_id} expects {self.num_blocks} blocks, "
                             f"got {len(ids)} destination ids")
        self.dst_block_ids = ids
        self._assigned.set()

    async def destination(self) -> list[int]:
        """The destination block ids, once assigned (backends await this before they write;
        a transfer that ends meanwhile cancels its owner, which ends this wait)."""
        await self._assigned.wait()
        return self.dst_block_ids

    def start(self, owner: asyncio.Task | None) -> None:
        """The data began to arrive; ``owner`` is cancelled if the transfer ends elsewhere."""
        self._sm.advance(TransferState.TRANSFERRING)
        self._owner = owner

    def on_end(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` when the transfer ends (or now, if it already has)."""
        if self.state.terminal:
            cleanup()
        else:
            self._cleanups.append(cleanup)

    def mark(self, what: str) -> None:
        self._sm.mark(what)

    def add_pieces(self, n: int) -> None:
        self.num_pieces += n

    def add_bytes(self, n: int) -> None:
        self.num_bytes += n
        self._tracker.bytes_received += n

    def finish(self, state: TransferState, error: str | None = None) -> bool:
        """End the transfer; False (and nothing happens) if it had already ended."""
        if self.state.terminal:
            return False
        self._sm.advance(state, error)
        self._timer.cancel()
        self._tracker._ended(self)
        owner, self._owner = self._owner, None
        if owner is not None and owner is not asyncio.current_task():
            owner.cancel()  # stop the backend before it writes another byte into our blocks
        for cleanup in self._cleanups:
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - a cleanup must not block the others
                logger.exception("transfer %s: cleanup failed", self.transfer_id)
        self._cleanups.clear()
        self._future.set_result(TransferResult(
            self.transfer_id, state, self.num_bytes, time.monotonic() - self._t0, error,
            pieces=self.num_pieces or None))
        return True

    def _on_timeout(self, timeout_s: float) -> None:
        self.finish(TransferState.TIMED_OUT,
                    f"no complete transfer within {timeout_s}s (was {self.state.value})")


class ReceiverTracker:
    """The receiver's table of expected transfers, keyed by transfer id."""

    def __init__(self, num_blocks: int, block_bytes: int,
                 options: KVTransferOptions | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.options = options or KVTransferOptions()
        self._faults = FaultInjector(self.options.corrupt_every)
        self.bytes_received = 0
        self._active: dict[str, ExpectedTransfer] = {}
        self._done = 0
        self._failed = 0

    def expect(self, transfer_id: str, dst_block_ids: list[int] | int,
               timeout_s: float) -> ExpectedTransfer:
        if not transfer_id or len(transfer_id.encode()) > 1024:
            raise ValueError("transfer_id must be a non-empty string of at most 1024 bytes")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if transfer_id in self._active:
            raise ValueError(f"transfer {transfer_id} is already expected")
        if isinstance(dst_block_ids, int) and not isinstance(dst_block_ids, bool):
            if not 0 < dst_block_ids <= self.num_blocks:
                raise ValueError(f"a transfer of {dst_block_ids} blocks does not fit a cache of "
                                 f"{self.num_blocks}")
            ids, count = None, dst_block_ids
        else:
            ids = check_block_ids(dst_block_ids, self.num_blocks, unique=True)
            count = len(ids)
        entry = ExpectedTransfer(self, transfer_id, ids, count, timeout_s)
        self._active[transfer_id] = entry
        return entry

    def claim(self, transfer_id: str, num_blocks: int, layout_error: str | None = None,
              owner: asyncio.Task | None = None) -> ExpectedTransfer:
        """Match incoming data to its expected transfer; raise TransferError to reject it.

        A mismatch (layout, block count) also fails the expected transfer, so both sides
        see FAILED with the same message.
        """
        entry = self._active.get(transfer_id)
        if entry is None:
            raise TransferError(f"unknown or expired transfer id {transfer_id!r}")
        if entry.state is not TransferState.PENDING:
            raise TransferError(f"transfer {transfer_id!r} is already {entry.state.value}")
        error = layout_error
        if error is None and num_blocks != entry.num_blocks:
            error = (f"block count mismatch: sender has {num_blocks} blocks, "
                     f"receiver expects {entry.num_blocks}")
        if error is not None:
            entry.finish(TransferState.FAILED, error)
            raise TransferError(error)
        entry.corrupt = self._faults.next()
        entry.start(owner)
        return entry

    def cancel(self, transfer_id: str) -> bool:
        entry = self._active.get(transfer_id)
        return entry is not None and entry.finish(TransferState.CANCELLED, "cancelled by receiver")

    def close(self) -> None:
        for entry in list(self._active.values()):
            entry.finish(TransferState.CANCELLED, "receiver closed")

    def stats(self) -> ReceiverStats:
        return ReceiverStats(len(self._active), self.bytes_received, self._done, self._failed)

    def _ended(self, entry: ExpectedTransfer) -> None:
        self._active.pop(entry.transfer_id, None)
        if entry.state is TransferState.DONE:
            self._done += 1
        else:
            self._failed += 1


SendBody = Callable[[TransferStateMachine], Awaitable[int]]


class SendRunner:
    """Runs a backend's send body with a timeout, cancellation and one final state change.

    The body returns the payload byte count once the receiver acked, and raises
    TransferError / OSError / EOFError for failures; it must advance the state machine to
    TRANSFERRING once the receiver accepted the transfer.
    """

    def __init__(self, options: KVTransferOptions | None = None) -> None:
        self.options = options or KVTransferOptions()
        self._faults = FaultInjector(self.options.corrupt_every)
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancel_requested: set[str] = set()

    async def run(self, transfer_id: str, timeout_s: float, body: SendBody,
                  accepted: asyncio.Event | None = None) -> TransferResult:
        if transfer_id in self._tasks:
            raise ValueError(f"transfer {transfer_id} is already being sent")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        sm = TransferStateMachine(transfer_id, "send", self.options.timeline)
        sm.accepted = accepted
        sm.checksums = self.options.checksums
        sm.corrupt = self._faults.next()
        t0 = time.monotonic()
        task = asyncio.create_task(self._guarded(sm, timeout_s, body))
        self._tasks[transfer_id] = task
        try:
            state, error = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if transfer_id not in self._cancel_requested or (current and current.cancelling()):
                raise  # our caller was cancelled: propagate
            state, error = TransferState.CANCELLED, "cancelled by sender"
        finally:
            self._tasks.pop(transfer_id, None)
            self._cancel_requested.discard(transfer_id)
        sm.advance(state, error)
        return TransferResult(transfer_id, state, sm.num_bytes, time.monotonic() - t0, error,
                              sm.data_seconds)

    def cancel(self, transfer_id: str) -> bool:
        task = self._tasks.get(transfer_id)
        if task is None or task.done():
            return False
        self._cancel_requested.add(transfer_id)
        task.cancel()
        return True

    async def close(self) -> None:
        tasks = list(self._tasks.items())
        for transfer_id, _ in tasks:
            self.cancel(transfer_id)
        await cancel_and_wait([t for _, t in tasks])

    @staticmethod
    async def _guarded(sm: TransferStateMachine, timeout_s: float,
                       body: SendBody) -> tuple[TransferState, str | None]:
        try:
            async with asyncio.timeout(timeout_s) as cm:
                sm.num_bytes = await body(sm)
            return TransferState.DONE, None
        except TransferError as exc:
            return TransferState.FAILED, str(exc)
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            if cm.expired():
                return TransferState.TIMED_OUT, f"not acknowledged within {timeout_s}s"
            return TransferState.FAILED, f"{type(exc).__name__}: {exc}"
        except (OSError, EOFError) as exc:
            return TransferState.FAILED, f"{type(exc).__name__}: {exc}"


class SendChannel(Protocol):
    """What a backend gives :class:`Sender`: it moves one transfer's blocks."""

    async def send(self, sm: TransferStateMachine, endpoint: str, blocks: BlockStream) -> int:
        """Move the blocks as the stream hands them over; return the payload byte count
        once the receiver has them all. Advance ``sm`` to TRANSFERRING once the receiver
        accepted the transfer; raise TransferError / OSError / EOFError to fail it."""

    async def close(self) -> None:
        """Release what the channel holds (connections, rings, communicators)."""


class ReceiveChannel(Protocol):
    """What a backend gives :class:`Receiver`: it listens and writes incoming blocks,
    claiming each transfer from the receiver's :class:`ReceiverTracker`."""

    async def start(self) -> None: ...

    @property
    def endpoint(self) -> str: ...

    async def close(self) -> None:
        """Stop listening and release resources (the tracker already ended every transfer)."""


class Sender(KVSender):
    """The sender: source-block checks, a :class:`SendRunner` and a backend's channel."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout, channel: SendChannel,
                 options: KVTransferOptions | None = None) -> None:
        layout.validate(cache)
        self.cache = cache
        self.layout = layout
        self.channel = channel
        self._runner = SendRunner(options)

    async def send(self, transfer_id: str, endpoint: str, src_block_ids,
                   timeout_s: float, accepted: asyncio.Event | None = None) -> TransferResult:
        if isinstance(src_block_ids, BlockStream):
            blocks = src_block_ids
            blocks.limit(self.cache.shape[0])  # ValueError for ids outside this cache
        else:
            blocks = BlockStream.of(check_block_ids(src_block_ids, self.cache.shape[0],
                                                    unique=False))

        async def body(sm: TransferStateMachine) -> int:
            return await self.channel.send(sm, endpoint, blocks)

        result = await self._runner.run(transfer_id, timeout_s, body, accepted)
        tail = None
        if blocks.completed_at is not None:
            tail = max(0.0, min(result.seconds, time.monotonic() - blocks.completed_at))
        return dataclasses.replace(result, tail_seconds=tail)

    def cancel(self, transfer_id: str) -> bool:
        return self._runner.cancel(transfer_id)

    async def close(self) -> None:
        await self._runner.close()
        await self.channel.close()


class Receiver(KVReceiver):
    """The receiver: expected transfers in a :class:`ReceiverTracker`, bytes moved by a
    backend's channel that claims them from it."""

    def __init__(self, tracker: ReceiverTracker, channel: ReceiveChannel) -> None:
        self.tracker = tracker
        self.channel = channel

    async def start(self) -> None:
        await self.channel.start()

    @property
    def endpoint(self) -> str:
        return self.channel.endpoint

    def expect(self, transfer_id: str, dst_block_ids: list[int] | int,
               timeout_s: float) -> ExpectedTransfer:
        return self.tracker.expect(transfer_id, dst_block_ids, timeout_s)

    def cancel(self, transfer_id: str) -> bool:
        return self.tracker.cancel(transfer_id)

    def stats(self) -> ReceiverStats:
        return self.tracker.stats()

    async def close(self) -> None:
        self.tracker.close()
        await self.channel.close()
