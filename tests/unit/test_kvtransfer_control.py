"""The control-connection skeleton that the GPU backends (nccl, cuda_ipc, nixl) share.

The GPU backends themselves run in tests/gpu/test_kvtransfer_gpu.py on two GPUs. Here the
skeleton runs with a minimal in-process backend whose "device work" is a CPU copy that
completes when the test says so, so handshake, segment matching, peer-failure detection and
timeouts are checked on any machine. Also: the GPU backends refuse CPU caches clearly.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import torch

from kvtransfer import KVLayout, TransferState, make_receiver, make_sender
from kvtransfer import wire as proto
from kvtransfer.api import KVTransferOptions, TransferError
from kvtransfer.blocks import segments
from kvtransfer.control import (
    await_ack,
    control_receiver,
    control_sender,
    hold_lease,
    until_receiver_stopped,
)
from kvtransfer import control
from kvtransfer.lifecycle import Receiver, Sender
from kvtransfer.waits import poll_until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
_SOURCES: dict[str, torch.Tensor] = {}


class LoopbackPush:
    """The sending half of a minimal control backend: the source blocks' ids go out in one
    BLOB and the receiver copies them out of this process's memory."""

    eager = False

    def __init__(self, cache, die_after_blob: bool = False):
        self.key = f"s{id(self)}"
        _SOURCES[self.key] = cache
        self.die_after_blob = die_after_blob

    async def send(self, loop, sock, endpoint, sm, blocks):
        ids = await blocks.all(watch=sock)
        await loop.sock_sendall(sock, proto.encode_blob(
            json.dumps({"sender": self.key, "src": ids}).encode()))
        if self.die_after_blob:
            sock.close()  # the "process" is gone
            raise TransferError("sender died")
        await await_ack(loop, sock, sm)

    def close(self):
        pass


class LoopbackPull:
    """The receiving half: a CPU copy as its "device work", which completes once
    ``release`` is set."""

    def __init__(self, cache, layout):
        self.cache, self.layout = cache, layout
        self.release = asyncio.Event()  # the "device work" completes when set
        self.release.set()

    async def start(self):
        pass

    async def receive(self, loop, conn, entry):
        meta = json.loads(await proto.read_blob(loop, conn))
        src = _SOURCES[meta["sender"]]
        segs = segments(meta["src"], entry.dst_block_ids)
        for s, d, n in segs:
            self.cache[d:d + n] = src[s:s + n]
        await poll_until(self.release.is_set, watch=conn, what="copy")
        entry.add_bytes(len(meta["src"]) * self.layout.block_bytes)

    def close(self):
        pass


class OneSidedLoopbackPush(LoopbackPush):
    """Like the one-sided GPU backends (cuda_ipc, nixl): the receiver reads our blocks, so a
    failed send keeps them leased until the receiver stopped; blocks that are all readable
    when the send starts go out right behind HELLO (eager payload)."""

    eager = True

    def __init__(self, cache):
        super().__init__(cache)
        self.states_at_payload = []

    async def send(self, loop, sock, endpoint, sm, blocks):
        self.states_at_payload.append(sm.state)
        ids = await blocks.all(watch=sock)
        await loop.sock_sendall(sock, proto.encode_blob(
            json.dumps({"sender": self.key, "src": ids}).encode()))
        try:
            await await_ack(loop, sock, sm)
        except BaseException as exc:
            await hold_lease(loop, sock, sm, exc)
            raise


def loopback_sender(cache, layout, payload=LoopbackPush, **kw) -> Sender:
    return control_sender(cache, layout, "loop", 99, payload(cache, **kw), KVTransferOptions())


def one_sided_loopback_sender(cache, layout, payload=OneSidedLoopbackPush) -> Sender:
    return control_sender(cache, layout, "loop", 99, payload(cache), KVTransferOptions())


def loopback_receiver(cache, layout) -> Receiver:
    return control_receiver(cache, layout, "loop", 99, LoopbackPull(cache, layout),
                            KVTransferOptions(), None)


def cache(n, seed=None):
    shape = (n, *LAYOUT.block_shape)
    return torch.zeros(shape) if seed is None else torch.randn(
        shape, generator=torch.Generator().manual_seed(seed))


