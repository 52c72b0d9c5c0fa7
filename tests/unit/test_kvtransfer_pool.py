"""Control connections are kept between transfers (kvtransfer.control): a transfer that ended
DONE leaves its connection to the next one to the same receiver; any other outcome closes
it; a connection the receiver closed (idle limit, exit, restart) is never picked; idle ones
age out on both sides. Real sockets, the tcp backend (which carries the payload on the same
connection, so a connection left unclean would corrupt the next transfer's data)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from kvtransfer import ListenAddress, TransferState, control, make_receiver, make_sender
from kvtransfer.control import ConnectionPool

from tests.unit.kvtransfer_helpers import SMALL, cache, run


async def _tcp_pair(src, dst, port: int = 0):
    rx = make_receiver("tcp", dst, SMALL, listen=ListenAddress(port=port))
    await rx.start()
    return rx, make_sender("tcp", src, SMALL)


async def _round_trip(rx, tx, tid: str, src, dst, s_ids, d_ids, expect=TransferState.DONE):
    handle = rx.expect(tid, d_ids, timeout_s=10)
    res = await tx.send(tid, rx.endpoint, s_ids, timeout_s=10)
    got = await handle.wait()
    assert res.state is expect, res.error
    if expect is TransferState.DONE:
        assert got.state is TransferState.DONE, got.error
        assert torch.equal(dst[d_ids], src[s_ids])
    return res


def test_sequential_transfers_share_one_connection():
    async def main():
        src, dst = cache(SMALL, 16, seed=1), cache(SMALL, 16)
        rx, tx = await _tcp_pair(src, dst)
        for rep in range(5):
            await _round_trip(rx, tx, f"seq{rep}", src, dst, [rep, 7, 3 + rep], [9, rep, 15])
            dst.zero_()
        assert rx.channel.connections_accepted == 1
        assert tx.channel.pool.idle(rx.endpoint) == 1
        await tx.close()
        assert tx.channel.pool.idle(rx.endpoint) == 0
        await rx.close()

    run(main())


def test_concurrent_transfers_take_their_own_connections_and_keep_them():
    async def main():
        src, dst = cache(SMALL, 32, seed=2), cache(SMALL, 32)
        rx, tx = await _tcp_pair(src, dst)
        for wave in range(2):
            handles = [rx.expect(f"c{wave}-{i}", [i * 4 + k for k in range(4)], 10)
                       for i in range(4)]
            results = await asyncio.gather(*(
                tx.send(f"c{wave}-{i}", rx.endpoint, [16 + i * 4 + k for k in range(4)], 10)
                for i in range(4)))
            assert all(r.state is TransferState.DONE for r in results)
            got = await asyncio.gather(*(h.wait() for h in handles))
            assert all(g.state is TransferState.DONE for g in got)
            assert torch.equal(dst[:16], src[16:32])
            dst.zero_()
        assert rx.channel.connections_accepted == 4  # the second wave reused the first one's
        assert tx.channel.pool.idle(rx.endpoint) == 4
        await tx.close()
        await rx.close()

    run(main())


def test_a_failed_transfer_closes_its_connection():
    """A rejected transfer (the receiver expects no such id) fails with the receiver's
    reason and its connection is not kept; the next transfer connects anew and lands."""
    async def main():
        src, dst = cache(SMALL, 16, seed=3), cache(SMALL, 16)
        rx, tx = await _tcp_pair(src, dst)
        await _round_trip(rx, tx, "ok1", src, dst, [1, 2], [3, 4])
        res = await tx.send("nobody-expects-this", rx.endpoint, [1, 2], timeout_s=10)
        assert res.state is TransferState.FAILED and "nobody-expects-this" in res.error
        assert tx.channel.pool.idle(rx.endpoint) == 0
        await _round_trip(rx, tx, "ok2", src, dst, [5, 6], [7, 8])
        assert rx.channel.connections_accepted == 2
        await tx.close()
        await rx.close()

    run(main())


def test_a_restarted_receiver_gets_a_new_connection():
    """The pooled connection points at a receiver that exited; a new one listens on the same
    port: the next send notices the old connection is closed and connects again."""
    async def main():
        src, dst = cache(SMALL, 16, seed=4), cache(SMALL, 16)
        rx, tx = await _tcp_pair(src, dst)
        port = int(rx.endpoint.rsplit(":", 1)[1])
        await _round_trip(rx, tx, "before", src, dst, [1], [2])
        await rx.close()
        await asyncio.sleep(0.05)  # the receiver's FIN reaches the pooled socket
        rx2 = make_receiver("tcp", dst, SMALL, listen=ListenAddress(port=port))
        await rx2.start()
        await _round_trip(rx2, tx, "after", src, dst, [3, 4], [5, 6])
        assert rx2.channel.connections_accepted == 1
        await tx.close()
        await rx2.close()

    run(main())


def test_a_receiver_closes_idle_connections_and_the_sender_reconnects(monkeypatch):
    monkeypatch.setattr(control, "RECEIVER_IDLE_S", 0.2)

    async def main():
        src, dst = cache(SMALL, 16, seed=5), cache(SMALL, 16)
        rx, tx = await _tcp_pair(src, dst)
        await _round_trip(rx, tx, "first", src, dst, [1], [2])
        await asyncio.sleep(0.5)  # past the receiver's idle limit
        assert tx.channel.pool.idle(rx.endpoint) == 1  # the sender has not looked yet
        await _round_trip(rx, tx, "second", src, dst, [3], [4])
        assert rx.channel.connections_accepted == 2
        await tx.close()
        await rx.close()

    run(main())


def test_pool_ages_out_and_caps_idle_connections():
    pool = ConnectionPool(idle_s=0.1, per_endpoint=2)
    pairs = [socket.socketpair() for _ in range(3)]
    for a, _ in pairs:
        a.setblocking(False)
        pool.give("tcp://h:1", a)
    assert pool.idle("tcp://h:1") == 2 and pairs[2][0].fileno() == -1  # the third closed
    assert pool.take("tcp://h:1") is pairs[1][0]  # the most recently used first
    pool.give("tcp://h:1", pairs[1][0])
    pairs[1][1].close()  # the peer of the newest one hung up: skipped and closed
    assert pool.take("tcp://h:1") is pairs[0][0]
    pool.give("tcp://h:1", pairs[0][0])
    pairs[0][1].send(b"x")  # bytes out of protocol: not reusable
    assert pool.take("tcp://h:1") is None and pool.idle("tcp://h:1") == 0
    c, d = socket.socketpair()
    c.setblocking(False)
    pool.give("tcp://h:1", c)
    time.sleep(0.15)
    assert pool.take("tcp://h:1") is None and c.fileno() == -1  # too old
    assert pool.take("tcp://other:2") is None
    for a, b in pairs:
        a.close()
        b.close()
    d.close()


@pytest.mark.parametrize("eager", [False, True])
def test_one_sided_senders_reuse_connections_too(eager):
    """The GPU backends' skeleton (the loopback backend of test_kvtransfer_control): with
    and without the eager payload behind HELLO, transfers after the first reuse its
    connection and land exactly."""
    from tests.unit.test_kvtransfer_control import (loopback_receiver, loopback_sender,
                                                    one_sided_loopback_sender)

    async def main():
        src, dst = cache(SMALL, 16, seed=6), cache(SMALL, 16)
        rx = loopback_receiver(dst, SMALL)
        await rx.start()
        tx = (one_sided_loopback_sender if eager else loopback_sender)(src, SMALL)
        for rep in range(3):
            await _round_trip(rx, tx, f"l{rep}", src, dst, [rep, 9], [12, rep + 1])
            dst.zero_()
        assert rx.channel.connections_accepted == 1
        await tx.close()
        await rx.close()

    run(main())
