"""kvtransfer/aead.py: the KV connection's AES-GCM records after its mutual-TLS handshake,
over real sockets: the switch from TLS, bytes in order across record and read boundaries,
and every record an attacker on the wire could alter, replay, reorder or reflect refused."""
from __future__ import annotations

import os
import select
import socket
import ssl
import threading

import pytest

from kvtransfer import aead
from services import tls as T


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return T.write_cluster_files(str(tmp_path_factory.mktemp("ca")))


def _tls_pair(files):
    """(client, server) blocking TLS sockets over loopback TCP, handshaken with the cluster's
    prefill / decode certificates."""
    ls = socket.create_server(("127.0.0.1", 0))
    out = {}

    def serve():
        raw, _ = ls.accept()
        raw.settimeout(10)
        ident = T.ClusterTls(files.ca_file, files.cert("decode"), files.key("decode"))
        out["server"] = ident.server_context().wrap_socket(raw, server_side=True)
    t = threading.Thread(target=serve)
    t.start()
    raw = socket.create_connection(ls.getsockname(), timeout=10)
    ident = T.ClusterTls(files.ca_file, files.cert("prefill"), files.key("prefill"))
    client = ident.client_context().wrap_socket(raw, server_hostname=ident.server_hostname)
    t.join()
    ls.close()
    return client, out["server"]


def _switched(files):
    client, server = _tls_pair(files)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("s", aead.switch(server, True)))
    t.start()
    c = aead.switch(client, False)
    t.join()
    return c, out["s"]


def _send_all(sock: aead.AeadSocket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
        except ssl.SSLWantWriteError:
            select.select([], [sock.fileno()], [], 5)
            continue
        view = view[n:]


def _recv(sock: aead.AeadSocket, n: int, piece: int = 1 << 16) -> bytes:
    out = bytearray()
    while len(out) < n:
        buf = bytearray(min(piece, n - len(out)))
        try:
            k = sock.recv_into(memoryview(buf))
        except ssl.SSLWantReadError:
            select.select([sock.fileno()], [], [], 5)
            continue
        assert k, "end of stream"
        out += buf[:k]
    return bytes(out)


def test_switch_from_tls_then_bytes_in_order_both_ways(cluster):
    c, s = _switched(cluster)
    try:
        # a record larger than one read, reads that straddle records, a record larger than
        # MAX_RECORD split by send, and a bulk read that takes whole records directly
        payload = os.urandom(aead.MAX_RECORD + 12345) + b"end"
        t = threading.Thread(target=_send_all, args=(c, payload))
        t.start()
        assert _recv(s, len(payload), piece=100_000) == payload
        t.join()
        back = os.urandom(3 * aead.MAX_RECORD)
        t = threading.Thread(target=_send_all, args=(s, back))
        t.start()
        assert _recv(c, len(back), piece=aead.MAX_RECORD) == back
        t.join()
    finally:
        c.close()
        s.close()


def test_end_of_stream_reads_as_zero(cluster):
    c, s = _switched(cluster)
    _send_all(c, b"last words")
    c.raw.shutdown(socket.SHUT_WR)
    assert _recv(s, 10) == b"last words"
    select.select([s.fileno()], [], [], 5)
    assert s.recv_into(memoryview(bytearray(16))) == 0
    c.close()
    s.close()


def _record_pair():
    """Two record sockets on a socketpair with a known key pair, and the raw wire between
    them: ``wire`` is the receiver's peer end, so a test writes what an attacker would."""
    a, b = socket.socketpair()
    k1, k2 = os.urandom(16), os.urandom(16)
    tx = aead.AeadSocket(a, k1, k2)
    rx = aead.AeadSocket(b, k2, k1)
    for x in (a, b):
        x.setblocking(False)
    return tx, rx


def _sealed(tx: aead.AeadSocket, data: bytes) -> bytes:
    """The bytes ``tx`` puts on the wire for one record of ``data`` (read off its peer)."""
    _send_all(tx, data)
    return bytes(tx._out[:aead.HEADER + len(data) + aead.TAG])


def _read_error(rx: aead.AeadSocket) -> Exception:
    select.select([rx.fileno()], [], [], 5)
    with pytest.raises(aead.RecordError) as e:
        rx.recv_into(memoryview(bytearray(1 << 16)))
    return e.value


def test_a_record_altered_on_the_wire_is_refused():
    tx, rx = _record_pair()
    record = bytearray(_sealed(tx, b"k" * 1000))
    rx.raw.recv(1 << 20)  # drop the genuine copy: the attacker sends its own
    record[aead.HEADER + 17] ^= 1
    tx.raw.send(bytes(record))
    assert "integrity" in str(_read_error(rx))


def test_a_replayed_record_is_refused():
    tx, rx = _record_pair()
    record = _sealed(tx, b"once")
    assert _recv(rx, 4) == b"once"
    tx.raw.send(record)  # the same bytes again: the nonce has moved on
    _read_error(rx)


def test_reordered_records_are_refused():
    tx, rx = _record_pair()
    first = _sealed(tx, b"first")
    second = _sealed(tx, b"second")
    rx.raw.recv(1 << 20)
    tx.raw.send(second + first)
    _read_error(rx)


def test_a_record_reflected_to_its_sender_is_refused():
    tx, rx = _record_pair()
    record = _sealed(tx, b"mine")
    rx.raw.recv(1 << 20)
    rx.raw.send(record)  # back to tx: the other direction has its own key
    _read_error(tx)


def test_an_oversized_or_truncated_record_is_refused():
    tx, rx = _record_pair()
    tx.raw.send((aead.MAX_RECORD + 1).to_bytes(aead.HEADER, "big"))
    assert "at most" in str(_read_error(rx))
    tx2, rx2 = _record_pair()
    record = _sealed(tx2, b"x" * 100)
    rx2.raw.recv(1 << 20)
    tx2.raw.send(record[:50])
    tx2.raw.shutdown(socket.SHUT_WR)
    assert "ended inside" in str(_read_error(rx2))


def test_a_peer_of_another_record_version_is_refused(cluster):
    client, server = _tls_pair(cluster)
    t = threading.Thread(target=lambda: (server.sendall(bytes([aead.VERSION + 1])
                                                        + os.urandom(32)), server.recv(33)))
    t.start()
    with pytest.raises(ConnectionRefusedError, match="version"):
        aead.switch(client, False)
    t.join()
    client.close()
    server.close()
