"""tcp and shm through host staging (kvtransfer.staging), the path a GPU cache takes: here on
CPU tensors, where the copies are synchronous but every chunk boundary, buffer reuse and
early end is the same. The GPU run: tests/gpu/test_kvtransfer_gpu.py (tcp/shm staging)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from kvtransfer import KVTransferOptions, TransferState
from kvtransfer.backends import shm, tcp
from kvtransfer.staging import DirectBlocks, StagedBlocks, block_io
from kvtransfer.stream import BlockStream

from tests.unit.kvtransfer_helpers import BIG, SMALL, cache, run


def _staged_pair(backend: str, src, dst, layout=SMALL, shared=None, chunk_blocks: int = 3):
    """A receiver and a sender that stage through host buffers of ``chunk_blocks`` blocks."""
    shared = shared or KVTransferOptions()
    if backend == "tcp":
        options = tcp.TcpOptions(staging_bytes=chunk_blocks * layout.block_bytes)
        return (tcp.make_receiver(dst, layout, options, shared, None, staged=True),
                tcp.make_sender(src, layout, options, shared, staged=True))
    options = shm.ShmOptions(chunk_bytes=chunk_blocks * layout.block_bytes, num_slots=2)
    return (shm.make_receiver(dst, layout, options, shared, None, staged=True),
            shm.make_sender(src, layout, options, shared, staged=True))


def test_block_io_stages_only_what_it_cannot_reach_in_place():
    assert isinstance(block_io(cache(SMALL, 4), 1 << 20), DirectBlocks)
    assert isinstance(block_io(cache(SMALL, 4), 1 << 20, staged=True), StagedBlocks)
    with pytest.raises(ValueError, match="contiguous"):
        block_io(cache(SMALL, 4).transpose(0, 1), 1 << 20)


def test_staged_chunks_carry_each_blocks_bytes_in_transfer_order_and_buffers_are_reused():
    async def main():
        src, dst = cache(SMALL, 16, seed=1), cache(SMALL, 16)
        out_io, in_io = StagedBlocks(src, 3 * SMALL.block_bytes), \
            StagedBlocks(dst, 3 * SMALL.block_bytes)
        s_ids, d_ids = [9, 10, 11, 12, 2, 0, 5], [0, 1, 2, 3, 4, 15, 8]
        sent = []
        async with contextlib.aclosing(out_io.outgoing(s_ids)) as pieces:
            async for piece in pieces:
                sent.append(bytes(piece))
        assert [len(p) // SMALL.block_bytes for p in sent] == [3, 3, 1]
        assert b"".join(sent) == src[s_ids].reshape(-1).view(torch.uint8).numpy().tobytes()
        data = b"".join(sent)
        async with contextlib.aclosing(in_io.incoming(d_ids)) as regions:
            async for region in regions:
                region[:] = data[:len(region)]
                data = data[len(region):]
        assert torch.equal(dst[d_ids], src[s_ids])
        assert not dst[[b for b in range(16) if b not in d_ids]].any()
        idle = out_io._idle[0]
        async with contextlib.aclosing(out_io.outgoing([1])) as pieces:  # the same buffers
            async for _ in pieces:
                assert out_io._idle == []
        assert out_io._idle == [idle]

    run(main())


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_staged_round_trip_streamed_and_concurrent(backend):
    async def main():
        src, dst = cache(SMALL, 64, seed=2), cache(SMALL, 64)
        rx, tx = _staged_pair(backend, src, dst)
        await rx.start()
        jobs = [(f"c{i}", [i * 8 + k for k in (0, 1, 2, 5, 6, 3, 7)],
                 [63 - i * 8 - k for k in range(7)]) for i in range(4)]
        handles = [rx.expect(tid, d, 10) for tid, _, d in jobs]
        streams = [BlockStream(len(s)) for _, s, _ in jobs]
        tasks = [asyncio.create_task(tx.send(tid, rx.endpoint, st, 10))
                 for (tid, _, _), st in zip(jobs, streams)]
        for (_, s, _), st in zip(jobs, streams):  # two parts each, the second one later
            st.extend(s[:4])
        await asyncio.sleep(0.05)
        for (_, s, _), st in zip(jobs, streams):
            st.extend(s[4:])
        results = await asyncio.gather(*tasks)
        assert [r.state for r in results] == [TransferState.DONE] * 4, [r.error for r in results]
        for handle, (_, s, d) in zip(handles, jobs):
            assert (await handle.wait()).ok
            assert torch.equal(dst[d], src[s])
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_staged_corruption_is_caught_and_cancel_stops_the_copies(backend):
    async def main():
        src, dst = cache(BIG, 64, seed=3), cache(BIG, 64)
        rx, tx = _staged_pair(backend, src, dst, BIG, KVTransferOptions(corrupt_every=1),
                              chunk_blocks=4)
        await rx.start()
        handle = rx.expect("bad", [5, 6, 7, 40], 10)
        res, got = await tx.send("bad", rx.endpoint, [1, 2, 3, 9], 10), await handle.wait()
        assert res.state is got.state is TransferState.FAILED
        assert "checksum mismatch: block 0 of 4 (destination block 5)" in got.error, got.error
        await tx.close()
        tx = _staged_pair(backend, src, dst, BIG, chunk_blocks=4)[1]
        handle = rx.expect("mid", list(range(64)), 10)
        task = asyncio.create_task(tx.send("mid", rx.endpoint, list(range(64)), 10))
        while handle.state is TransferState.PENDING:
            await asyncio.sleep(0)
        assert rx.cancel("mid")
        snapshot = dst.clone()
        assert (await asyncio.wait_for(task, 3)).state is TransferState.FAILED
        await asyncio.sleep(0.05)
        assert torch.equal(dst, snapshot)  # nothing written after the cancel
        await tx.close()
        await rx.close()

    run(main())
