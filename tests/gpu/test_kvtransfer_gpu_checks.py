"""GPU kvtransfer, the checks: block checksums computed on the GPU match the CPU definition and
catch corrupted data (naming the block), checksum settings, and the socket backends (tcp, shm)
moving GPU caches through pinned memory, in one process and two.

    python3 -m pytest -q -m gpu tests/gpu/test_kvtransfer_gpu_checks.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.gpu.kvtransfer_gpu_helpers import (BACKENDS, DST, LAYOUT, SRC, _spawn, cache,
                                              run)  # first: sets the NCCL env
from kvtransfer import TransferState, make_receiver, make_sender
from kvtransfer.stream import BlockStream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs"),
]


def test_block_checksums_on_the_gpu_match_the_cpu_definition():
    """kvtransfer.checksum on a GPU: the per-run torch path and the one-kernel path for many
    scattered blocks give exactly the CPU's (integer sums wrap the same way)."""
    from kvtransfer import checksum

    src = cache(96, SRC, seed=41)
    for ids in ([5, 6, 7, 8], [90, 3, 41, 17, 60, 2, 77, 11, 50, 8, 31, 64, 1]):  # 1 / 13 runs
        got = checksum.block_checksums(src, ids).cpu()
        want = checksum.block_checksums(src.cpu(), ids)
        assert torch.equal(got, want), ids


@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_data_fails_the_transfer_naming_the_block(backend, layered):
    """Fault injection flips a byte of every second transfer's data (nccl: the sender, in
    its first segment's message or its first staging buffer; cuda_ipc / nixl: the receiver,
    as the copy lands);
    the receiver's checksums, computed on the GPU, fail exactly those transfers, naming the
    block; the others land exactly, streamed layer by layer or not."""
    from kvtransfer.api import KVTransferOptions

    faulty = KVTransferOptions(corrupt_every=2)
    pull = backend in ("cuda_ipc", "nixl")

    async def main():
        src, dst = cache(64, SRC), cache(64, DST)
        rx = make_receiver(backend, dst, LAYOUT, shared=faulty if pull else None)
        await rx.start()
        # nccl: one message per layer (staging buffers), or one per segment (packing off)
        opts = {"layers_per_message": 1} if layered else {"pack_message_bytes": 0}
        tx = make_sender(backend, src, LAYOUT, shared=None if pull else faulty,
                         **(opts if backend == "nccl" else {}))
        for i in range(4):
            s_ids, d_ids = [5, 6, 7, 30 + i, 2], [60, 0, 1, 11 + i, 40]
            want = cache(len(s_ids), SRC, seed=50 + i)
            torch.cuda.synchronize(SRC)
            handle = rx.expect(f"cs{i}", d_ids, 30)
            blocks = BlockStream(len(s_ids))
            task = asyncio.create_task(tx.send(f"cs{i}", rx.endpoint, blocks, 30))
            compute = torch.cuda.Stream(SRC)
            with torch.cuda.device(SRC), torch.cuda.stream(compute):
                layers = []
                for layer in range(LAYOUT.num_layers):
                    torch.cuda._sleep(5_000_000)
                    src[s_ids, layer] = want[:, layer]
                    layers.append(torch.cuda.Event())
                    layers[-1].record(compute)
                final = torch.cuda.Event()
                final.record(compute)
            blocks.extend(s_ids, final, layers if layered else None)
            res, got = await task, await handle.wait()
            if i % 2 == 0:
                assert res.state is got.state is TransferState.DONE, (res.error, got.error)
                assert torch.equal(dst[d_ids].cpu(), want.cpu())
            else:
                assert res.state is got.state is TransferState.FAILED, (res, got)
                assert "checksum mismatch: block 0 of 5 (destination block 60)" in got.error
                assert "checksum mismatch" in res.error, res.error
            dst.zero_()
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksums_off_and_a_mismatched_setting(backend):
    from kvtransfer.api import KVTransferOptions

    off = KVTransferOptions(checksums=False)

    async def main():
        src, dst = cache(16, SRC, seed=42), cache(16, DST)
        for rx_opts, tx_opts, ok in ((off, off, True), (None, off, False)):
            rx = make_receiver(backend, dst, LAYOUT, shared=rx_opts)
            await rx.start()
            tx = make_sender(backend, src, LAYOUT, shared=tx_opts)
            handle = rx.expect("off", [4, 5], 30)
            res, got = await tx.send("off", rx.endpoint, [1, 2], 30), await handle.wait()
            if ok:
                assert res.ok and got.ok and torch.equal(dst[[4, 5]].cpu(), src[[1, 2]].cpu())
            else:
                assert res.state is got.state is TransferState.FAILED
                assert "checksum setting mismatch" in got.error
            await tx.close()
            await rx.close()

    run(main())


