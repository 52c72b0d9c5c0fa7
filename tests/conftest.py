"""Shared fixtures: a private redis-server per test, free ports.

``redis_proc`` starts ``redis-server`` on a free port (never 6379) with ``--save ""
--appendonly no`` and yields a :class:`RedisProcess`; tests may ``kill()`` it (SIGKILL, like a
crash) and ``start()`` it again on the same port (it comes back empty). ``redis_server`` is the
same process's URL (``redis://127.0.0.1:PORT/0``); ask for both to kill/restart it.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 5.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")
            time.sleep(0.01)


class RedisProcess:
    def __init__(self, port: int | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found on PATH")
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.running:
            return
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(self.port)
        except TimeoutError:
            self.kill()
            raise

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash) and wait until the port is closed."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.proc = None


@pytest.fixture
def redis_proc():
    server = RedisProcess()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(redis_proc: RedisProcess) -> str:
    return redis_proc.url
