"""The KV connection's records after its mutual-TLS handshake: AES-128-GCM over the bare TCP
socket, in records of up to 4 MiB instead of TLS's 16 KiB ones.

Why: Python's ssl moves at most one 16 KiB TLS record per call, with two reads per record, so
on the 2-core machine TLS 1.3 carried 0.41x of plaintext while AES-GCM itself ran at 3.5 GB/s
a core; sealing whole 4 MiB pieces carried 1.05x (bench/tls_ceiling_cpu.py, set cpu-2core).

How (:func:`switch`, on the blocking TLS socket the pump's handshake produced, after the
peer's certificate was checked):

1. each side sends its version byte and 32 random bytes inside TLS and reads the peer's
   (a peer of another version is refused);
2. both derive two keys with HKDF-SHA256 from the two randoms (client's first), one per
   direction ("c2s" / "s2c"), so a record cannot be reflected back to its sender;
3. both end TLS (``unwrap``: close_notify each way) and go on over the same TCP connection.

A record is ``length`` (4 bytes, big-endian, the plaintext's) then the sealed plaintext and
its 16-byte tag; the nonce is the direction's record counter (never sent, never repeated
under a key: a key lives for one connection), the length header is the associated data. A
record that fails its tag (tampered, reordered, replayed, injected) ends the connection
(:class:`RecordError`). Secrecy and integrity are those of the TLS handshake that carried
the randoms: only the two authenticated peers hold the keys.

:class:`AeadSocket` has the few members of a non-blocking ``ssl.SSLSocket`` that the pump
(kvtransfer/tls_pump.py) uses, with the same conventions: ``recv_into`` / ``send`` raise
``ssl.SSLWantReadError`` / ``ssl.SSLWantWriteError`` when they must wait, a write that had
to wait is retried with the same bytes, ``recv_into`` returns 0 at the end of the stream.
A record whose plaintext fits the caller's buffer is decrypted straight into it (a bulk
read of KV blocks: the kernel's copy, then one AES-GCM pass). AES-GCM checks the tag after
decrypting, so a record that fails it may already stand in that buffer: the read then
fails (RecordError ends the connection) and a failed transfer's blocks are never used, as
with a tcp block whose checksum fails; a decrypt into a scratch buffer and a copy would
keep them out at the cost of a second pass over every byte.
"""
from __future__ import annotations

import os
import socket
import ssl

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.exceptions import InvalidTag

VERSION = 1
RANDOM_BYTES = 32
MAX_RECORD = 4 << 20  # most plaintext bytes a record holds
TAG = 16
HEADER = 4

__all__ = ["AeadSocket", "RecordError", "switch", "MAX_RECORD"]


class RecordError(ssl.SSLError):
    """A record failed its tag or its header: the connection is not to be trusted."""


def _keys(client_random: bytes, server_random: bytes) -> tuple[bytes, bytes]:
    out = []
    for info in (b"pdserve kv c2s", b"pdserve kv s2c"):
        out.append(HKDF(algorithm=hashes.SHA256(), length=16, salt=b"pdserve-kv-aead-v1",
                        info=info).derive(client_random + server_random))
    return out[0], out[1]


