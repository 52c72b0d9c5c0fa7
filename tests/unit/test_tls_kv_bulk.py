"""kvtransfer/secure.py's bulk path over real sockets: tcp's blocks go through the TLS pump
straight from / into the backend's memory (sendall, recv_exactly), in stream order with
what went over the plain socket before, and a cancelled read no longer writes into its
memory."""
from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from kvtransfer import secure
from services import tls as T
from tests.unit.kvtransfer_helpers import run


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return T.write_cluster_files(str(tmp_path_factory.mktemp("ca")))


def _ident(files, role):
    return T.ClusterTls(files.ca_file, files.cert(role), files.key(role))


async def _pair(files):
    """A connected (sender, receiver) pair of plain sockets, each behind a TLS pump."""
    loop = asyncio.get_running_loop()
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    ls.setblocking(False)
    tx_pumps, rx_pumps = secure.Pumps(), secure.Pumps()

    async def accept():
        raw, _ = await loop.sock_accept(ls)
        return await secure.accept(_ident(files, "decode"), rx_pumps, raw)
    acc = asyncio.ensure_future(accept())
    tx = await secure.connect(_ident(files, "prefill"), tx_pumps, "127.0.0.1",
                              ls.getsockname()[1], lambda s: s.setblocking(False))
    rx = await acc
    ls.close()
    return tx, rx, (tx_pumps, rx_pumps)


def _tampering_proxy(target: tuple, flip_at: int) -> socket.socket:
    """A listener that forwards one connection to ``target`` and flips one bit of the
    client-to-target stream at byte ``flip_at`` (an attacker on the wire, after the TLS
    handshake and inside the records)."""
    ps = socket.create_server(("127.0.0.1", 0))

    def pipe(src, dst, flip):
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip is not None and seen <= flip < seen + len(data):
                    data = bytearray(data)
                    data[flip - seen] ^= 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s_ in (src, dst):
            try:
                s_.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def serve():
        client, _ = ps.accept()
        upstream = socket.create_connection(target)
        threading.Thread(target=pipe, args=(upstream, client, None), daemon=True).start()
        pipe(client, upstream, flip_at)
    threading.Thread(target=serve, daemon=True).start()
    return ps


async def _recv_n(loop, sock, n):
    out = bytearray()
    while len(out) < n:
        chunk = await loop.sock_recv(sock, n - len(out))
        assert chunk, "end of stream"
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_bulk_bytes_keep_stream_order_with_plain_socket_bytes(cluster, loop_kind):
    payload = os.urandom(9 << 20) + b"tail"

    async def main():
        loop = asyncio.get_running_loop()
        tx, rx, pumps = await _pair(cluster)
        try:
            # plain bytes, then a bulk write, then plain bytes again
            await loop.sock_sendall(tx, b"HEAD")
            send = asyncio.ensure_future(secure.sendall(loop, tx, memoryview(payload)))
            assert await _recv_n(loop, rx, 2) == b"HE"  # part of the header read plainly
            await asyncio.sleep(0.2)  # the pump forwards payload into the socketpair meanwhile
            region = bytearray(2 + len(payload))
            seen = []
            async with asyncio.timeout(20):  # bytes skipped or stuck: never full
                got = await secure.recv_exactly(loop, rx, region, seen.append)
                await send
            assert got == len(region) and sum(seen) == got
            assert bytes(region) == b"AD" + payload  # the socketpair's, the pump's, TLS's
            await loop.sock_sendall(tx, b"END")
            assert await _recv_n(loop, rx, 3) == b"END"
            # the other way round too, and an empty bulk write
            await secure.sendall(loop, rx, b"")
            await secure.sendall(loop, rx, memoryview(payload)[:1 << 20])
            back = bytearray(1 << 20)
            assert await secure.recv_exactly(loop, tx, back, lambda n: None) == 1 << 20
            assert bytes(back) == payload[:1 << 20]
        finally:
            tx.close()
            rx.close()
            for p in pumps:
                await p.close()
    run(main(), loop_kind)


