"""Bootstrap shared by every pdserve gRPC service (grpc.aio).

Every server gets ``grpc.health.v1.Health`` (SERVING for "" and each service name once started),
server reflection (for the given service names, Health and reflection itself) and message size
limits. Shutdown, on SIGTERM/SIGINT or :meth:`GrpcServer.stop`:

1. health -> NOT_SERVING for everything (load balancers and gateways stop sending new work);
2. shutdown hooks run (e.g. deregister from the Redis registry);
3. ``drain_delay_s`` passes while RPCs are still accepted (time for peers to notice);
4. ``server.stop(grace_s)``: no new RPCs; in-flight ones get up to ``grace_s`` to finish, then
   they are cancelled.

A second signal during shutdown stops at once (grace 0).

Typical use::

    async def main():
        srv = GrpcServer([GATEWAY_SERVICE], port=cfg.port, grace_s=cfg.grace_s)
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, srv.server)
        srv.add_shutdown_hook(heartbeat.stop)
        await srv.serve()          # returns after a signal and a complete shutdown

    run(main())
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
import logging
import signal
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.pdserve.v1 import gateway_pb2, worker_pb2
from services.interceptors import MalformedRequestInterceptor

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_S = 1.0
KEEPALIVE_TIMEOUT_S = 2.0
# a connection attempt (TCP + TLS + HTTP/2 settings) gives up after this; gRPC's default,
# 20 s, held every call to a stopped peer that long (its kernel still accepts the TCP
# connection, the handshake never ends)
CONNECT_TIMEOUT_S = KEEPALIVE_S + KEEPALIVE_TIMEOUT_S
# the longest wait between attempts to reach a peer that went away
MAX_RECONNECT_S = CONNECT_TIMEOUT_S

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
DECODE_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel/server options shared by servers and the clients between services."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # a peer that stops answering (SIGSTOP, a partition, a dead host whose TCP does not
        # reset) fails its calls within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S, on a connection
        # open or being opened: pings every second on every connection, servers accept
        # pings that often, and a connection attempt ends after CONNECT_TIMEOUT_S
        ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.http2.min_time_between_pings_ms", int(KEEPALIVE_S * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000)),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 500)),
        ("grpc.http2.max_ping_strikes", 0),
        # gRPC core uses the minimum reconnect backoff as each connection attempt's deadline
        ("grpc.min_reconnect_backoff_ms", int(CONNECT_TIMEOUT_S * 1000)),
        # and grows the wait between attempts up to 120 s by default: a worker restarted on
        # the address of one that died was then not dialled again for 30-40 s while it
        # served (probes failed fast on the backed-off channel). Retry at least this often:
        ("grpc.initial_reconnect_backoff_ms", int(KEEPALIVE_S * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_S * 1000)),
    ]


class GrpcServer:
    def __init__(self, service_names: Sequence[str], *, host: str = "0.0.0.0", port: int = 0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, grace_s: float = 5.0,
                 drain_delay_s: float = 0.0,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None):
        """``credentials``: serve TLS with them (services/tls.py: mutual TLS between
        services, or the gateway's client-port certificate); None: plaintext."""
        if grace_s < 0 or drain_delay_s < 0:
            raise ValueError("grace_s and drain_delay_s must be >= 0")
        self.service_names = list(service_names)
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.grace_s = grace_s
        self.drain_delay_s = drain_delay_s
        self.credentials = credentials
        # innermost: a malformed request is refused before any handler (or a refusing
        # interceptor's handler) sees it
        # no SO_REUSEPORT: a second server on a port already served fails to bind, instead
        # of both taking turns at its connections
        self.server = grpc.aio.server(options=[*grpc_options(max_message_bytes),
                                               ("grpc.so_reuseport", 0)],
                                      interceptors=[*interceptors, MalformedRequestInterceptor()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self._hooks: list[Callable[[], Awaitable[None] | None]] = []
        self._grace_hooks: list[Callable[[], Awaitable[None] | None]] = []
        self._stop_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        self._signals_installed: list[int] = []

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        from pdcore.hostport import join_host_port
        return join_host_port(self.host, self.port)

    def add_shutdown_hook(self, fn: Callable[[], Awaitable[None] | None]) -> None:
        """``fn`` (sync or async) runs once during shutdown, after health turns NOT_SERVING."""
        self._hooks.append(fn)

    def add_grace_end_hook(self, fn: Callable[[], Awaitable[None] | None]) -> None:
        """``fn`` runs when the grace period is nearly over and RPCs are still in flight:
        it should end them with a final status (the server would cancel them otherwise)."""
        self._grace_hooks.append(fn)

    async def start(self) -> int:
        """Bind, start and mark every service SERVING. Returns the bound port."""
        from pdcore.hostport import join_host_port
        bind = join_host_port(self.host, self.requested_port)
        try:
            if self.credentials is not None:
                self.port = self.server.add_secure_port(bind, self.credentials)
            else:
                self.port = self.server.add_insecure_port(bind)
        except RuntimeError:  # gRPC says only "Failed to bind" (services.startup says why)
            self.port = 0
        if not self.port:
            raise OSError(f"could not bind gRPC server to {bind}")
        await self.server.start()
        for name in ("", *self.service_names):
            await self.health.set(name, SERVING)
        logger.info("gRPC server on %s (%s) serving %s", self.address,
                    "TLS" if self.credentials is not None else "plaintext",
                    ", ".join(self.service_names))
        return self.port

    async def set_serving(self, serving: bool, service: str = "") -> None:
        """Flip health of one service (or overall, "") without shutting down."""
        await self.health.set(service, SERVING if serving else NOT_SERVING)

    def stop(self, grace_s: float | None = None) -> asyncio.Task:
        """Begin the shutdown sequence (idempotent); await the returned task to wait for it."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._shutdown(grace_s))
        return self._stop_task

    async def _shutdown(self, grace_s: float | None) -> None:
        grace = self.grace_s if grace_s is None else grace_s
        logger.info("shutting down %s: NOT_SERVING, drain %.1fs, grace %.1fs",
                    self.address if self.port else "(unbound)", self.drain_delay_s, grace)
        try:
            await self.health.enter_graceful_shutdown()
            await _run_hooks(self._hooks)
            if self.drain_delay_s:
                await asyncio.sleep(self.drain_delay_s)
            stopping = asyncio.ensure_future(self.server.stop(grace))
            if self._grace_hooks and grace > 0:
                # stop() returns early once every RPC ended; if some are still open near the
                # end of the grace period, the hooks end them with a final status
                margin = min(1.0, grace / 4)
                await asyncio.wait({stopping}, timeout=grace - margin)
                if not stopping.done():
                    await _run_hooks(self._grace_hooks)
            await stopping
        finally:
            self._remove_signal_handlers()
            self._stopped.set()
            logger.info("gRPC server stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    async def abort(self) -> None:
        """Stop at once (a start that failed before it served): the shutdown hooks run
        (deregister, ...), no drain, no grace; idempotent."""
        if self._stopped.is_set():
            return
        if self._stop_task is not None:  # a shutdown under way: let it end, at once
            await self.server.stop(0)
            await self._stop_task
            return
        try:
            await self.health.enter_graceful_shutdown()
            await _run_hooks(self._hooks)
            await self.server.stop(0)
        finally:
            self._remove_signal_handlers()
            self._stopped.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: graceful stop; a second one: stop now (grace 0). A Ctrl-C that
        came while the service started (and that something on the way swallowed) stops it
        here, before it serves."""
        from services.startup import check_interrupted
        check_interrupted()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals_installed.append(sig)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals_installed:
            loop.remove_signal_handler(sig)
        self._signals_installed.clear()

    def _on_signal(self, sig: int) -> None:
        if self._stop_task is None:
            logger.info("received %s", signal.Signals(sig).name)
            self.stop()
        else:
            logger.warning("received %s again: stopping now", signal.Signals(sig).name)
            asyncio.ensure_future(self.server.stop(0))

    async def serve(self) -> None:
        """Start (if needed), handle signals, return after the shutdown completed."""
        if self.port is None:
            await self.start()
        self.install_signal_handlers()
        await self.wait_stopped()


async def _run_hooks(hooks) -> None:
    for hook in hooks:
        try:
            res = hook()
            if asyncio.iscoroutine(res):
                await res
        except Exception:
            logger.exception("shutdown hook %r failed", hook)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a service's main coroutine on uvloop (falling back to asyncio's loop).

    Ctrl-C while the service starts stops the start where it is (KeyboardInterrupt: the
    command exits 130; what started is closed by the ``finally`` blocks on the way out);
    once the service installed its own handlers (:meth:`GrpcServer.install_signal_handlers`)
    it drains instead. asyncio.Runner's own handler is kept out
    (services.startup.catch_interrupts): it turned the first Ctrl-C into a cancellation that
    the start's next await received wherever it was, in the middle of the gRPC server's
    start (an InvalidStateError traceback) or in a call that swallowed it (the worker went
    on to serve)."""
    from services.startup import catch_interrupts, check_interrupted
    try:
        import uvloop
        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency; kept for odd platforms
        factory = None
    catch_interrupts()
    try:
        check_interrupted()
    except KeyboardInterrupt:
        main.close()  # never started: no "was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


class ChannelPool:
    """One client channel per peer address, shared by every call to that peer.

    With ``tls`` (a :class:`services.tls.ClusterTls`) channels are mutual TLS: this
    service's certificate, the cluster CA, and the peer must show a certificate for the
    cluster name (whatever address was dialled). When the certificate files are rotated,
    the next call to a peer opens a new channel with the new ones; the old channel stays
    open for the calls still on it (closed with the pool)."""

    def __init__(self, stub_cls: type, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls=None):
        self.stub_cls = stub_cls
        self.max_message_bytes = max_message_bytes
        self.options = grpc_options(max_message_bytes)
        self.tls = tls
        self._channels: dict[str, tuple[grpc.aio.Channel, int]] = {}
        self._retired: list[grpc.aio.Channel] = []

    def channel(self, address: str) -> grpc.aio.Channel:
        entry = self._channels.get(address)
        if self.tls is None:
            if entry is None:
                entry = (grpc.aio.insecure_channel(address, options=self.options), 0)
                self._channels[address] = entry
            return entry[0]
        generation = self.tls.material().generation
        if entry is None or entry[1] != generation:
            if entry is not None:
                self._retired.append(entry[0])
            creds, generation = self.tls.channel_credentials()
            entry = (grpc.aio.secure_channel(
                address, creds,
                options=[*self.options,
                         ("grpc.ssl_target_name_override", self.tls.server_hostname)]),
                generation)
            self._channels[address] = entry
        return entry[0]

    def stub(self, address: str):
        return self.stub_cls(self.channel(address))

    async def close(self) -> None:
        channels = [ch for ch, _ in self._channels.values()] + self._retired
        self._channels, self._retired = {}, []
        for ch in channels:
            await ch.close()
