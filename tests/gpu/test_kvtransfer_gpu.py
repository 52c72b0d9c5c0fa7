"""kvtransfer conformance for the GPU backends (nccl, cuda_ipc, nixl), on two GPUs.

Same contract as tests/unit/test_kvtransfer.py: data lands exactly in the expected blocks,
concurrent transfers, mismatches fail both sides, timeouts / cancels / close end transfers,
nothing leaks; plus two-process runs (CUDA IPC only works between processes) and a sender
process killed after the receiver posted its receives (a dead peer must not hang the
receiver, and the pair must work again afterwards).

Block checksums and the socket backends with GPU caches: test_kvtransfer_gpu_checks.py.

    python3 -m pytest -q -m gpu tests/gpu/test_kvtransfer_gpu.py tests/gpu/test_kvtransfer_gpu_checks.py
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.gpu.kvtransfer_gpu_helpers import (BACKENDS, DST, LAYOUT, SRC, _spawn, cache,
                                              pair, run)  # first: sets the NCCL env
from kvtransfer import KVLayout, TransferState, make_receiver, make_sender
from kvtransfer.stream import BlockStream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs"),
]


def test_driver_and_kernel_copies_match_torch_copies_across_gpus_and_within_one():
    """cuda_ipc queues its block runs through cuMemcpyDtoDAsync, or one Triton kernel for
    many short runs (kvtransfer.backends.cuda_copy): both land exactly what ``copy_`` would, peer to
    peer and on one GPU, on a side stream ordered after earlier work on it; copy_blocks
    picks the kernel for short runs on one device and the copy engines otherwise."""
    from kvtransfer.backends import cuda_copy

    assert cuda_copy._driver_memcpy(), "libcuda's cuMemcpyDtoDAsync_v2 did not load"
    cuda_copy.enable_peer_access(1, 0)  # kernels on cuda:1 read cuda:0 (as an IPC mapping)
    runs = [(3, 60, 1), (10, 0, 5), (40, 20, 12), (63, 63, 1)]
    for src_dev in (SRC, DST):
        src = cache(64, src_dev, seed=11).view(64, -1).view(torch.uint8)
        want = torch.zeros_like(src, device=DST)
        for s, d, n in runs:
            want[d:d + n] = src[s:s + n].to(DST)
        for how in ("copy_runs", "kernel_copy_runs", "copy_blocks", "batch_copy_runs"):
            dst = torch.zeros_like(src, device=DST)
            stream = torch.cuda.Stream(DST)
            with torch.cuda.device(DST):
                stream.wait_stream(torch.cuda.current_stream(DST))
                picked = getattr(cuda_copy, how)(dst, src, runs, stream)
            stream.synchronize()
            assert torch.equal(dst, want), (src_dev, how)
            if how == "copy_blocks":  # several runs: one batched copy-engine call
                assert picked == "batch"
                # without it: 32 KiB blocks are short runs, a kernel on one device only
                assert cuda_copy.copy_blocks(dst, src, runs, stream, batch=False) == \
                    ("kernel" if src_dev == DST else "copy_engine")
                stream.synchronize()
                assert torch.equal(dst, want), (src_dev, how, "without batch")
            if how == "batch_copy_runs":
                assert picked is True, "cuMemcpyBatchAsync unavailable or refused"


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_scattered_and_repeated(backend):
    async def main():
        src, dst = cache(64, SRC, seed=1), cache(80, DST)
        rx, tx = await pair(backend, src, dst)
        for rep in range(3):  # the pair (communicator / mapping) is reused
            src_ids = [3, 4, 5, 6, 20, 0, 1, 63, 9, 10]
            dst_ids = [79, 0, 1, 2, 17, 18, 5, 7, 8, 30 + rep]
            handle = rx.expect(f"rt{rep}", dst_ids, timeout_s=30)
            res = await tx.send(f"rt{rep}", rx.endpoint, src_ids, timeout_s=30)
            got = await handle.wait()
            assert res.state is TransferState.DONE, res.error
            assert got.state is TransferState.DONE, got.error
            assert res.num_bytes == got.num_bytes == len(src_ids) * LAYOUT.block_bytes
            assert torch.equal(dst[dst_ids].cpu(), src[src_ids].cpu())
            assert got.pieces == 8  # runs contiguous in both caches (metrics' histogram)
            dst.zero_()
        assert rx.stats().done == 3
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_destination_given_after_the_sender_connected(backend):
    """Expected by count (the decode worker reserves its blocks while the prefill runs): the
    sender is already connected, the ids follow; the data lands exactly there."""
    async def main():
        src, dst = cache(32, SRC, seed=5), cache(32, DST)
        rx, tx = await pair(backend, src, dst)
        for rep in range(2):  # a new pair (set-up waits for the ids), then an existing one
            handle = rx.expect(f"late{rep}", 4, timeout_s=30)
            task = asyncio.create_task(tx.send(f"late{rep}", rx.endpoint, [1, 2, 3, 9], 30))
            while handle.state is TransferState.PENDING:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            assert not task.done()
            handle.assign([31, 4, 5, 6 + rep])
            res, got = await task, await handle.wait()
            assert res.state is got.state is TransferState.DONE, (res.error, got.error)
            assert torch.equal(dst[[31, 4, 5, 6 + rep]].cpu(), src[[1, 2, 3, 9]].cpu())
            dst.zero_()
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("lanes", [1, 3])
def test_cuda_ipc_sender_that_gives_up_keeps_its_blocks_until_the_copy_stopped(lanes):
    """cuda_ipc copies are one-sided (the receiver reads the sender's cache), and DONE needs
    no confirmation: so a sender that times out while the receiver's copies are still queued
    (here behind a ~1 s sleep kernel on the receiver's stream) may only return from send()
    once the receiver stopped, never while the copy could still read its blocks. Also: the
    copies spread over several lanes land exactly where they belong."""
    async def main():
        src, dst = cache(64, SRC, seed=8), cache(64, DST)
        rx = make_receiver("cuda_ipc", dst, LAYOUT, copy_lanes=lanes)
        await rx.start()
        tx = make_sender("cuda_ipc", src, LAYOUT)
        ids = [3, 4, 5, 6, 7, 20, 21, 40, 41, 42, 43, 44, 45]
        h = rx.expect("ok", list(range(50, 63)), 30)
        assert (await tx.send("ok", rx.endpoint, ids, 30)).ok and (await h.wait()).ok
        assert torch.equal(dst[50:63].cpu(), src[ids].cpu())
        h = rx.expect("slow", list(range(13)), 30)
        with torch.cuda.device(DST):
            rx.channel.payload._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(rx.channel.payload._stream):
                torch.cuda._sleep(int(1.5e9))  # ~1 s of cycles: the copies queue behind it
        t0 = time.monotonic()
        res = await tx.send("slow", rx.endpoint, ids, 0.2)
        waited = time.monotonic() - t0
        assert res.state is TransferState.TIMED_OUT, res
        assert h.state.terminal and rx.channel.payload._stream.query(), \
            "send() returned during the copy"
        assert waited > 0.4, waited
        got = await h.wait()
        assert got.state is TransferState.FAILED and "gave up" in got.error, got
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_send_waits_for_each_parts_event(backend):
    """As on a prefill worker: the send starts before the KV exists, and each part is handed
    over with the CUDA event of the kernel that writes it, while that kernel is still queued
    behind ~50 ms of GPU work. A backend that read the blocks before the event completed
    would land stale zeros. Two concurrent streams share the pair."""
    async def main():
        src, dst = cache(96, SRC), cache(96, DST)
        rx, tx = await pair(backend, src, dst)
        jobs = [("gs0", list(range(8, 40)), list(range(30, 62))),
                ("gs1", list(range(50, 66)) + [2, 3, 4, 5], [0, 1, 2, 3] + list(range(70, 86)))]
        want = {tid: cache(len(s), SRC, seed=20 + k) for k, (tid, s, _) in enumerate(jobs)}
        torch.cuda.synchronize(SRC)
        handles = [rx.expect(tid, d, 30) for tid, _, d in jobs]
        streams = {tid: BlockStream(len(s)) for tid, s, _ in jobs}
        tasks = [asyncio.create_task(tx.send(tid, rx.endpoint, streams[tid], 30))
                 for tid, _, _ in jobs]
        await asyncio.sleep(0.2)  # handshakes (and communicator / mapping set-up) happen now
        compute = torch.cuda.Stream(SRC)
        with torch.cuda.device(SRC), torch.cuda.stream(compute):
            for tid, s, _ in jobs:
                half = len(s) // 2
                for part in (slice(0, half), slice(half, None)):
                    torch.cuda._sleep(50_000_000)  # the "forward pass" before this chunk
                    src[s[part]] = want[tid][part]
                    event = torch.cuda.Event()
                    event.record(compute)
                    streams[tid].extend(s[part], event)
        results = await asyncio.gather(*tasks)
        assert [r.state for r in results] == [TransferState.DONE] * 2, [r.error for r in results]
        for handle, (tid, _, d) in zip(handles, jobs):
            assert (await handle.wait()).ok
            assert torch.equal(dst[d].cpu(), want[tid].cpu()), f"{tid}: stale blocks landed"
        assert all(r.tail_seconds is not None and r.tail_seconds < r.seconds for r in results)
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_layered_send_waits_for_each_layers_event(backend):
    """As the prefill worker hands a chunk over: when the chunk is queued, before it
    computes, with one event per layer. The nccl sender moves it layer by layer (one
    message per layer here, gathered from scattered blocks); every backend must wait for
    each layer's event, or stale zeros land."""
    async def main():
        src, dst = cache(64, SRC), cache(64, DST)
        rx = make_receiver(backend, dst, LAYOUT)
        await rx.start()
        opts = {"layers_per_message": 1} if backend == "nccl" else {}
        tx = make_sender(backend, src, LAYOUT, **opts)
        if backend == "nccl":
            assert tx.channel.payload._groups == [(0, 1), (1, 2), (2, 3), (3, 4)]  # noqa: SLF001
        s_ids, d_ids = [5, 6, 7, 8, 30, 2, 41, 40], [0, 1, 2, 3, 60, 10, 11, 12]
        want = cache(len(s_ids), SRC, seed=7)
        torch.cuda.synchronize(SRC)
        handle = rx.expect("ly", d_ids, 30)
        blocks = BlockStream(len(s_ids))
        task = asyncio.create_task(tx.send("ly", rx.endpoint, blocks, 30))
        await asyncio.sleep(0.2)  # handshake and communicator set-up
        compute = torch.cuda.Stream(SRC)
        with torch.cuda.device(SRC), torch.cuda.stream(compute):
            for lo, hi in ((0, 4), (4, 8)):  # two chunks, each queued before it runs
                layers = []
                for layer in range(LAYOUT.num_layers):
                    torch.cuda._sleep(20_000_000)  # the layer's forward pass
                    src[s_ids[lo:hi], layer] = want[lo:hi, layer]
                    layers.append(torch.cuda.Event())
                    layers[-1].record(compute)
                torch.cuda._sleep(5_000_000)  # norm, logits, sampling
                final = torch.cuda.Event()
                final.record(compute)
                blocks.extend(s_ids[lo:hi], final, layers)
        res = await task
        got = await handle.wait()
        assert res.state is TransferState.DONE, res.error
        assert got.state is TransferState.DONE, got.error
        assert torch.equal(dst[d_ids].cpu(), want.cpu()), "stale layers landed"
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("pack_layers", [1, 2, 4, 0])
def test_nccl_packs_a_written_part_of_scattered_blocks(pack_layers, monkeypatch):
    """A part whose KV is written (here: behind an event still pending when it is handed
    over) with scattered blocks moves as layer-group messages of about
    ``pack_message_bytes`` (1 layer: four messages through two staging buffers per side,
    reused), gathered after the part's event; contiguous blocks, or packing off, move as
    whole messages. The data lands exactly either way."""
    from kvtransfer.backends.nccl import NcclPayloadSender

    packed = []
    real = NcclPayloadSender._send_layers

    async def counting(self, sock, comm, part, groups, staged, *rest):
        packed.append(len(groups))
        return await real(self, sock, comm, part, groups, staged, *rest)

    monkeypatch.setattr(NcclPayloadSender, "_send_layers", counting)

    async def main():
        src, dst = cache(96, SRC), cache(96, DST)
        rx = make_receiver("nccl", dst, LAYOUT)
        await rx.start()
        s_ids, d_ids = [40, 2, 17, 90, 5, 6, 33, 71, 12, 60], [3, 88, 41, 7, 8, 9, 52, 20, 64, 1]
        part_bytes = len(s_ids) * LAYOUT.block_bytes
        tx = make_sender("nccl", src, LAYOUT,
                         pack_message_bytes=part_bytes // LAYOUT.num_layers * pack_layers)
        for rep, (si, di) in enumerate(((s_ids, d_ids), (list(range(10)), list(range(50, 60))))):
            want = cache(len(si), SRC, seed=20 + rep)
            torch.cuda.synchronize(SRC)
            handle = rx.expect(f"pk{rep}", di, 30)
            compute = torch.cuda.Stream(SRC)
            with torch.cuda.device(SRC), torch.cuda.stream(compute):
                torch.cuda._sleep(50_000_000)  # the part is still being written
                src[si] = want
                written = torch.cuda.Event()
                written.record(compute)
            blocks = BlockStream(len(si))
            blocks.extend(si, written)
            res = await tx.send(f"pk{rep}", rx.endpoint, blocks, 30)
            got = await handle.wait()
            assert res.state is got.state is TransferState.DONE, (res.error, got.error)
            assert torch.equal(dst[di].cpu(), want.cpu()), (pack_layers, rep)
            dst.zero_()
        await tx.close()
        await rx.close()

    run(main())
    # scattered: packed in 4 / 2 / 1 messages (0: off); contiguous: one whole message
    assert packed == ([LAYOUT.num_layers // pack_layers] if pack_layers else [])


@pytest.mark.parametrize("short_side", [DST, SRC])
def test_nccl_without_memory_to_pack_moves_whole_messages(short_side, monkeypatch):
    """A side that cannot allocate the staging buffers (out of GPU memory) does not pack:
    the receiver declines the offer, or the sender does not make it; the scattered part
    then moves as one message per segment, exactly, and the pair stays usable."""
    from kvtransfer.backends import nccl

    real_try, packed = nccl.try_staging, []  # noqa: SLF001

    def short_of_memory(layout, num_blocks, groups, comm):
        if str(comm.device) == short_side:
            return None
        return real_try(layout, num_blocks, groups, comm)

    real_send = nccl.NcclPayloadSender._send_layers  # noqa: SLF001

    async def counting(self, sock, comm, part, groups, staged, *rest):
        packed.append(len(groups))
        return await real_send(self, sock, comm, part, groups, staged, *rest)

    monkeypatch.setattr(nccl, "try_staging", short_of_memory)
    monkeypatch.setattr(nccl.NcclPayloadSender, "_send_layers", counting)

    async def main():
        src, dst = cache(64, SRC, seed=31), cache(64, DST)
        rx, tx = await pair("nccl", src, dst)
        s_ids, d_ids = [9, 3, 50, 22, 7], [60, 1, 33, 12, 40]
        for rep in range(2):
            handle = rx.expect(f"oom{rep}", d_ids, 30)
            res = await tx.send(f"oom{rep}", rx.endpoint, s_ids, 30)
            got = await handle.wait()
            assert res.state is got.state is TransferState.DONE, (res.error, got.error)
            assert torch.equal(dst[d_ids].cpu(), src[s_ids].cpu())
            dst.zero_()
        await tx.close()
        await rx.close()

    run(main())
    assert packed == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_transfers(backend):
    async def main():
        src, dst = cache(64, SRC, seed=2), cache(64, DST)
        rx, tx = await pair(backend, src, dst)
        jobs = [(f"c{i}", list(range(i * 8, i * 8 + 7)), list(range(63 - i * 8, 56 - i * 8, -1)))
                for i in range(8)]
        handles = [rx.expect(tid, d, 30) for tid, _, d in jobs]
        results = await asyncio.gather(*(tx.send(tid, rx.endpoint, s, 30) for tid, s, _ in jobs))
        assert [r.state for r in results] == [TransferState.DONE] * 8, [r.error for r in results]
        for handle, (_, s, d) in zip(handles, jobs):
            assert (await handle.wait()).ok
            assert torch.equal(dst[d].cpu(), src[s].cpu())
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatches_and_unknown_ids_fail_both_sides(backend):
    other = KVLayout(4, 2, 32, 16, "bfloat16")

    async def main():
        rx, tx = await pair(backend, cache(8, SRC, 3, other), cache(8, DST), src_layout=other)
        h = rx.expect("lm", [0, 1], 10)
        res = await tx.send("lm", rx.endpoint, [0, 1], 10)
        got = await h.wait()
        assert res.state is got.state is TransferState.FAILED
        assert "layout mismatch" in res.error and "layout mismatch" in got.error
        await tx.close()
        tx = make_sender(backend, cache(8, SRC, 3), LAYOUT)
        h = rx.expect("cnt", [0, 1, 2], 10)
        res = await tx.send("cnt", rx.endpoint, [0, 1], 10)
        assert res.state is TransferState.FAILED and "mismatch" in res.error
        assert (await h.wait()).state is TransferState.FAILED
        res = await tx.send("nobody-expects-this", rx.endpoint, [0], 10)
        assert res.state is TransferState.FAILED and "unknown" in res.error
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeouts_cancel_and_close(backend):
    async def main():
        src, dst = cache(16, SRC, seed=4), cache(16, DST)
        rx, tx = await pair(backend, src, dst)
        t0 = time.monotonic()
        res = await rx.expect("never", [0], 0.3).wait()  # nobody sends
        assert res.state is TransferState.TIMED_OUT and time.monotonic() - t0 < 2
        h = rx.expect("rc", [1], 30)
        assert rx.cancel("rc")
        assert (await h.wait()).state is TransferState.CANCELLED
        res = await tx.send("rc", rx.endpoint, [1], 10)
        assert res.state is TransferState.FAILED
        # no receiver at all: the sender fails fast, not at its timeout
        t0 = time.monotonic()
        res = await tx.send("x", f"{backend}://127.0.0.1:1", [0], 10)
        assert res.state is TransferState.FAILED and time.monotonic() - t0 < 5
        # the pair still works after all of that
        h = rx.expect("ok", [2, 3], 30)
        assert (await tx.send("ok", rx.endpoint, [5, 6], 30)).ok
        assert (await h.wait()).ok and torch.equal(dst[[2, 3]].cpu(), src[[5, 6]].cpu())
        pending = rx.expect("pending", [4], 30)
        await rx.close()
        assert (await asyncio.wait_for(pending.wait(), 2)).state is TransferState.CANCELLED
        await tx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_round_trip(backend):
    """Sender in another process on cuda:0, receiver here on cuda:1 (the deployment shape)."""
    async def main():
        dst = cache(80, DST)
        rx = make_receiver(backend, dst, LAYOUT)
        await rx.start()
        for rep in range(2):
            ids = list(range(79, 15, -1))  # reversed: 64 one-block segments
            h = rx.expect(f"p{rep}", ids, 60)
            proc = _spawn(backend, "send", rx.endpoint, "0", f"p{rep}")
            res = await h.wait()
            out = await asyncio.get_running_loop().run_in_executor(None, proc.communicate)
            assert res.state is TransferState.DONE, (res, out[0][-2000:])
            want = (torch.arange(64, device=DST) % 200).to(torch.bfloat16)
            assert torch.equal(dst[ids].reshape(64, -1)[:, 0], want)
            assert (dst[ids].reshape(64, -1) == want[:, None]).all()
            dst.zero_()
        await rx.close()

    run(main())


def test_nccl_dead_sender_does_not_hang_the_receiver():
    """The sender process freezes after the receiver posted its receives, then is killed:
    the receiver must fail the transfer within a second (not at its 60 s timeout), abort the
    communicator, and serve a new sender afterwards."""
    async def main():
        dst = cache(80, DST)
        rx = make_receiver("nccl", dst, LAYOUT)
        await rx.start()
        h = rx.expect("victim", list(range(64)), 60)
        proc = _spawn("nccl", "send", rx.endpoint, "1", "victim")
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 60
        while h.state is TransferState.PENDING and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        line = await loop.run_in_executor(None, proc.stdout.readline)
        assert "FROZEN" in line, line
        await asyncio.sleep(0.5)  # receives are queued on the receiver's stream by now
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        res = await asyncio.wait_for(h.wait(), 10)
        assert res.state is TransferState.FAILED, res
        assert time.monotonic() - t0 < 2.0
        assert not rx.channel.payload._pairs.comms, "the dead pair's communicator was not dropped"
        h = rx.expect("after", list(range(64)), 60)
        proc = _spawn("nccl", "send", rx.endpoint, "0", "after")
        res = await h.wait()
        out = await loop.run_in_executor(None, proc.communicate)
        assert res.ok, (res, out[0][-2000:])
        await rx.close()

    run(main())
