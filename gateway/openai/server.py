"""uvicorn serving the HTTP front on the running event loop (the gateway's uvloop, beside
the gRPC server). The gateway owns the signals: uvicorn's own handlers are not installed, and
:meth:`HttpServer.stop` ends it after the gRPC server's shutdown.

TLS: the same client-facing settings as the gRPC client port (``client_tls_cert_file``,
``client_tls_key_file``, and with ``client_tls_ca_file`` a client certificate of that CA is
required), so both ports serve one certificate. As on the gRPC port the files are re-read
when they change (checked at most once a second, on a new connection's handshake)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time

from services.tls import files_stamp

logger = logging.getLogger(__name__)


def _server_class():
    import uvicorn  # here, not at import: a gateway with --http-port 0 never loads it

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the gateway's GrpcServer handles SIGTERM / SIGINT
            yield
    return uvicorn, _Server


class ReloadingTls:
    """The HTTP port's TLS: a server context of the certificate, key and optional client CA,
    rebuilt when one of the files changed (checked at most every ``check_s`` on a handshake;
    a rebuild that fails keeps the previous context and logs why)."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str = "",
                 check_s: float = 1.0) -> None:
        self.files = tuple(f for f in (cert_file, key_file, ca_file) if f)
        self.cert_file, self.key_file, self.ca_file = cert_file, key_file, ca_file
        self.check_s = check_s
        self._stamp = self._stat()
        self._checked = time.monotonic()
        self.current = self._build()  # raises at start on bad material
        self.context = self._build()  # what the listener holds: swaps per handshake
        self.context.sni_callback = self._pick

    def _stat(self) -> tuple:
        return files_stamp(self.files)

    def _build(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.ca_file:
            ctx.load_verify_locations(self.ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def _pick(self, sslobj: ssl.SSLObject, _name, _ctx) -> None:
        now = time.monotonic()
        if now - self._checked >= self.check_s:
            self._checked = now
            stamp = self._stat()
            if stamp != self._stamp:
                try:
                    self.current = self._build()
                    self._stamp = stamp
                    logger.info("HTTP port: certificate reloaded")
                except (OSError, ssl.SSLError, ValueError) as e:
                    logger.warning("HTTP port: certificate reload failed, keeping the "
                                   "previous one: %s", e)
        sslobj.context = self.current


class HttpServer:
    def __init__(self, app, *, host: str, port: int, grace_s: float = 5.0,
                 tls: ReloadingTls | None = None, max_header_bytes: int = 64 * 1024,
                 header_timeout_s: float = 10.0, max_connections: int = 8192) -> None:
        """The last three: what a connection may hold before its request head is in
        (gateway/openai/guard.py)."""
        from gateway.openai.guard import guarded_protocol
        self.host, self.port = host, port
        self.tls = tls
        uvicorn, server_cls = _server_class()
        ssl_kw = {}
        if tls is not None:  # uvicorn's settings, and the context that follows the files
            ssl_kw = dict(ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file,
                          ssl_ca_certs=tls.ca_file or None,
                          ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca_file else ssl.CERT_NONE,
                          ssl_context_factory=lambda _config, _default: tls.context)
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None,
                                timeout_graceful_shutdown=max(grace_s, 0.1),
                                timeout_keep_alive=30, loop="none", **ssl_kw,
                                http=guarded_protocol(max_header_bytes, header_timeout_s,
                                                      max_connections))
        self.server = server_cls(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind (errors here, before anything is served) and serve; returns the port."""
        host = self.host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, self.port), family=family, backlog=2048)
        except OSError as e:
            raise OSError(e.errno, f"could not bind the HTTP API to {self.host}:{self.port}: "
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


def raise_open_files(connections: int, spare: int = 4096) -> None:
    """Raise this process's soft limit on open files towards ``connections`` + ``spare``
    (gRPC channels, Redis, tokenizer files), within the hard limit; say so when it falls
    short, since the connection limit then cannot be reached."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + spare
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit to %d: %s", want, e)
    if soft != resource.RLIM_INFINITY and soft < connections + spare:
        logger.warning("open-file limit %d is below http_max_connections %d + %d: new "
                       "connections may fail before the limit refuses them", soft,
                       connections, spare)


async def start_front(settings, env, keys, grpc_server) -> HttpServer | None:
    """The gateway's HTTP front from its settings, serving (None when ``http_port`` is 0).
    While the gRPC server shuts down, /health answers 503."""
    if not settings.http_port:
        return None
    from gateway.openai.app import HttpFront
    front = HttpFront(env, keys=keys, served_model_name=settings.served_model_name,
                      request_timeout_s=settings.request_timeout_s,
                      max_body_bytes=settings.http_max_body_bytes,
                      body_timeout_s=settings.http_body_timeout_s)
    tls = None
    if settings.client_tls_cert_file:  # the gRPC client port's settings: one certificate
        tls = ReloadingTls(settings.client_tls_cert_file, settings.client_tls_key_file,
                           settings.client_tls_ca_file)
    raise_open_files(settings.http_max_connections)
    srv = HttpServer(front.app(), host=settings.host, port=settings.http_port,
                     grace_s=settings.grace_s, tls=tls,
                     max_header_bytes=settings.http_max_header_bytes,
                     header_timeout_s=settings.http_header_timeout_s,
                     max_connections=settings.http_max_connections)
    srv.port = await srv.start()
    if tls is None:
        from services.config import is_loopback
        if not is_loopback(settings.host):
            logger.warning("HTTP port %s:%d is plaintext: API keys and prompts travel in "
                           "clear (client_tls_cert_file turns TLS on)", settings.host,
                           srv.port)
    grpc_server.add_shutdown_hook(lambda: setattr(front, "draining", True))
    return srv