def test_bulk_read_ends_short_at_end_of_stream_and_a_closed_peer_fails_a_write(cluster):
    async def main():
        loop = asyncio.get_running_loop()
        tx, rx, pumps = await _pair(cluster)
        try:
            await secure.sendall(loop, tx, b"x" * 1000)
            tx.close()  # the sender goes away mid-"transfer"
            region = bytearray(1 << 20)
            async with asyncio.timeout(10):
                assert await secure.recv_exactly(loop, rx, region, lambda n: None) == 1000
            with pytest.raises(OSError):
                async with asyncio.timeout(10):
                    for _ in range(64):  # the peer is gone: a write fails, it does not hang
                        await secure.sendall(loop, rx, b"y" * (1 << 20))
        finally:
            rx.close()
            for p in pumps:
                await p.close()
    run(main(), "uvloop")


def test_a_cancelled_bulk_read_no_longer_writes_into_its_memory(cluster):
    async def main():
        loop = asyncio.get_running_loop()
        tx, rx, pumps = await _pair(cluster)
        try:
            region = bytearray(4 << 20)
            read = asyncio.ensure_future(secure.recv_exactly(loop, rx, region, lambda n: None))
            await secure.sendall(loop, tx, b"a" * (1 << 20))
            await asyncio.sleep(0.3)
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            snapshot = bytes(region)
            assert snapshot[:1 << 20] == b"a" * (1 << 20)
            await secure.sendall(loop, tx, b"b" * (1 << 20))
            # the stream goes on over the plain socket: nothing lands in the old region
            assert await _recv_n(loop, rx, 1 << 20) == b"b" * (1 << 20)
            assert bytes(region) == snapshot
        finally:
            tx.close()
            rx.close()
            for p in pumps:
                await p.close()
    run(main(), "uvloop")


def test_a_record_tampered_on_the_wire_fails_that_connection_only(cluster):
    """A bit flipped inside a record (past the handshake) ends that connection: its bulk read
    fails within seconds instead of succeeding or hanging, while another connection's
    transfer at the same time completes intact. (The failed record may have been decrypted
    into the region before its tag was checked: a failed read's bytes are never used.)"""
    payload = os.urandom(8 << 20)

    async def main():
        loop = asyncio.get_running_loop()
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(2)
        ls.setblocking(False)
        ps = _tampering_proxy(ls.getsockname(), flip_at=5 << 20)
        tx_pumps, rx_pumps = secure.Pumps(), secure.Pumps()

        async def accept():
            raw, _ = await loop.sock_accept(ls)
            return await secure.accept(_ident(cluster, "decode"), rx_pumps, raw)
        acc = asyncio.ensure_future(accept())
        bad_tx = await secure.connect(_ident(cluster, "prefill"), tx_pumps, "127.0.0.1",
                                      ps.getsockname()[1], lambda s: s.setblocking(False))
        bad_rx = await acc
        good_tx, good_rx, pumps = await _pair(cluster)
        try:
            bad_send = asyncio.ensure_future(secure.sendall(loop, bad_tx, payload))
            good_send = asyncio.ensure_future(secure.sendall(loop, good_tx, payload))
            bad_region, good_region = bytearray(len(payload)), bytearray(len(payload))
            async with asyncio.timeout(20):
                with pytest.raises(OSError):
                    got = await secure.recv_exactly(loop, bad_rx, bad_region, lambda n: None)
                    assert got < len(payload)  # a short read would do as well
                    raise ConnectionResetError("short")
                assert await secure.recv_exactly(loop, good_rx, good_region,
                                                 lambda n: None) == len(payload)
                await good_send
            assert bytes(good_region) == payload
            bad_send.cancel()
            await asyncio.gather(bad_send, return_exceptions=True)
        finally:
            for s_ in (bad_tx, bad_rx, good_tx, good_rx, ls, ps):
                s_.close()
            for p in (tx_pumps, rx_pumps, *pumps):
                await p.close()
    run(main(), "uvloop")


def test_plain_sockets_take_the_plain_path():
    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        try:
            data = os.urandom(3 << 20)
            send = asyncio.ensure_future(secure.sendall(loop, a, data))
            region = bytearray(len(data))
            seen = []
            assert await secure.recv_exactly(loop, b, region, seen.append) == len(data)
            await send
            assert bytes(region) == data and sum(seen) == len(data)
        finally:
            a.close()
            b.close()
    run(main(), "uvloop")
