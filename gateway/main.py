"""Gateway process: settings -> router + servicer -> gRPC server (uvloop)."""
from __future__ import annotations

import asyncio
import logging
import sys

from services.config import GatewaySettings
from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


async def serve_gateway(settings: GatewaySettings) -> None:
    from engine.loader import load_config, load_tokenizer, resolve_spec
    from gateway.router import Router
    from gateway.server import GatewayServicer
    from protos.pdserve.v1 import gateway_pb2_grpc
    from services.auth import ApiKeyInterceptor, load_api_keys
    from pdcore.block_hash import BlockHasher
    from services.grpc_server import GATEWAY_SERVICE, GrpcServer
    from services.metrics import GatewayMetrics, serve_metrics
    from services.prefix_index import PrefixIndex
    from services.registry import WorkerRegistry

    _, _, model_id = resolve_spec(settings.model)
    mc = load_config(settings.model)
    tokenizer = load_tokenizer(settings.model)
    registry = index = None
    if settings.redis_url:
        kw = dict(namespace=settings.namespace, timeout_s=settings.redis_timeout_s)
        registry = WorkerRegistry(settings.redis_url, **kw)
        index = PrefixIndex(settings.redis_url, model_id, **kw)
    router = Router(model=model_id, block_size=settings.block_size,
                    prefix_weight=settings.prefix_weight, registry=registry, index=index,
                    static_prefill=settings.prefill_addrs, static_decode=settings.decode_addrs,
                    local_prefill_max_tokens=settings.local_prefill_max_tokens,
                    local_prefill_queue_tokens=settings.local_prefill_queue_tokens,
                    local_prefill_decode_tokens=settings.local_prefill_decode_tokens)
    await router.refresh()
    metrics = GatewayMetrics()
    metrics.watch_router(router)
    servicer = GatewayServicer(router, tokenizer, model=model_id, vocab_size=mc.vocab_size,
                               max_model_len=mc.max_position,
                               hasher=BlockHasher(settings.hash_seed, model_id, settings.block_size),
                               request_timeout_s=settings.request_timeout_s, metrics=metrics)
    interceptors = []
    keys = load_api_keys(settings.api_keys, settings.api_key_file)
    if keys:
        interceptors.append(ApiKeyInterceptor(
            keys, on_reject=lambda method: metrics.requests.labels("UNAUTHENTICATED").inc()))
        logger.info("client authentication on: %d API key(s)", len(keys))
    srv = GrpcServer([GATEWAY_SERVICE], host=settings.host, port=settings.port,
                     max_message_bytes=settings.max_message_bytes, grace_s=settings.grace_s,
                     drain_delay_s=settings.drain_delay_s, interceptors=interceptors)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, srv.server)
    tasks = [asyncio.create_task(router.run_refresh(settings.refresh_s))]
    if index is not None:
        tasks.append(asyncio.create_task(index.run_reaper(settings.reaper_interval_s)))
    port = await srv.start()
    srv.install_signal_handlers()
    mport = serve_metrics(metrics.registry, settings.metrics_port, settings.host)
    print(f"READY gateway {settings.host}:{port}" + (f" metrics={mport}" if mport else ""),
          flush=True)
    try:
        await srv.wait_stopped()
    finally:
        await cancel_and_wait(tasks)
        await servicer.close()
        for c in (registry, index):
            if c is not None:
                await c.close()


def main(argv=None) -> int:
    from services.config import ConfigError, gateway_settings
    from services.grpc_server import run
    from services.logging_setup import setup_logging
    from services.telemetry import setup_tracing, shutdown_tracing
    try:
        settings = gateway_settings(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging("gateway", settings.log_level, settings.log_format)
    setup_tracing("gateway")
    try:
        run(serve_gateway(settings))
    finally:
        shutdown_tracing()
    return 0
