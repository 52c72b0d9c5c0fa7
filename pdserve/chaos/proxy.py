"""A TCP proxy in front of one port, for network faults without root or namespaces.

Modes (changeable while connections are open):
  ``pass``       forward both ways
  ``delay``      forward each chunk after ``delay_ms`` (each direction)
  ``blackhole``  accept and keep connections, forward nothing (a partition whose peers see no
                 reset: only their keepalives tell)
  ``refuse``     close every connection, new or open (a host that resets)
The proxy runs its own event loop on a thread, so synchronous test code can drive it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

MODES = ("pass", "delay", "blackhole", "refuse")


class ChaosProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int = 0,
                 host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.host, self.port = host, port
        self.mode, self.delay_s = "pass", 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None
        self._main: asyncio.Task | None = None

    def start(self) -> int:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name="chaos-proxy")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("chaos proxy did not start")
        return self.port

    def _run(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()

        async def main():
            self._main = asyncio.current_task()
            self._server = await asyncio.start_server(self._accept, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            async with self._server:
                await self._server.serve_forever()

        try:
            self._loop.run_until_complete(main())
        except (asyncio.CancelledError, RuntimeError):
            pass

    def set_mode(self, mode: str, delay_ms: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.delay_s = mode, delay_ms / 1000
        if mode == "refuse" and self._loop is not None:
            self._loop.call_soon_threadsafe(self._close_all)

    def _close_all(self) -> None:
        for w in list(self._conns):
            w.transport.abort()

    async def _accept(self, reader, writer) -> None:
        if self.mode == "refuse":
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._conns |= {writer, up_w}
        try:
            await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer),
                                 return_exceptions=True)
        except asyncio.CancelledError:
            pass
        for w in (writer, up_w):
            self._conns.discard(w)
            w.transport.abort()

    async def _pump(self, reader, writer) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            if self.mode == "blackhole":
                continue  # swallowed: nothing reaches the other side
            if self.mode == "delay" and self.delay_s:
                await asyncio.sleep(self.delay_s)
            writer.write(data)
            await writer.drain()

    def stop(self) -> None:
        if self._loop is None or not self._loop.is_running():
            return

        async def shut():  # the connections first; the server task (main) keeps the loop up
            self._close_all()
            others = [t for t in asyncio.all_tasks()
                      if t is not asyncio.current_task() and t is not self._main]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:  # a loaded machine may take a while; the proxy's loop stops either way
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(15)
        except (TimeoutError, concurrent.futures.TimeoutError):
            pass
        if self._server is not None:  # ends serve_forever, so run_until_complete returns
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._main.cancel)
        if self._thread is not None:
            self._thread.join(15)
