"""Composition root of a worker process: engine + KV transfer + servicers for one role.

    prefill    PrefillWorker service, KV sender
    decode     DecodeWorker service, KV receiver (prefills locally only as a fallback)
    colocated  DecodeWorker + PrefillWorker services, receiver and sender: the baseline
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
import json
import logging
import sys

from services.config import WorkerSettings
from pdcore.config_tree import environ, redacted_flat
from services.grpc_server import DECODE_SERVICE, PREFILL_SERVICE, GrpcServer
from services.metrics import WorkerMetrics, serve_metrics
# StartError: the worker cannot start, one line, exit status 2 (a bad value) or 1 (a port
# in use); services/startup.py
from services.startup import BAD_VALUE, StartError, binding, engine_starting
from services.worker_runtime import WorkerRuntime, engine_config

logger = logging.getLogger(__name__)


async def serve_worker(settings: WorkerSettings, kv_options=None) -> None:
    """``kv_options``: :func:`kvtransfer.registry.options_from_env`'s pair (default: read
    from this process's environment)."""
    from decode_worker.servicer import DecodeServicer
    from engine.async_engine import AsyncEngine
    from engine.engine import LLMEngine
    from engine.quant.kv import PACKED_KV
    from kvtransfer import KVLayout, make_receiver, make_sender
    from kvtransfer.registry import options_from_env
    from prefill_worker.servicer import PrefillServicer
    from protos.pdserve.v1 import worker_pb2_grpc

    from services.tls import RoleInterceptor, cluster_tls

    role = settings.role
    shared, kv_opts = kv_options or options_from_env(environ())
    tls = cluster_tls(settings)  # before the engine loads: bad certificates fail fast
    if tls is not None:
        shared = replace(shared, tls=tls)
    # a model, plan or weights file it cannot use; a KV cache the memory cannot hold; the
    # device's own errors: StartError, one line (services/startup.py)
    with engine_starting():
        engine = LLMEngine(engine_config(settings))
    # the engine resolves what depends on the model and the device (dtype, KV cache size,
    # max_model_len): the configuration logged and exported is the one that runs
    settings = replace(settings, engine=engine.config)
    shown = redacted_flat(settings)
    logger.info("%s worker configuration: %s", role, json.dumps(shown))
    try:
        _check_parallel_kv(engine, settings)
    except ValueError as e:
        engine.close()  # its tensor-parallel ranks too
        raise StartError(str(e), BAD_VALUE) from None
    aengine = AsyncEngine(engine)
    await aengine.start()
    cache = engine.runner.kv_cache
    layout = KVLayout.from_cache(cache, settings.block_size, packed=PACKED_KV.get(cache.dtype))
    metrics = WorkerMetrics(role)
    metrics.export_config(shown)
    runtime = WorkerRuntime(settings, aengine, engine.model_id, metrics=metrics, tls=tls)

    services = []
    receivers: list = []  # (backend, receiver), preferred first
    senders: dict = {}
    decode = prefill = srv = watchdog = None
    try:  # whatever started is stopped again when a later part cannot start
        if role in ("decode", "colocated"):
            for i, backend in enumerate(settings.kv_backends):
                listen = _listen_address(settings, backend, i)
                receiver = make_receiver(backend, cache, layout, kv_opts[backend],
                                         shared=shared, listen=listen)
                if listen is None:
                    await receiver.start()
                else:
                    with binding(*_kv_listen(settings, i)):
                        await receiver.start()
                receivers.append((backend, receiver))
            decode = DecodeServicer(aengine, runtime, receivers, layout, settings,
                                    metrics=metrics, tls=tls)
            services.append(DECODE_SERVICE)
        # a colocated worker without KV backends (its default) prefills its own requests only
        if role == "prefill" or (role == "colocated" and settings.kv_backends):
            for backend in settings.kv_backends:
                senders[backend] = make_sender(backend, cache, layout, kv_opts[backend],
                                               shared=shared)
            services.append(PREFILL_SERVICE)

        srv = GrpcServer(services, host=settings.host, port=settings.port,
                         max_message_bytes=settings.max_message_bytes,
                         grace_s=settings.grace_s, drain_delay_s=settings.drain_delay_s,
                         interceptors=[RoleInterceptor()] if tls is not None else [],
                         credentials=tls.server_credentials() if tls is not None else None)
        if decode is not None:
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, srv.server)
            srv.add_grace_end_hook(decode.evict_all)  # the gateways resume them elsewhere
            srv.add_shutdown_hook(decode.stop_accepting)
        if senders:
            prefill = PrefillServicer(aengine, runtime, senders, layout, settings,
                                      metrics=metrics)
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, srv.server)
        with binding(*LISTENS["port"](settings)):
            port = await srv.start()
        address = settings.advertise_address(port)
        try:
            await runtime.start(address, tuple(r.endpoint for _, r in receivers))
        except Exception as e:
            if not getattr(e, "credentials_refused", False):
                raise
            raise StartError(f"{e} (check redis_url, redis_username, redis_password_file)",
                             BAD_VALUE) from None
        srv.add_shutdown_hook(runtime.stop)
        srv.install_signal_handlers()
        watchdog = asyncio.ensure_future(_watch_engine(engine, aengine, srv))
        with binding(*LISTENS["metrics_port"](settings)):
            mport = serve_metrics(metrics.registry, settings.metrics_port, settings.host,
                                  settings)
        print(f"READY {role} {address} worker_id={runtime.worker_id}"
              + (f" metrics={mport}" if mport else ""), flush=True)
        logger.info("%s worker %s serving %s on %s", role, runtime.worker_id,
                    engine.model_id, address)
        await srv.wait_stopped()
    finally:
        if srv is not None:
            await srv.abort()  # a start that failed midway (else stopped already: nothing)
        if watchdog is not None:
            watchdog.cancel()
        if prefill is not None:
            await prefill.drain()
        await aengine.stop()
        if decode is not None:
            await decode.close()
        for _, receiver in receivers:
            await receiver.close()
        for s in senders.values():
            await s.close()


