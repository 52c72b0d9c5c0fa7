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
from services.worker_runtime import WorkerRuntime, engine_config

logger = logging.getLogger(__name__)


class StartError(Exception):
    """The worker cannot start for a reason its settings name (one line, exit status 2)."""


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
    try:
        engine = LLMEngine(engine_config(settings))
    except (ValueError, OSError) as e:  # a model, plan or weights file it cannot use
        logger.debug("the engine did not start", exc_info=True)
        raise StartError(f"the engine cannot start: {e}") from None
    # the engine resolves what depends on the model and the device (dtype, KV cache size,
    # max_model_len): the configuration logged and exported is the one that runs
    settings = replace(settings, engine=engine.config)
    shown = redacted_flat(settings)
    logger.info("%s worker configuration: %s", role, json.dumps(shown))
    _check_parallel_kv(engine, settings)
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
    decode = None
    if role in ("decode", "colocated"):
        for i, backend in enumerate(settings.kv_backends):
            receiver = make_receiver(backend, cache, layout, kv_opts[backend], shared=shared,
                                     listen=_listen_address(settings, backend, i))
            await receiver.start()
            receivers.append((backend, receiver))
        decode = DecodeServicer(aengine, runtime, receivers, layout, settings, metrics=metrics,
                                tls=tls)
        services.append(DECODE_SERVICE)
    # a colocated worker without KV backends (its default) prefills its own requests only
    if role == "prefill" or (role == "colocated" and settings.kv_backends):
        for backend in settings.kv_backends:
            senders[backend] = make_sender(backend, cache, layout, kv_opts[backend],
                                           shared=shared)
        services.append(PREFILL_SERVICE)

    srv = GrpcServer(services, host=settings.host, port=settings.port,
                     max_message_bytes=settings.max_message_bytes, grace_s=settings.grace_s,
                     drain_delay_s=settings.drain_delay_s,
                     interceptors=[RoleInterceptor()] if tls is not None else [],
                     credentials=tls.server_credentials() if tls is not None else None)
    if decode is not None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, srv.server)
        srv.add_grace_end_hook(decode.evict_all)  # the gateways resume them elsewhere
    prefill = None
    if senders:
        prefill = PrefillServicer(aengine, runtime, senders, layout, settings, metrics=metrics)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, srv.server)
    port = await srv.start()
    address = settings.advertise_address(port)
    await runtime.start(address, tuple(r.endpoint for _, r in receivers))
    srv.add_shutdown_hook(runtime.stop)
    srv.install_signal_handlers()
    watchdog = asyncio.ensure_future(_watch_engine(engine, aengine, srv))
    mport = serve_metrics(metrics.registry, settings.metrics_port, settings.host,
                          settings)
    print(f"READY {role} {address} worker_id={runtime.worker_id}"
          + (f" metrics={mport}" if mport else ""), flush=True)
    logger.info("%s worker %s serving %s on %s", role, runtime.worker_id, engine.model_id, address)
    try:
        await srv.wait_stopped()
    finally:
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

    if not registry.spec(backend).listener:  # data or control over a TCP listener
        return None
    # what prefill workers dial: never a wildcard bind address (compose, Kubernetes)
    return ListenAddress(settings.kv_host or settings.host,
                         settings.kv_port + index if settings.kv_port else 0,
                         settings.advertise_address(1).rpartition(":")[0],
                         settings.kv_advertise_port + index if settings.kv_advertise_port
                         else 0)


def main(argv=None, role: str = "colocated") -> int:
    from services.config import ConfigError, worker_settings
    from services.grpc_server import run
    from services.logging_setup import setup_logging
    from services.telemetry import setup_tracing, shutdown_tracing
    from kvtransfer.registry import options_from_env
    try:
        settings = worker_settings(argv, role=role)
        kv_options = options_from_env(environ())
        if settings.tls_cert_file:
            from services.tls import cluster_tls
            tls = cluster_tls(settings)  # readable, signed by the CA, carrying a role
            if tls.role != settings.role:
                raise ValueError(f"{settings.tls_cert_file} is a {tls.role} certificate; "
                                 f"a {settings.role} worker needs a {settings.role} one")
        settings.redis_auth()  # the password file is readable
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(f"{settings.role}-worker", settings.log_level, settings.log_format)
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    setup_tracing(settings.role)
    try:
        run(serve_worker(settings, kv_options))
    except StartError as e:
        logger.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()
    return 0
