"""kvtransfer conformance for streamed sends (kvtransfer.stream.BlockStream): a sender that
starts before its blocks are computed, as a prefill worker's does."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvtransfer import TransferState, make_sender
from kvtransfer.stream import BlockStream
from tests.unit.kvtransfer_helpers import BACKENDS, SMALL, cache, pair, run


class ManualEvent:
    """Stands in for a CUDA event: the blocks it guards are readable once it is set."""

    def __init__(self) -> None:
        self._set = threading.Event()

    def set(self) -> None:
        self._set.set()

    def query(self) -> bool:
        return self._set.is_set()

    def synchronize(self) -> None:
        self._set.wait()


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_send_moves_parts_as_they_are_ready(backend):
    """The sender starts before its blocks are computed (BlockStream): the handshake happens
    at once, each part moves once handed over and its event completed, and the transfer is
    DONE only after the last part; tail_seconds counts only the time after the last part."""
    async def main():
        src, dst = cache(SMALL, 32, seed=11), cache(SMALL, 32)
        rx, tx = await pair(backend, src, dst)
        src_ids = [7, 8, 9, 10, 11, 2, 3, 30, 31, 4]
        dst_ids = [0, 1, 2, 3, 20, 21, 22, 23, 5, 6]
        handle = rx.expect("st", dst_ids, timeout_s=10)
        stream = BlockStream(len(src_ids))
        task = asyncio.create_task(tx.send("st", rx.endpoint, stream, timeout_s=10))
        if backend != "fake":  # connection-based: the handshake does not wait for blocks
            for _ in range(200):
                if handle.state is TransferState.TRANSFERRING:
                    break
                await asyncio.sleep(0.01)
            assert handle.state is TransferState.TRANSFERRING
        first = ManualEvent()
        stream.extend(src_ids[:4], first)
        stream.extend(src_ids[4:6])
        await asyncio.sleep(0.1)
        assert not task.done()
        if backend in ("tcp", "shm"):  # streaming backends: nothing moves before its event
            assert not dst[dst_ids[:6]].any()
        first.set()
        await asyncio.sleep(0.2)
        if backend in ("tcp", "shm"):  # ... and the ready part moves before the rest exists
            assert torch.equal(dst[dst_ids[:6]], src[src_ids[:6]])
        assert not task.done()
        stream.extend(src_ids[6:])
        res = await task
        got = await handle.wait()
        assert res.state is TransferState.DONE, res.error
        assert got.state is TransferState.DONE, got.error
        assert torch.equal(dst[dst_ids], src[src_ids])
        assert res.num_bytes == got.num_bytes == len(src_ids) * SMALL.block_bytes
        assert res.tail_seconds is not None and res.tail_seconds < res.seconds - 0.25
        with pytest.raises(ValueError, match="extended"):
            stream.extend([1])
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_stream_fails_both_sides(backend):
    """A prefill that is preempted or aborted mid-stream fails the transfer on both sides,
    with the reason, instead of leaving the receiver waiting for its timeout."""
    async def main():
        src, dst = cache(SMALL, 16, seed=12), cache(SMALL, 16)
        rx, tx = await pair(backend, src, dst)
        handle = rx.expect("sf", list(range(8)), timeout_s=30)
        stream = BlockStream(8)
        task = asyncio.create_task(tx.send("sf", rx.endpoint, stream, timeout_s=30))
        stream.extend([0, 1, 2])
        await asyncio.sleep(0.1)
        stream.fail("prefill preempted")
        res = await asyncio.wait_for(task, 2)
        assert res.state is TransferState.FAILED and "preempted" in res.error
        got = await asyncio.wait_for(handle.wait(), 2)
        assert got.state in (TransferState.FAILED, TransferState.CANCELLED)
        assert rx.stats().active_transfers == 0
        await tx.close()
        await rx.close()

    run(main())


def test_block_stream_checks_ids():
    with pytest.raises(ValueError):
        BlockStream(0)
    stream = BlockStream(3)
    stream.extend([5, 6])
    with pytest.raises(ValueError, match="out of range"):
        stream.limit(6)
    stream = BlockStream(2)
    stream.limit(4)
    with pytest.raises(ValueError, match="out of range"):
        stream.extend([4])
    with pytest.raises(ValueError, match="extended"):
        stream.extend([0, 1, 2])


def test_sender_rejects_out_of_range_stream_ids():
    async def main():
        tx = make_sender("tcp", cache(SMALL, 4), SMALL)
        stream = BlockStream(2)
        stream.extend([9])
        with pytest.raises(ValueError, match="out of range"):
            await tx.send("bad", "tcp://127.0.0.1:1", stream, 1)
        await tx.close()

    run(main())
