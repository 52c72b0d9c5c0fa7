"""The chaos kit's TCP proxy (pdserve/chaos/proxy.py) over real loopback sockets: it relays,
swallows, refuses, and stops promptly with connections open (its stop used to cancel its own
server task, which could end the loop before the shutdown finished: a 5 s hang)."""
from __future__ import annotations

import socket
import threading
import time

from pdserve.chaos.proxy import ChaosProxy


def _echo_server() -> int:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve(conn):
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept():
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv.getsockname()[1]


def test_proxy_relays_blackholes_refuses_and_stops_promptly_with_open_connections():
    port = _echo_server()
    for _ in range(10):
        proxy = ChaosProxy(port)
        p = proxy.start()
        conn = socket.create_connection(("127.0.0.1", p), timeout=5)
        conn.sendall(b"ping")
        assert conn.recv(16) == b"ping"
        proxy.set_mode("blackhole")
        conn.sendall(b"lost")
        conn.settimeout(0.2)
        try:
            got = conn.recv(16)
        except socket.timeout:
            got = None
        assert got is None
        proxy.set_mode("refuse")
        with socket.create_connection(("127.0.0.1", p), timeout=5) as other:
            other.settimeout(5)
            try:
                assert other.recv(16) == b""  # closed by the proxy
            except ConnectionResetError:
                pass
        t0 = time.monotonic()
        proxy.stop()
        assert time.monotonic() - t0 < 3
        assert not proxy._thread.is_alive()
        conn.close()