# what a worker listens on: setting -> settings -> (what, host, port)
LISTENS = {
    "port": lambda s: ("the gRPC port: --host, --port", s.host, s.port),
    "metrics_port": lambda s: ("the metrics port: --host, --metrics-port", s.host,
                               s.metrics_port),
}


def _kv_listen(settings: WorkerSettings, index: int) -> tuple[str, str, int]:
    """The ``index``-th KV receiver's (what, host, port) (a fixed --kv-port counts up)."""
    return ("the KV receiver port: --kv-host, --kv-port", settings.kv_host or settings.host,
            settings.kv_port + index if settings.kv_port else 0)


def _listens(settings: WorkerSettings) -> list[tuple[str, str, int]]:
    """Every (what, host, port) the worker will listen on, to check before its engine
    loads (port 0: any free port, so only the host is checked)."""
    from kvtransfer import registry
    out = [LISTENS["port"](settings)]
    if settings.metrics_port:
        out.append(LISTENS["metrics_port"](settings))
    if settings.role in ("decode", "colocated"):
        out += [_kv_listen(settings, i) for i, backend in enumerate(settings.kv_backends)
                if registry.spec(backend).listener]
    return out


def _check_parallel_kv(engine, settings: WorkerSettings) -> None:
    """A tensor-parallel engine on GPUs keeps each rank's KV heads on that rank's GPU, so
    rank 0's cache holds only its heads: moving it would send part of every block. Refused
    until the gather/scatter over the ranks' GPUs exists (issue 28). (On the CPU the ranks
    share one cache of every head: any TP size sends and receives whole blocks.)"""
    lo, hi = engine.kv_heads
    if settings.kv_backends and (lo, hi) != (0, engine.model_config.num_kv_heads):
        raise ValueError(f"tensor_parallel_size {engine.config.tensor_parallel_size} on "
                         f"{engine.config.device}: KV transfer of a per-GPU sharded cache is "
                         "not built yet (issue 28); run this worker colocated without "
                         "kv_backends, or on the CPU")


async def _watch_engine(engine, aengine, srv, period_s: float = 0.25) -> None:
    """End the worker once its engine cannot go on (a tensor-parallel rank exited or hangs,
    a step failed): requests in flight already ended with UNAVAILABLE (the gateways resume
    them elsewhere); stopping deregisters this worker and stops every rank."""
    while True:
        await asyncio.sleep(period_s)
        why = engine.failure or (repr(aengine.dead) if aengine.dead is not None else None)
        if why is not None:
            logger.error("engine failed (%s): shutting the worker down", why)
            srv.stop(grace_s=1.0)
            return


def _listen_address(settings: WorkerSettings, backend: str, index: int):
    """Where the ``index``-th receiver listens (a fixed --kv-port counts up); None for a
    backend that listens on no TCP port."""
    from kvtransfer import ListenAddress, registry
    from pdcore.hostport import bare_host

    if not registry.spec(backend).listener:  # data or control over a TCP listener
        return None
    _, host, port = _kv_listen(settings, index)
    # what prefill workers dial: never a wildcard bind address (compose, Kubernetes)
    return ListenAddress(bare_host(host), port, settings.advertised_host(),
                         settings.kv_advertise_port + index if settings.kv_advertise_port
                         else 0)


def main(argv=None, role: str = "colocated") -> int:
    from services.config import ConfigError, worker_settings
    from services.grpc_server import run
    from services.logging_setup import setup_logging
    from services.telemetry import setup_tracing, shutdown_tracing
    from kvtransfer.registry import options_from_env
    from services.startup import check_service
    try:
        settings = worker_settings(argv, role=role)
        kv_options = options_from_env(environ())
        # certificates, secrets and addresses, before the engine loads (which may be long)
        check_service(settings, settings.role, f"a {settings.role} worker",
                      _listens(settings))
    except StartError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_VALUE
    setup_logging(f"{settings.role}-worker", settings.log_level, settings.log_format)
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    setup_tracing(settings.role)
    try:
        run(serve_worker(settings, kv_options))
    except StartError as e:
        logger.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return e.status
    finally:
        shutdown_tracing()
    return 0