def _recv_exact(tls: ssl.SSLSocket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = tls.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("the peer closed during the KV key exchange")
        buf += chunk
    return buf


def switch(tls: ssl.SSLSocket, server_side: bool) -> "AeadSocket":
    """Steps 1-3 of the module docstring on a blocking, handshaken ``tls`` (its timeout
    bounds every wait); the non-blocking record socket over the same TCP connection."""
    mine = bytes([VERSION]) + os.urandom(RANDOM_BYTES)
    tls.sendall(mine)
    theirs = _recv_exact(tls, 1 + RANDOM_BYTES)
    if theirs[0] != VERSION:
        raise ConnectionRefusedError(f"the peer speaks KV record version {theirs[0]}, "
                                     f"this worker {VERSION}")
    client, server = (theirs, mine) if server_side else (mine, theirs)
    c2s, s2c = _keys(client[1:], server[1:])
    raw = tls.unwrap()
    raw.setblocking(False)
    send_key, recv_key = (s2c, c2s) if server_side else (c2s, s2c)
    return AeadSocket(raw, send_key, recv_key)


class AeadSocket:
    """Records over the bare socket ``raw`` (non-blocking): see the module docstring."""

    def __init__(self, raw: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.raw = raw
        self._seal, self._open = AESGCM(send_key), AESGCM(recv_key)
        self._sent = self._received = 0  # record counters: the nonces
        # writing: one sealed record at a time, and the plaintext bytes it stands for
        self._out = bytearray(HEADER + MAX_RECORD + TAG)
        self._out_view: memoryview | None = None
        self._out_plain = 0
        # reading: the record under way (header, then body + tag), then its plaintext
        self._head = bytearray(HEADER)
        self._head_got = 0
        self._body = bytearray(MAX_RECORD + TAG)
        self._body_len = -1  # plaintext length of the record being read; -1: in the header
        self._body_got = 0
        self._plain = bytearray(MAX_RECORD)
        self._plain_start = self._plain_end = 0

    def fileno(self) -> int:
        return self.raw.fileno()

    def pending(self) -> int:
        """Decrypted bytes not yet returned by ``recv_into``."""
        return self._plain_end - self._plain_start

    def close(self) -> None:
        self.raw.close()

    # -------------------------------------------------------------------- writing
    def send(self, data) -> int:
        """Seal up to MAX_RECORD bytes of ``data`` as one record and write it; the number of
        plaintext bytes it carried once all of it went out (SSLWantWriteError before)."""
        if self._out_view is None:
            n = min(len(data), MAX_RECORD)
            if not n:
                return 0  # an empty record would read as the end of the stream
            header = n.to_bytes(HEADER, "big")
            self._out[:HEADER] = header
            self._seal.encrypt_into(self._nonce(self._sent), memoryview(data)[:n], header,
                                    memoryview(self._out)[HEADER:HEADER + n + TAG])
            self._sent += 1
            self._out_view = memoryview(self._out)[:HEADER + n + TAG]
            self._out_plain = n
        while self._out_view:
            try:
                k = self.raw.send(self._out_view)
            except BlockingIOError:
                raise ssl.SSLWantWriteError("the socket is full") from None
            self._out_view = self._out_view[k:]
        self._out_view = None
        return self._out_plain

    # -------------------------------------------------------------------- reading
    def recv_into(self, view) -> int:
        """Up to ``len(view)`` plaintext bytes; 0 at the end of the stream (between
        records); SSLWantReadError while a record is incomplete."""
        if self.pending():
            return self._give(view)
        while True:
            if self._body_len < 0:
                if not self._read(memoryview(self._head)[self._head_got:], "_head_got"):
                    return 0
                if self._head_got < HEADER:
                    continue
                n = int.from_bytes(self._head, "big")
                if n > MAX_RECORD:
                    raise RecordError(f"a KV record of {n} bytes (at most {MAX_RECORD})")
                self._body_len, self._body_got = n, 0
            body = memoryview(self._body)[:self._body_len + TAG]
            if self._body_got < len(body):
                if not self._read(body[self._body_got:], "_body_got"):
                    raise RecordError("the KV connection ended inside a record")
                continue
            n, self._body_len, self._head_got = self._body_len, -1, 0
            view = view if isinstance(view, memoryview) else memoryview(view)
            direct = len(view) >= n
            target = view[:n] if direct else memoryview(self._plain)[:n]
            try:
                self._open.decrypt_into(self._nonce(self._received), body, n.to_bytes(
                    HEADER, "big"), target)
            except InvalidTag:
                raise RecordError("a KV record failed its integrity check") from None
            self._received += 1
            if not n:
                continue  # (none is sent: send() writes no empty record)
            if direct:
                return n
            self._plain_start, self._plain_end = 0, n
            return self._give(view)

    def _read(self, into: memoryview, counter: str) -> bool:
        """One non-blocking read into ``into``; False at the end of the stream."""
        try:
            k = self.raw.recv_into(into)
        except BlockingIOError:
            raise ssl.SSLWantReadError("no record yet") from None
        if not k:
            if counter == "_head_got" and self._head_got:
                raise RecordError("the KV connection ended inside a record header")
            return False
        setattr(self, counter, getattr(self, counter) + k)
        return True

    def _give(self, view) -> int:
        n = min(len(view), self.pending())
        view[:n] = memoryview(self._plain)[self._plain_start:self._plain_start + n]
        self._plain_start += n
        return n

    @staticmethod
    def _nonce(counter: int) -> bytes:
        return counter.to_bytes(12, "big")
