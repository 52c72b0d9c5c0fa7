"""kvtransfer conformance suite: every backend runs every test (real sockets and processes).
Timeouts, cancellation, shutdown and killed peers: test_kvtransfer_faults.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer import (
    IllegalTransition,
    KVLayout,
    TransferState,
    make_receiver,
    make_sender,
)
from kvtransfer.lifecycle import TransferStateMachine
from kvtransfer.blocks import block_runs

from tests.unit.kvtransfer_helpers import (
    BACKENDS,
    SENDER_OPTS,
    SMALL,
    cache,
    pair,
    run,
)


# ---------------------------------------------------------------- layout and state machine


def test_layout_block_bytes_and_from_cache():
    assert SMALL.block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    t = torch.zeros(5, 3, 2, 16, 2, 64, dtype=torch.bfloat16)
    layout = KVLayout.from_cache(t, block_size=16)
    assert layout == KVLayout(3, 2, 64, 16, "bfloat16")
    assert layout.block_bytes == 3 * 2 * 16 * 2 * 64 * 2
    layout.validate(t)
    with pytest.raises(ValueError, match="block_size"):
        KVLayout.from_cache(t, block_size=8)
    with pytest.raises(ValueError, match="does not match"):
        SMALL.validate(t)
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, 1, "float32")
    with pytest.raises(ValueError):
        KVLayout(1, 1, 1, 1, "float13")


def test_state_machine_transitions():
    sm = TransferStateMachine("t", "test")
    sm.advance(TransferState.TRANSFERRING)
    sm.advance(TransferState.DONE)
    with pytest.raises(IllegalTransition):
        sm.advance(TransferState.FAILED)
    sm = TransferStateMachine("t", "test")
    with pytest.raises(IllegalTransition):
        sm.advance(TransferState.DONE)  # DONE only after TRANSFERRING
    for end in (TransferState.FAILED, TransferState.TIMED_OUT, TransferState.CANCELLED):
        sm = TransferStateMachine("t", "test")
        sm.advance(end)
        assert sm.state.terminal
        with pytest.raises(IllegalTransition):
            sm.advance(TransferState.TRANSFERRING)


def test_block_runs():
    runs = [(r.pos, r.start, r.count) for r in block_runs([4, 5, 6, 9, 2, 3])]
    assert runs == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown kvtransfer backend"):
        make_sender("carrier-pigeon", cache(SMALL, 2), SMALL)


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip(backend, loop):
    async def main():
        src, dst = cache(SMALL, 32, seed=1), cache(SMALL, 40)
        rx, tx = await pair(backend, src, dst)
        src_ids = [3, 4, 5, 6, 20, 0, 1, 31, 9, 10]
        dst_ids = [39, 0, 1, 2, 17, 18, 5, 7, 8, 30]
        handle = rx.expect("rt", dst_ids, timeout_s=5)
        assert handle.state is TransferState.PENDING
        res = await tx.send("rt", rx.endpoint, src_ids, timeout_s=5)
        got = await handle.wait()
        assert res.state is TransferState.DONE, res.error
        assert got.state is TransferState.DONE, got.error
        assert res.num_bytes == got.num_bytes == len(src_ids) * SMALL.block_bytes
        assert torch.equal(dst[dst_ids], src[src_ids])
        # pieces contiguous in both caches: (4..6 -> 0..2) and seven single blocks; counted
        # by the backends that move pieces (GPU ones, nixl here)
        assert got.pieces == (8 if backend == "nixl" else None)
        untouched = [b for b in range(40) if b not in dst_ids]
        assert not dst[untouched].any()
        stats = rx.stats()
        assert (stats.active_transfers, stats.bytes_received, stats.done) == (0, res.num_bytes, 1)
        await tx.close()
        await rx.close()

    run(main(), loop)


@pytest.mark.parametrize("backend", BACKENDS)
def test_destination_given_after_the_sender_connected(backend):
    """Expected by count, the ids assigned once the sender is already waiting (the decode
    worker reserves its blocks while the prefill runs): nothing lands before the ids, then
    exactly there."""
    async def main():
        src, dst = cache(SMALL, 16, seed=21), cache(SMALL, 16)
        rx, tx = await pair(backend, src, dst)
        handle = rx.expect("late-ids", 4, timeout_s=5)
        task = asyncio.create_task(tx.send("late-ids", rx.endpoint, [1, 2, 3, 9], 5))
        while handle.state is TransferState.PENDING:  # claimed: the sender is connected
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        assert not task.done() and not dst.any()
        handle.assign([15, 4, 5, 6])
        res, got = await task, await handle.wait()
        assert res.state is got.state is TransferState.DONE, (res.error, got.error)
        assert torch.equal(dst[[15, 4, 5, 6]], src[[1, 2, 3, 9]])
        assert not dst[[b for b in range(16) if b not in (15, 4, 5, 6)]].any()
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_destination_never_given_times_out_and_cancel_ends_it(backend):
    async def main():
        src, dst = cache(SMALL, 8, seed=22), cache(SMALL, 8)
        rx, tx = await pair(backend, src, dst)
        handle = rx.expect("no-ids", 2, timeout_s=0.3)
        res = await tx.send("no-ids", rx.endpoint, [0, 1], 5)
        assert (await handle.wait()).state is TransferState.TIMED_OUT
        assert res.state is TransferState.FAILED
        handle = rx.expect("cancelled", 2, timeout_s=5)
        task = asyncio.create_task(tx.send("cancelled", rx.endpoint, [0, 1], 5))
        while handle.state is TransferState.PENDING:
            await asyncio.sleep(0.001)
        assert rx.cancel("cancelled")
        res = await asyncio.wait_for(task, 3)
        assert res.state is TransferState.FAILED
        assert not dst.any() and rx.stats().active_transfers == 0
        await tx.close()
        await rx.close()

    run(main())


def test_destination_ids_are_checked_against_the_count():
    async def main():
        rx = make_receiver("tcp", cache(SMALL, 8), SMALL)
        await rx.start()
        handle = rx.expect("n", 2, timeout_s=5)
        for bad in ([0], [0, 1, 2], [3, 3], [0, 8]):
            with pytest.raises(ValueError):
                handle.assign(bad)
        handle.assign([6, 7])
        with pytest.raises(ValueError, match="already"):
            handle.assign([0, 1])
        with pytest.raises(ValueError, match="does not fit"):
            rx.expect("huge", 9, timeout_s=5)
        with pytest.raises(ValueError):
            rx.expect("none", 0, timeout_s=5)
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_transfers(backend):
    async def main():
        src, dst = cache(SMALL, 64, seed=2), cache(SMALL, 64)
        rx, tx = await pair(backend, src, dst)
        jobs = [(f"c{i}", list(range(i * 8, i * 8 + 7)), list(range(63 - i * 8, 56 - i * 8, -1)))
                for i in range(8)]
        handles = [rx.expect(tid, dst_ids, 10) for tid, _, dst_ids in jobs]
        results = await asyncio.gather(
            *(tx.send(tid, rx.endpoint, src_ids, 10) for tid, src_ids, _ in jobs))
        assert [r.state for r in results] == [TransferState.DONE] * 8
        for handle, (_, src_ids, dst_ids) in zip(handles, jobs):
            assert (await handle.wait()).state is TransferState.DONE
            assert torch.equal(dst[dst_ids], src[src_ids])
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_fails_both_sides(backend):
    other = KVLayout(2, 2, 16, 4, "float32")

    async def main():
        rx, tx = await pair(backend, cache(other, 8, seed=3), cache(SMALL, 8), src_layout=other)
        handle = rx.expect("lm", [0, 1], 5)
        res = await tx.send("lm", rx.endpoint, [0, 1], 5)
        got = await handle.wait()
        assert res.state is got.state is TransferState.FAILED
        assert "layout mismatch" in res.error and "layout mismatch" in got.error
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_count_mismatch_fails_both_sides(backend):
    async def main():
        src, dst = cache(SMALL, 8, seed=4), cache(SMALL, 8)
        rx, tx = await pair(backend, src, dst)
        handle = rx.expect("cm", [0, 1, 2], 5)
        res = await tx.send("cm", rx.endpoint, [0, 1], 5)
        got = await handle.wait()
        assert res.state is got.state is TransferState.FAILED
        assert "block count mismatch" in res.error and "block count mismatch" in got.error
        assert not dst.any()
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_and_expired_transfer_ids_are_rejected(backend):
    async def main():
        src, dst = cache(SMALL, 8, seed=5), cache(SMALL, 8)
        rx, tx = await pair(backend, src, dst)
        res = await tx.send("nobody-expects-me", rx.endpoint, [0], 5)
        assert res.state is TransferState.FAILED and "unknown" in res.error
        handle = rx.expect("expired", [1], timeout_s=0.05)
        assert (await handle.wait()).state is TransferState.TIMED_OUT
        res = await tx.send("expired", rx.endpoint, [0], 5)
        assert res.state is TransferState.FAILED and "unknown or expired" in res.error
        assert not dst.any()
        await tx.close()
        await rx.close()

    run(main())


# the side that moves the data damages it when fault injection says so (the receiver for the
# one-sided backends, which read the sender's memory)
PULL_BACKENDS = ("nixl", "cuda_ipc")


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_data_fails_the_transfer_naming_the_block(backend):
    """Fault injection flips one byte of every second transfer's data on its way; the
    receiver's per-block checksums catch it: FAILED on both sides, the error names the
    block, and the clean transfers around it land exactly (streamed parts included)."""
    from kvtransfer.api import KVTransferOptions
    from kvtransfer.stream import BlockStream

    faulty = KVTransferOptions(corrupt_every=2)

    async def main():
        src, dst = cache(SMALL, 32, seed=31), cache(SMALL, 32)
        rx = make_receiver(backend, dst, SMALL,
                           shared=faulty if backend in PULL_BACKENDS else None)
        await rx.start()
        tx = make_sender(backend, src, SMALL, shared=None if backend in PULL_BACKENDS
                         else faulty, **SENDER_OPTS.get(backend, {}))
        for i in range(4):
            src_ids, dst_ids = [7, 8, 9, 20 + i, 2], [30, 0, 1, 11 + i, 25]
            handle = rx.expect(f"cs{i}", dst_ids, timeout_s=5)
            stream = BlockStream(len(src_ids))  # two parts: the first one is damaged
            task = asyncio.create_task(tx.send(f"cs{i}", rx.endpoint, stream, timeout_s=5))
            stream.extend(src_ids[:3])
            await asyncio.sleep(0.01)
            stream.extend(src_ids[3:])
            res, got = await task, await handle.wait()
            if i % 2 == 0:
                assert res.state is got.state is TransferState.DONE, (res.error, got.error)
                assert torch.equal(dst[dst_ids], src[src_ids])
            else:
                assert res.state is got.state is TransferState.FAILED, (res, got)
                want = "checksum mismatch: block 0 of 5 (destination block 30)"
                assert want in got.error and want in res.error, (res.error, got.error)
            dst.zero_()
        stats = rx.stats()
        assert (stats.done, stats.failed, stats.active_transfers) == (2, 2, 0)
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksums_off_on_both_sides_and_a_mismatched_setting(backend):
    """Checksums can be turned off (both sides agree: the transfer lands); a sender and a
    receiver that disagree fail the transfer on both sides, saying why."""
    from kvtransfer.api import KVTransferOptions

    off = KVTransferOptions(checksums=False)

    async def main():
        src, dst = cache(SMALL, 8, seed=32), cache(SMALL, 8)
        for rx_opts, tx_opts, ok in ((off, off, True), (None, off, False), (off, None, False)):
            rx = make_receiver(backend, dst, SMALL, shared=rx_opts)
            await rx.start()
            tx = make_sender(backend, src, SMALL, shared=tx_opts, **SENDER_OPTS.get(backend, {}))
            handle = rx.expect("off", [4, 5], timeout_s=5)
            res, got = await tx.send("off", rx.endpoint, [1, 2], timeout_s=5), await handle.wait()
            if ok:
                assert res.ok and got.ok and torch.equal(dst[[4, 5]], src[[1, 2]])
            else:
                assert res.state is got.state is TransferState.FAILED
                assert "checksum setting mismatch" in res.error, res.error
                assert "checksum setting mismatch" in got.error, got.error
            await tx.close()
            await rx.close()

    run(main())
