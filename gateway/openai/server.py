"""uvicorn serving the HTTP front on the running event loop (the gateway's uvloop, beside
the gRPC server). The gateway owns the signals: uvicorn's own handlers are not installed, and
:meth:`HttpServer.stop` ends it after the gRPC server's shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

logger = logging.getLogger(__name__)


def _server_class():
    import uvicorn  # here, not at import: a gateway with --http-port 0 never loads it

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the gateway's GrpcServer handles SIGTERM / SIGINT
            yield
    return uvicorn, _Server


class HttpServer:
    def __init__(self, app, *, host: str, port: int, grace_s: float = 5.0) -> None:
        self.host, self.port = host, port
        uvicorn, server_cls = _server_class()
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None,
                                timeout_graceful_shutdown=max(grace_s, 0.1),
                                timeout_keep_alive=30, http="auto", loop="none")
        self.server = server_cls(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind (errors here, before anything is served) and serve; returns the port."""
        host = self.host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, self.port), family=family, backlog=2048)
        except OSError as e:
            raise OSError(f"could not bind the HTTP API to {self.host}:{self.port}: "
                          f"{e.strerror}") from None
        port = sock.getsockname()[1]
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not self._task.done():
            await asyncio.sleep(0.005)
        if self._task.done():
            self._task.result()  # raises what stopped it
        return port

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await self._task
        except Exception:  # noqa: BLE001 - shutting down: log, never mask the caller's exit
            logger.exception("HTTP server ended with an error")


async def start_front(settings, env, keys, grpc_server) -> HttpServer | None:
    """The gateway's HTTP front from its settings, serving (None when ``http_port`` is 0).
    While the gRPC server shuts down, /health answers 503."""
    if not settings.http_port:
        return None
    from gateway.openai.app import HttpFront
    front = HttpFront(env, keys=keys, served_model_name=settings.served_model_name,
                      request_timeout_s=settings.request_timeout_s,
                      max_body_bytes=settings.http_max_body_bytes)
    srv = HttpServer(front.app(), host=settings.host, port=settings.http_port,
                     grace_s=settings.grace_s)
    srv.port = await srv.start()
    grpc_server.add_shutdown_hook(lambda: setattr(front, "draining", True))
    return srv
