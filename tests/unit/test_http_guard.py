"""The HTTP front's connection limits (gateway/openai/guard.py) over real loopback sockets:
request heads over the size limit get 431 before they are read in full, heads not complete
in time get 408 (idle and slowloris connections), connections over the limit get 503, and
none of it touches a well-behaved client or a large body behind a small head."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from gateway.openai.server import HttpServer

LIMITS = dict(max_header_bytes=8 * 1024, header_timeout_s=0.6, max_connections=4)


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    size = 0
    while True:
        msg = await receive()
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    body = f"ok {size}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server():
    loop = asyncio.new_event_loop()
    srv = HttpServer(_app, host="127.0.0.1", port=0, grace_s=0.5, **LIMITS)
    port = loop.run_until_complete(srv.start())
    import threading
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield port
    asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def _conn(port) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            b = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not b:
            break
        out += b
    return out


def _response(s: socket.socket) -> bytes:
    """One response (head + content-length body) from a keep-alive connection."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, _, body = buf.partition(b"\r\n\r\n")
    n = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length")))
    while len(body) < n:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _get(port, extra: bytes = b"", body: bytes = b"") -> bytes:
    s = _conn(port)
    head = (b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + extra
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
    s.sendall(head + body)
    out = _read_all(s)
    s.close()
    return out


def test_well_behaved_requests_and_a_large_body_pass(server):
    assert _get(server).startswith(b"HTTP/1.1 200")
    big = b"x" * (200 * 1024)  # far over the head limit, but it is a body
    out = _get(server, body=big)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(f"ok {len(big)}".encode())
    # keep-alive: two requests on one connection, the second's head counted afresh
    s = _conn(server)
    req = b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: " + b"p" * 6000 + b"\r\n\r\n"
    for _ in range(2):
        s.sendall(req)
        assert _response(s).startswith(b"HTTP/1.1 200")
    s.close()


def test_oversized_head_gets_431_before_it_is_read(server):
    s = _conn(server)
    s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: ")
    sent, refused = 0, False
    try:
        for _ in range(2000):  # up to 128 MiB: refused long before
            s.sendall(b"a" * 65536)
            sent += 65536
    except (BrokenPipeError, ConnectionResetError):
        refused = True
    out = _read_all(s)
    s.close()
    assert refused or out.startswith(b"HTTP/1.1 431"), out[:80]
    assert sent < 64 * 1024 * 1024
    t0 = time.monotonic()
    assert _get(server).startswith(b"HTTP/1.1 200")  # others unharmed
    assert time.monotonic() - t0 < 2.0


def test_idle_and_slow_heads_get_408(server):
    idle = _conn(server)
    slow = _conn(server)
    t0 = time.monotonic()
    slow.sendall(b"GET / HTTP/1.1\r\n")
    for ch in b"host: x\r\nx-a: bbbbbbbb":  # a byte every 50 ms: never finishes in time
        try:
            slow.send(bytes([ch]))
        except OSError:
            break
        time.sleep(0.05)
    for s in (idle, slow):
        out = _read_all(s)
        assert out.startswith(b"HTTP/1.1 408"), out[:80]
        s.close()
    assert time.monotonic() - t0 < 3.0
    # a keep-alive connection: the timer starts again with the next request's first byte
    s = _conn(server)
    s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert _response(s).startswith(b"HTTP/1.1 200")
    time.sleep(1.0)  # idle after a response: uvicorn's keep-alive (30 s) governs, not 408
    s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert _response(s).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET / HTTP/1.1\r\nhost")  # a head begun and left
    assert _read_all(s).startswith(b"HTTP/1.1 408")
    s.close()


def test_connections_over_the_limit_get_503(server):
    held = [_conn(server) for _ in range(LIMITS["max_connections"])]
    time.sleep(0.1)
    extra = _conn(server)
    out = _read_all(extra)
    assert out.startswith(b"HTTP/1.1 503"), out[:80]
    for s in held:
        s.close()
    # room again once the server saw them close (within seconds, however loaded the machine)
    deadline = time.monotonic() + 10
    while not (out := _get(server)).startswith(b"HTTP/1.1 200") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.startswith(b"HTTP/1.1 200"), out[:80]
