"""kvtransfer conformance, the failure half: timeouts, cancellation, close, resources released
and a peer process killed mid-transfer, for every backend (real sockets and processes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

from kvtransfer import (
    TransferState,
    make_receiver,
    make_sender,
)

from tests.unit.kvtransfer_helpers import (
    BACKENDS,
    BIG,
    ROOT,
    SMALL,
    cache,
    pair,
    StalledPeer,
    memfd_mappings,
    open_fds,
    run,
)



@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_timeout_when_sender_never_sends(backend):
    async def main():
        rx = make_receiver(backend, cache(SMALL, 4), SMALL)
        await rx.start()
        handle = rx.expect("late", [0, 1], timeout_s=0.2)
        t0 = time.monotonic()
        res = await asyncio.wait_for(handle.wait(), 2)
        assert res.state is TransferState.TIMED_OUT
        assert 0.15 < time.monotonic() - t0 < 1.0
        assert rx.stats().active_transfers == 0
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_without_receiver_fails_fast(backend):
    async def main():
        tx = make_sender(backend, cache(SMALL, 4, seed=6), SMALL)
        gone = {"tcp": "tcp://127.0.0.1:1", "shm": "shm://pdkv-test-nobody-here",
                "fake": "fake://nobody", "nixl": "nixl://127.0.0.1:1"}[backend]
        res = await tx.send("x", gone, [0], timeout_s=5)
        assert res.state is TransferState.FAILED and res.seconds < 1.0, res
        await tx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_times_out_when_receiver_never_acks(backend):
    async def main():
        tx = make_sender(backend, cache(SMALL, 4, seed=7), SMALL)
        async with StalledPeer(backend, cache(SMALL, 4)) as endpoint:
            t0 = time.monotonic()
            res = await tx.send("stalled", endpoint, [0], timeout_s=0.3)
            assert res.state in (TransferState.TIMED_OUT, TransferState.FAILED), res
            assert time.monotonic() - t0 < 1.5
        await tx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_cancel(backend):
    async def main():
        tx = make_sender(backend, cache(SMALL, 4, seed=8), SMALL)
        async with StalledPeer(backend, cache(SMALL, 4)) as endpoint:
            task = asyncio.create_task(tx.send("stalled", endpoint, [0], timeout_s=30))
            await asyncio.sleep(0.1)
            assert tx.cancel("stalled")
            res = await asyncio.wait_for(task, 2)
            assert res.state is TransferState.CANCELLED
            assert not tx.cancel("stalled")
        await tx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_cancel_mid_transfer_fails_receiver(backend):
    async def main():
        src, dst = cache(BIG, 256, seed=9), cache(BIG, 256)
        rx, tx = await pair(backend, src, dst, BIG, chunk_bytes=BIG.block_bytes * 4)
        handle = rx.expect("sc", list(range(256)), 10)
        task = asyncio.create_task(tx.send("sc", rx.endpoint, list(range(256)), 10))
        while handle.state is TransferState.PENDING:
            await asyncio.sleep(0)
        assert tx.cancel("sc")
        assert (await task).state is TransferState.CANCELLED
        got = await asyncio.wait_for(handle.wait(), 2)
        assert got.state is TransferState.FAILED
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_cancel(backend):
    async def main():
        src, dst = cache(BIG, 256, seed=10), cache(BIG, 256)
        rx, tx = await pair(backend, src, dst, BIG, chunk_bytes=BIG.block_bytes * 4)
        # cancelled before the sender shows up: the send is rejected
        handle = rx.expect("early", [0], 10)
        assert rx.cancel("early") and not rx.cancel("early")
        assert (await handle.wait()).state is TransferState.CANCELLED
        res = await tx.send("early", rx.endpoint, [0], 5)
        assert res.state is TransferState.FAILED
        # cancelled mid-transfer: no more writes, the sender fails promptly
        handle = rx.expect("mid", list(range(256)), 10)
        task = asyncio.create_task(tx.send("mid", rx.endpoint, list(range(256)), 10))
        while handle.state is TransferState.PENDING:
            await asyncio.sleep(0)
        assert rx.cancel("mid")
        assert (await handle.wait()).state is TransferState.CANCELLED
        snapshot = dst.clone()
        res = await asyncio.wait_for(task, 3)
        assert res.state is TransferState.FAILED, res
        await asyncio.sleep(0.05)
        assert torch.equal(dst, snapshot)  # nothing written after the cancel
        await tx.close()
        await rx.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_ends_pending_transfers(backend):
    async def main():
        rx = make_receiver(backend, cache(SMALL, 4), SMALL)
        await rx.start()
        handle = rx.expect("p", [0], 30)
        await rx.close()
        res = await asyncio.wait_for(handle.wait(), 1)
        assert res.state is TransferState.CANCELLED

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_resources_released(backend):
    async def main():
        fds, shm = open_fds(), set(os.listdir("/dev/shm"))
        src, dst = cache(SMALL, 16, seed=11), cache(SMALL, 16)
        rx, tx = await pair(backend, src, dst)
        for i in range(5):
            handle = rx.expect(f"r{i}", [i, i + 5], 5)
            assert (await tx.send(f"r{i}", rx.endpoint, [i, 15 - i], 5)).ok
            assert (await handle.wait()).ok
        rx.expect("bad", [0], 5)
        assert not (await tx.send("bad", rx.endpoint, [0, 1], 5)).ok
        assert not (await tx.send("unknown", rx.endpoint, [0], 5)).ok
        await tx.close()
        await rx.close()
        await asyncio.sleep(0.01)
        assert open_fds() == fds
        assert set(os.listdir("/dev/shm")) == shm
        assert memfd_mappings() == []

    run(main())


_CHILD_SENDER = """
import asyncio, sys, torch
from kvtransfer import KVLayout, make_sender
backend, endpoint, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
layout = KVLayout(4, 4, 64, 16, "float32")
src = torch.ones(n, *layout.block_shape)
opts = {"chunk_bytes": 4 << 20} if backend == "shm" else {}
res = asyncio.run(make_sender(backend, src, layout, **opts).send("victim", endpoint,
                                                                  list(range(n)), 60))