def test_segments_are_contiguous_on_both_sides():
    assert segments([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    assert segments(list(range(10, 20)), list(range(100, 110))) == [(10, 100, 10)]
    assert segments([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    with pytest.raises(ValueError):
        segments([1, 2], [1])


def test_loopback_round_trip_and_errors():
    async def main():
        src, dst = cache(32, seed=1), cache(40)
        rx = loopback_receiver(dst, LAYOUT)
        await rx.start()
        assert rx.endpoint.startswith("loop://127.0.0.1:")
        tx = loopback_sender(src, LAYOUT)
        src_ids, dst_ids = [3, 4, 5, 20, 0, 1, 31], [39, 0, 1, 2, 17, 18, 5]
        h = rx.expect("a", dst_ids, 5)
        res = await tx.send("a", rx.endpoint, src_ids, 5)
        assert res.ok and (await h.wait()).ok, res.error
        assert torch.equal(dst[dst_ids], src[src_ids])
        assert res.num_bytes == len(src_ids) * LAYOUT.block_bytes
        # unknown id, count mismatch, wrong scheme
        assert "unknown" in (await tx.send("zz", rx.endpoint, [0], 5)).error
        h = rx.expect("b", [0, 1], 5)
        res = await tx.send("b", rx.endpoint, [0], 5)
        assert res.state is TransferState.FAILED and "mismatch" in res.error
        assert (await h.wait()).state is TransferState.FAILED
        res = await tx.send("c", "tcp://127.0.0.1:1", [0], 5)
        assert res.state is TransferState.FAILED and "not a loop://" in res.error
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_peer_hanging_up_during_device_work_fails_fast():
    """The receiver waits on its device work; the sender goes away: the receiver must notice
    through the control socket at once, not at its timeout."""
    async def main():
        rx = loopback_receiver(cache(8), LAYOUT)
        await rx.start()
        rx.channel.payload.release.clear()  # device work never completes on its own
        tx = loopback_sender(cache(8, seed=2), LAYOUT, die_after_blob=True)
        h = rx.expect("d", [0, 1], 30)
        res = await tx.send("d", rx.endpoint, [2, 3], 30)
        assert res.state is TransferState.FAILED
        got = await asyncio.wait_for(h.wait(), 2)
        assert got.state is TransferState.FAILED and "peer gave up" in got.error, got
        await rx.close()

    asyncio.run(main())


def test_receiver_timeout_reaches_the_sender_with_a_reason():
    async def main():
        rx = loopback_receiver(cache(8), LAYOUT)
        await rx.start()
        rx.channel.payload.release.clear()
        tx = loopback_sender(cache(8, seed=3), LAYOUT)
        h = rx.expect("t", [0], 0.3)
        res = await tx.send("t", rx.endpoint, [1], 30)
        assert (await h.wait()).state is TransferState.TIMED_OUT
        assert res.state is TransferState.FAILED and "timed_out" in res.error, res
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_poll_until_leaves_a_pending_ok_for_its_owner():
    async def main():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.sendall(proto.encode_reply(proto.OK))
        flag = {"n": 0}

        def done():
            flag["n"] += 1
            return flag["n"] > 20

        await poll_until(done, watch=a)  # an OK waiting is not a failure
        assert await proto.read_reply(asyncio.get_running_loop(), a) == (proto.OK, 0, "")
        b.sendall(proto.encode_reply(proto.ERROR, 0, "boom"))
        with pytest.raises(TransferError, match="boom"):
            await poll_until(lambda: False, watch=a)
        a.close()
        b.close()

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["nccl", "cuda_ipc"])
def test_gpu_backends_refuse_cpu_caches(backend):
    c = cache(4)
    with pytest.raises(ValueError, match="CUDA"):
        make_sender(backend, c, LAYOUT)
    with pytest.raises(ValueError, match="CUDA"):
        make_receiver(backend, c, LAYOUT)


def test_poll_in_thread_wakes_at_once_stops_when_cancelled_and_raises_errors():
    """The helper-thread poll (nccl enqueue / communicator init): it returns within a few
    hundred microseconds of ``done`` turning true (the event loop would round a short
    sleep up to a millisecond), its thread stops once the waiter is cancelled, and an
    error raised by ``done`` reaches the waiter."""
    import threading
    import time

    from kvtransfer.waits import poll_in_thread

    async def main():
        flag = threading.Event()
        threading.Timer(0.02, flag.set).start()
        t0 = time.perf_counter()
        await poll_in_thread(flag.is_set)
        assert time.perf_counter() - t0 < 0.5

        calls = []

        def never() -> bool:
            calls.append(1)
            return False

        task = asyncio.ensure_future(poll_in_thread(never))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        n = len(calls)
        await asyncio.sleep(0.01)
        assert len(calls) == n  # the thread stopped with the wait

        def broken() -> bool:
            raise TransferError("communicator failed")

        with pytest.raises(TransferError, match="communicator failed"):
            await poll_in_thread(broken)

    asyncio.run(main())


def test_wait_event_wakes_on_completion_raises_its_errors_and_stops_when_the_peer_gives_up():
    """The helper-thread event wait: returns once ``synchronize()`` returns (noting "synced"
    from the thread), passes on an error raised there, and ends with TransferError when the
    watched control socket closes first (the event never completing)."""
    import socket
    import threading
    import time

    from kvtransfer.waits import wait_event

    class Event:
        def __init__(self, seconds: float = 0.0, error: Exception | None = None):
            self.done = threading.Event()
            self.seconds, self.error = seconds, error

        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            if self.error is not None:
                raise self.error
            self.done.wait(self.seconds)

    async def main():
        marks = []
        t0 = time.perf_counter()
        await wait_event(Event(0.02), mark=marks.append)
        assert 0.02 <= time.perf_counter() - t0 < 0.5 and marks == ["synced"]

        with pytest.raises(RuntimeError, match="illegal address"):
            await wait_event(Event(error=RuntimeError("illegal address")))

        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        stuck = Event(5.0)
        asyncio.get_running_loop().call_later(0.02, theirs.close)
        t0 = time.perf_counter()
        with pytest.raises(TransferError, match="peer gave up during the copy"):
            await wait_event(stuck, watch=ours, what="the copy")
        assert time.perf_counter() - t0 < 1.0
        stuck.done.set()  # lets the helper thread go
        ours.close()

    asyncio.run(main())


def test_one_sided_send_that_times_out_returns_only_after_the_receiver_stopped():
    """The receiver's "copy" never completes; the sender times out. Its send() may only
    return (and its caller free the source blocks) once the receiver heard of it and ended
    the transfer, never while the receiver might still be reading."""
    async def main():
        src, dst = cache(8, seed=3), cache(8)
        rx = loopback_receiver(dst, LAYOUT)
        rx.channel.payload.release.clear()
        await rx.start()
        tx = one_sided_loopback_sender(src, LAYOUT)
        h = rx.expect("t", [0, 1], 30)
        res = await tx.send("t", rx.endpoint, [2, 3], 0.3)
        assert res.state is TransferState.TIMED_OUT, res
        assert h.state.terminal  # already ended when send() returned
        got = await h.wait()
        assert got.state is TransferState.FAILED and "sender gave up" in got.error, got
        await rx.close()
        await tx.close()

    asyncio.run(main())


def test_eager_payload_skips_the_hello_round_trip_and_rejections_still_say_why():
    """A one-sided sender whose blocks are all readable sends its payload right behind HELLO
    (the transfer is still PENDING: the receiver's answer is read with the ack); one whose
    blocks are still being computed waits for the answer first. A receiver that rejects an
    eager sender drains what it sent, so the reason arrives (no connection reset), every
    time."""
    from kvtransfer.stream import BlockStream

    async def main():
        src, dst = cache(16, seed=4), cache(16)
        rx = loopback_receiver(dst, LAYOUT)
        await rx.start()
        tx = one_sided_loopback_sender(src, LAYOUT)
        h = rx.expect("e", [5, 6, 9], 5)
        res = await tx.send("e", rx.endpoint, [0, 1, 2], 5)
        assert res.ok and (await h.wait()).ok, res.error
        assert torch.equal(dst[[5, 6, 9]], src[[0, 1, 2]])
        assert tx.channel.payload.states_at_payload == [TransferState.PENDING]

        stream = BlockStream(2)  # still computing: the handshake completes first
        h = rx.expect("s", [3, 4], 5)
        task = asyncio.ensure_future(tx.send("s", rx.endpoint, stream, 5))
        await asyncio.sleep(0.05)
        stream.extend([7, 8])
        assert (await task).ok and (await h.wait()).ok
        assert tx.channel.payload.states_at_payload[-1] is TransferState.TRANSFERRING
        assert torch.equal(dst[[3, 4]], src[[7, 8]])

        class Slow(OneSidedLoopbackPush):  # writes on after the receiver answered
            async def send(self, loop, sock, endpoint, sm, blocks):
                await loop.sock_sendall(sock, proto.encode_blob(b"{}"))
                await asyncio.sleep(0.05)
                await super().send(loop, sock, endpoint, sm, blocks)

        slow = one_sided_loopback_sender(src, LAYOUT, Slow)
        for i in range(3):
            res = await slow.send(f"nobody-slow-{i}", rx.endpoint, [0, 1], 5)
            assert res.state is TransferState.FAILED and "unknown" in res.error, res
        for i in range(20):
            res = await tx.send(f"nobody-{i}", rx.endpoint, [0, 1], 5)
            assert res.state is TransferState.FAILED and "unknown" in res.error, res
            h = rx.expect(f"m-{i}", [0, 1, 2], 5)
            res = await tx.send(f"m-{i}", rx.endpoint, [0], 5)
            assert res.state is TransferState.FAILED and "mismatch" in res.error, res
            assert (await h.wait()).state is TransferState.FAILED
        await asyncio.sleep(0.1)
        assert not rx.channel.listener.connections  # every rejected connection was closed
        await slow.close()
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_receiver_never_counts_done_a_transfer_whose_sender_gave_up():
    """The sender gives up right behind its payload (an eager one that never saw the
    receiver's answer): the receiver's device work completes before it looked at the
    socket again, yet the transfer is FAILED, not DONE (the sender's blocks may be gone);
    and the sender does not wait long for a receiver that never answered."""
    class GivesUp(OneSidedLoopbackPush):
        async def send(self, loop, sock, endpoint, sm, blocks):
            ids = await blocks.all(watch=sock)
            await loop.sock_sendall(sock, proto.encode_blob(
                json.dumps({"sender": self.key, "src": ids}).encode()))
            await until_receiver_stopped(loop, sock, "sender gave up: test",
                                         accepted=sm.state is not TransferState.PENDING)
            raise TransferError("gave up")

    async def main():
        rx = loopback_receiver(cache(8), LAYOUT)
        await rx.start()
        tx = one_sided_loopback_sender(cache(8, seed=5), LAYOUT, GivesUp)
        h = rx.expect("g", [0, 1], 5)
        res = await tx.send("g", rx.endpoint, [2, 3], 5)
        assert res.state is TransferState.FAILED
        got = await asyncio.wait_for(h.wait(), 2)
        assert got.state is TransferState.FAILED and "sender gave up" in got.error, got
        await tx.close()
        await rx.close()

        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()  # never answers: the unanswered bound, not the lease's
        a.setblocking(False)
        t0 = loop.time()
        await until_receiver_stopped(loop, a, "x", accepted=False)
        assert loop.time() - t0 < control.UNANSWERED_DRAIN_TIMEOUT_S + 0.5
        a.close()
        b.close()

    asyncio.run(main())


def test_until_receiver_stopped_outlasts_a_cancel_and_is_bounded(monkeypatch, caplog):
    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        task = loop.create_task(until_receiver_stopped(loop, a, "why not"))
        await asyncio.sleep(0.2)
        assert not task.done()
        task.cancel()  # the lease is not cut short by a cancellation
        await asyncio.sleep(0.1)
        assert not task.done()
        b.setblocking(True)
        got = b.recv(100)
        assert got == proto.encode_reply(proto.ERROR, 0, "why not") and b.recv(10) == b""
        b.close()  # the receiver hangs up: the sender may free its blocks
        await asyncio.wait_for(task, 1)
        a.close()

        monkeypatch.setattr(control, "LEASE_DRAIN_TIMEOUT_S", 0.3)
        a, b = socket.socketpair()  # a receiver that never answers nor hangs up
        a.setblocking(False)
        t0 = loop.time()
        await asyncio.wait_for(until_receiver_stopped(loop, a, "x"), 2)
        assert 0.25 < loop.time() - t0 < 1.5
        assert "still reading" in caplog.text
        a.close()
        b.close()

    asyncio.run(main())


def test_copy_lanes_and_descriptor_pieces_cover_every_block_once():
    from kvtransfer.backends.cuda_ipc import lane_shares
    from kvtransfer.backends.nixl import split_pieces

    segs = [(0, 10, 4), (8, 20, 2)]
    assert lane_shares(segs, 2) == [[(0, 10, 3)], [(3, 13, 1), (8, 20, 2)]]
    assert lane_shares(segs, 1) == [segs]
    assert lane_shares([(5, 0, 2)], 4) == [[(5, 0, 1)], [(6, 1, 1)]]  # fewer blocks than lanes
    assert split_pieces([(0, 8, 5)], 2) == [(0, 8, 2), (2, 10, 2), (4, 12, 1)]
    assert split_pieces(segs, 0) == segs
    for lanes in (1, 2, 3, 4, 7):
        shares = lane_shares(segs + [(30, 40, 9)], lanes)
        flat = [(s + k, d + k) for share in shares for s, d, n in share for k in range(n)]
        assert sorted(flat) == sorted((s + k, d + k) for s, d, n in segs + [(30, 40, 9)]
                                      for k in range(n))
        sizes = [sum(n for _, _, n in share) for share in shares]
        assert max(sizes) - min(sizes) <= 1


def test_block_copies_kernel_and_fallback_land_every_run():
    """kvtransfer.backends.cuda_copy on the CPU: the Triton gather kernel (interpreted) and the
    ``copy_`` fallback copy exactly the given runs; tiles are the largest power of two up to
    32 KiB dividing a block (SmolLM2's 368,640-byte blocks: 8 KiB)."""
    from kvtransfer.backends.cuda_copy import _tile_bytes, copy_blocks, copy_runs, kernel_copy_runs

    x = torch.zeros(8, dtype=torch.uint8)
    assert _tile_bytes(2 << 20, x) == 32768 and _tile_bytes(368640, x) == 8192
    assert _tile_bytes(3072, x) == 1024 and _tile_bytes(1000, x) == 0
    src = torch.randint(0, 255, (16, 3072), dtype=torch.uint8, generator=torch.Generator()
                        .manual_seed(0))
    runs = [(3, 10, 2), (0, 0, 1), (12, 5, 3)]
    want = torch.zeros_like(src)
    for s, d, n in runs:
        want[d:d + n] = src[s:s + n]
    for copy in (kernel_copy_runs, copy_runs, copy_blocks):
        dst = torch.zeros_like(src)
        copy(dst, src, runs, None)
        assert torch.equal(dst, want), copy.__name__
    with pytest.raises(ValueError, match="tiles"):
        kernel_copy_runs(torch.zeros(4, 1000, dtype=torch.uint8),
                         torch.zeros(4, 1000, dtype=torch.uint8), [(0, 0, 1)], None)


def test_layer_group_packing_gathers_and_scatters_through_a_reused_buffer():
    """The nccl backend's packed / layered messages: ``pack_groups`` cuts a part into whole
    layers per message of about the asked size, and gathering each group into (the front
    of) one shared staging buffer and scattering it back moves every layer of every block
    exactly (CPU tensors; the same torch ops run on the GPU)."""
    from kvtransfer.blocks import gather_layers, pack_groups, scatter_layers, staging_view

    assert pack_groups(32, 512 << 20, 128 << 20) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert pack_groups(32, 32 << 20, 128 << 20) == [(0, 32)]  # small part: one message
    assert pack_groups(5, 5 << 20, 2 << 20) == [(0, 2), (2, 4), (4, 5)]
    assert pack_groups(4, 4 << 20, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # at least a layer
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    src = torch.randn(12, *layout.block_shape)
    dst = torch.zeros(10, *layout.block_shape)
    s_ids, d_ids = [7, 0, 11, 3], [9, 2, 4, 5]
    per_layer = layout.block_bytes // layout.num_layers // 4
    groups = pack_groups(5, len(s_ids) * layout.block_bytes, 2 * len(s_ids) * per_layer * 4)
    assert groups == [(0, 2), (2, 4), (4, 5)]
    buf = torch.full((len(s_ids) * 2 * per_layer,), float("nan"))
    for lo, hi in groups:
        staged = gather_layers(src, torch.tensor(s_ids), lo, hi, out=buf)
        assert staged.data_ptr() == buf.data_ptr()
        assert staged.nbytes == 4 * (hi - lo) * per_layer * 4
        assert staged.dtype == torch.int64  # 8-byte elements: a quarter of the index steps
        # the receiver scatters from its own staging view (the cache's dtype): same bytes
        scatter_layers(dst, torch.tensor(d_ids), lo, hi,
                       staging_view(buf, 4, hi - lo, per_layer))
    assert torch.equal(dst[d_ids], src[s_ids])
    assert not dst[[0, 1, 3, 6, 7, 8]].any()
    with pytest.raises(ValueError, match="staging buffer"):
        staging_view(buf, 4, 3, per_layer)
    # a layer of a block is 2 x head_dim x itemsize bytes here: 24 (int64), 12 (int32), 6
    for head_dim, dtype, want in ((3, "float32", torch.int64), (3, "bfloat16", torch.int32),
                                  (3, "uint8", torch.int16)):
        odd = KVLayout(num_layers=3, num_kv_heads=1, head_dim=head_dim, block_size=1,
                       dtype=dtype)
        src = (torch.arange(6 * 3 * 2 * head_dim) % 251).to(odd.torch_dtype).view(
            6, *odd.block_shape)
        dst = torch.zeros(5, *odd.block_shape, dtype=odd.torch_dtype)
        out = gather_layers(src, torch.tensor([5, 0, 3]), 1, 3)
        assert out.dtype == want
        scatter_layers(dst, torch.tensor([4, 1, 2]), 1, 3, out)
        assert torch.equal(dst[[4, 1, 2], 1:3], src[[5, 0, 3], 1:3])
        assert not dst[:, 0].any() and not dst[[0, 3]].any()