@pytest.mark.parametrize("dst_dev", [DST, SRC], ids=["two-gpus", "one-gpu"])
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_socket_backends_move_gpu_caches_through_pinned_memory(backend, dst_dev):
    """tcp and shm with GPU caches (kvtransfer.staging: pinned host buffers for tcp, the
    page-locked shm ring): scattered blocks land exactly, transfer after transfer; a stream
    whose parts are still being computed (events pending) moves each part only once its
    event completed; a damaged transfer fails naming the block; a receiver that cancels
    mid-transfer gets no write afterwards."""
    from kvtransfer.api import KVTransferOptions

    small_chunks = {"staging_bytes": 3 * LAYOUT.block_bytes} if backend == "tcp" else \
        {"chunk_bytes": 3 * LAYOUT.block_bytes, "num_slots": 2}

    async def main():
        src, dst = cache(64, SRC, seed=61), cache(64, dst_dev)
        rx = make_receiver(backend, dst, LAYOUT, **({"staging_bytes": 3 * LAYOUT.block_bytes}
                                                    if backend == "tcp" else {}))
        await rx.start()
        tx = make_sender(backend, src, LAYOUT, **small_chunks)
        for rep in range(2):
            s_ids, d_ids = [3, 4, 5, 6, 20, 0, 1, 63, 9, 10], [60, 0, 1, 2, 17, 18, 5, 7, 8, 30]
            handle = rx.expect(f"rt{rep}", d_ids, 30)
            res = await tx.send(f"rt{rep}", rx.endpoint, s_ids, 30)
            assert res.ok and (await handle.wait()).ok, res.error
            assert torch.equal(dst[d_ids].cpu(), src[s_ids].cpu())
            dst.zero_()
        s_ids, d_ids = list(range(30, 46)), list(range(10, 26))
        want = cache(len(s_ids), SRC, seed=62)
        torch.cuda.synchronize(SRC)
        handle = rx.expect("st", d_ids, 30)
        blocks = BlockStream(len(s_ids))
        task = asyncio.create_task(tx.send("st", rx.endpoint, blocks, 30))
        compute = torch.cuda.Stream(SRC)
        with torch.cuda.device(SRC), torch.cuda.stream(compute):
            for part in (slice(0, 8), slice(8, None)):
                torch.cuda._sleep(50_000_000)  # the "forward pass" writing this part
                src[s_ids[part]] = want[part]
                event = torch.cuda.Event()
                event.record(compute)
                blocks.extend(s_ids[part], event)
        assert (await task).ok and (await handle.wait()).ok
        assert torch.equal(dst[d_ids].cpu(), want.cpu()), "stale blocks landed"
        await tx.close()
        tx = make_sender(backend, src, LAYOUT, shared=KVTransferOptions(corrupt_every=1),
                         **small_chunks)
        handle = rx.expect("bad", [40, 41, 42], 30)
        res, got = await tx.send("bad", rx.endpoint, [1, 2, 3], 30), await handle.wait()
        assert res.state is got.state is TransferState.FAILED
        assert "checksum mismatch: block 0 of 3 (destination block 40)" in got.error
        await tx.close()
        tx = make_sender(backend, src, LAYOUT, **small_chunks)
        handle = rx.expect("mid", list(range(64)), 30)
        task = asyncio.create_task(tx.send("mid", rx.endpoint, list(range(64)), 30))
        while handle.state is TransferState.PENDING:
            await asyncio.sleep(0)
        assert rx.cancel("mid")
        snapshot = dst.clone()
        assert (await asyncio.wait_for(task, 5)).state is TransferState.FAILED
        await asyncio.sleep(0.1)
        assert torch.equal(dst, snapshot), "written after the cancel"
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_socket_backends_two_processes_gpu_to_gpu(backend):
    """The deployment shape without NVLink or RDMA between the workers: the sender in
    another process on cuda:0, the receiver here on cuda:1, over tcp / shm."""
    async def main():
        dst = cache(80, DST)
        rx = make_receiver(backend, dst, LAYOUT)
        await rx.start()
        ids = list(range(79, 15, -1))
        h = rx.expect("p", ids, 60)
        proc = _spawn(backend, "send", rx.endpoint, "0", "p")
        res = await h.wait()
        out = await asyncio.get_running_loop().run_in_executor(None, proc.communicate)
        assert res.state is TransferState.DONE, (res, out[0][-2000:])
        want = (torch.arange(64, device=DST) % 200).to(torch.bfloat16)
        assert (dst[ids].reshape(64, -1) == want[:, None]).all()
        await rx.close()

    run(main())