print(res, flush=True)
"""


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_sender_process_killed_mid_transfer(backend):
    """The receiver must end FAILED promptly (not at its timeout) and release everything."""
    n = 768  # 96 MiB: more than the socket buffers / shm ring can hold

    async def main():
        fds = open_fds()
        rx = make_receiver(backend, cache(BIG, n), BIG)
        await rx.start()
        handle = rx.expect("victim", list(range(n)), timeout_s=60)
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_SENDER, backend, rx.endpoint,
                                 str(n)], cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while handle.state is TransferState.PENDING and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            assert handle.state is TransferState.TRANSFERRING
            # block our loop so the child fills the pipe / ring and stalls, then kill it
            time.sleep(0.3)
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            res = await asyncio.wait_for(handle.wait(), 5)
        finally:
            proc.kill()
            proc.wait()
        assert res.state is TransferState.FAILED, res
        assert time.monotonic() - t0 < 1.0
        assert 0 <= res.num_bytes < n * BIG.block_bytes
        await rx.close()
        assert open_fds() == fds
        assert memfd_mappings() == []

    run(main())


_CHILD_NIXL_MUTE = """
import asyncio, sys, torch
from kvtransfer import KVLayout, make_sender
from kvtransfer import wire as proto
real_expect_ok = proto.expect_ok

async def expect_ok(loop, sock, what):
    if what == "failed the transfer":  # the offer is out: go silent, never read the ack
        print("offered", flush=True)
        await asyncio.sleep(3600)
    return await real_expect_ok(loop, sock, what)

proto.expect_ok = expect_ok
endpoint, n = sys.argv[1], int(sys.argv[2])
layout = KVLayout(4, 4, 64, 16, "float32")
src = torch.ones(n, *layout.block_shape)
asyncio.run(make_sender("nixl", src, layout).send("victim", endpoint, list(range(n)), 60))
"""


@pytest.mark.skipif("nixl" not in BACKENDS, reason="nixl-cu13 is not installed")
@pytest.mark.parametrize("stage", ["before_read", "after_read"])
def test_nixl_sender_process_killed(stage):
    """nixl READs the sender's memory, so the payload never stalls in a socket. The sender
    goes silent after its offer and is killed: before the receiver used the offer, the
    receiver must end FAILED (never DONE) promptly and leak nothing; after the READ, which
    ran while the sender was alive and inside ``send()``, the transfer is DONE with the data
    in place (no confirmation round trip: a sender only frees its blocks once the receiver
    stopped reading)."""
    n = 256

    async def main():
        fds = open_fds()
        dst = cache(BIG, n)
        rx = make_receiver("nixl", dst, BIG)
        await rx.start()
        handle = rx.expect("victim", list(range(n)), timeout_s=60)
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_NIXL_MUTE, rx.endpoint, str(n)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while handle.state is TransferState.PENDING and time.monotonic() < deadline:
                await asyncio.sleep(0)
            assert handle.state is TransferState.TRANSFERRING
            if stage == "before_read":
                line = proc.stdout.readline()  # blocks our loop: the offer stays unread
            else:
                line = await asyncio.to_thread(proc.stdout.readline)
                await asyncio.wait_for(handle.wait(), 5)  # the READ ends while it lives
            assert line.strip() == "offered"
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            res = await asyncio.wait_for(handle.wait(), 5)
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        if stage == "before_read":
            assert res.state is TransferState.FAILED, res
            assert time.monotonic() - t0 < 1.0
        else:
            assert res.state is TransferState.DONE, res
            assert bool((dst == 1).all())
        await rx.close()
        assert open_fds() == fds

    run(main())
