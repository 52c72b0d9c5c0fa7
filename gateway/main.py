"""Gateway process: settings -> router, prober and the request path's shared parts -> gRPC
server (uvloop). Shutdown: NOT_SERVING, drain, and streams still open near the end of the
grace period end with a final finish_reason."""
from __future__ import annotations

import asyncio
import json
import logging
import sys

from services.config import GatewaySettings
from pdcore.config_tree import redacted_flat
from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


def _router(settings: GatewaySettings, model_id: str, model_max_len: int, tls=None):
    """``tls``: the gateway's cluster identity; with it only signed registry entries count."""
    from gateway.router import Router
    from services.prefix_index import PrefixIndex
    from services.registry import WorkerRegistry
    registry = index = None
    if settings.redis_url:
        kw = dict(namespace=settings.namespace, timeout_s=settings.redis_timeout_s,
                  auth=settings.redis_auth())
        registry = WorkerRegistry(settings.redis_url, verifier=tls, **kw)
        index = PrefixIndex(settings.redis_url, model_id, **kw)
    return Router(model=model_id, block_size=settings.block_size,
                  prefix_weight=settings.prefix_weight, registry=registry, index=index,
                  static_prefill=settings.prefill_addrs, static_decode=settings.decode_addrs,
                  local_prefill_max_tokens=settings.local_prefill_max_tokens,
                  local_prefill_queue_tokens=settings.local_prefill_queue_tokens,
                  local_prefill_decode_tokens=settings.local_prefill_decode_tokens,
                  static_capacity=settings.static_capacity, queue_factor=settings.queue_factor,
                  model_max_len=model_max_len, registry_grace_s=settings.registry_grace_s)


def _env(settings: GatewaySettings, router, tokenizer, model_id: str, vocab_size: int,
         num_keys: int, metrics, tls=None):
    from gateway.admission import Admission
    from gateway.decode_calls import DecodeCalls
    from gateway.pipeline import GatewayEnv
    from gateway.tokenize import PromptTokenizer
    from protos.pdserve.v1 import worker_pb2_grpc
    from pdcore.block_hash import BlockHasher
    from services.grpc_server import ChannelPool
    return GatewayEnv(
        router=router,
        tokenizer=PromptTokenizer(tokenizer, threads=settings.tokenizer_threads,
                                  max_pending=settings.tokenizer_queue,
                                  on_pending=metrics.tokenize_pending.set),
        admission=Admission(num_keys=num_keys, max_concurrent=settings.key_max_concurrent,
                            seat_share=settings.key_max_seat_share,
                            tokens_per_s=settings.key_max_tokens_per_s),
        hasher=BlockHasher(settings.hash_seed, model_id, settings.block_size),
        metrics=metrics, limits=settings.limits, model=model_id, vocab_size=vocab_size,
        max_migrations=settings.max_migrations,
        decode=DecodeCalls(ChannelPool(worker_pb2_grpc.DecodeWorkerStub, tls=tls),
                           settings.decode_stream, on_draining=router.draining))


def _server(settings: GatewaySettings, keys, metrics):
    from services.auth import ApiKeyInterceptor
    from services.config import is_loopback
    from services.grpc_server import GATEWAY_SERVICE, GrpcServer
    from services.tls import client_port_credentials
    credentials = None
    if settings.client_tls_cert_file:
        credentials = client_port_credentials(settings.client_tls_cert_file,
                                              settings.client_tls_key_file,
                                              settings.client_tls_ca_file)
    elif not is_loopback(settings.host):
        logger.warning("client port %s:%d is plaintext: API keys and prompts travel in "
                       "clear (client_tls_cert_file turns TLS on)", settings.host,
                       settings.port)
    interceptors = []
    if keys:
        interceptors.append(ApiKeyInterceptor(
            keys, on_reject=lambda method: metrics.requests.labels("UNAUTHENTICATED").inc()))
        logger.info("client authentication on: %d API key(s)", len(keys))
    return GrpcServer([GATEWAY_SERVICE], host=settings.host, port=settings.port,
                      max_message_bytes=settings.max_message_bytes, grace_s=settings.grace_s,
                      drain_delay_s=settings.drain_delay_s, interceptors=interceptors,
                      credentials=credentials)


async def _check_redis_credentials(router) -> None:
    """A Redis that refuses the gateway's credentials at start: services.startup.StartError
    (exit 2), as a worker does; Redis down at start stays an outage it rides out (it
    routes to --decode-addrs, and to the registry's workers once Redis is back)."""
    from services.registry import RegistryUnavailable
    from services.startup import BAD_VALUE, StartError
    if router.registry is None:
        return
    try:
        await router.registry.list_workers(model=router.model)
    except RegistryUnavailable as e:
        if getattr(e, "credentials_refused", False):
            await router.registry.close()
            if router.index is not None:
                await router.index.close()
            raise StartError(f"{e} (check redis_url, redis_username, redis_password_file)",
                             BAD_VALUE) from None


async def serve_gateway(settings: GatewaySettings) -> None:
    from gateway.health import HealthProber
    from gateway.server import GatewayServicer
    from protos.pdserve.v1 import gateway_pb2_grpc
    from services.auth import load_api_keys
    from services.metrics import GatewayMetrics
    from services.tls import cluster_tls

    tls = cluster_tls(settings)
    model_id, mc, tokenizer = _model(settings)
    router = _router(settings, model_id, mc.max_position, tls)
    await _check_redis_credentials(router)
    await router.refresh()
    metrics = GatewayMetrics()
    prober = HealthProber(router, interval_s=settings.health_interval_s,
                          timeout_s=settings.health_timeout_s, failures=settings.health_failures,
                          tls=tls, late_counter=metrics.probes_late)
    await prober.probe_all()  # static workers: their capacity and context limit, at once
    metrics.watch_router(router)
    shown = redacted_flat(settings)
    metrics.export_config(shown)
    logger.info("gateway configuration: %s", json.dumps(shown))
    keys = load_api_keys(settings.api_keys, settings.api_key_file)
    env = _env(settings, router, tokenizer, model_id, mc.vocab_size, len(keys), metrics, tls)
    servicer = GatewayServicer(env, request_timeout_s=settings.request_timeout_s)
    srv = _server(settings, keys, metrics)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, srv.server)
    srv.add_grace_end_hook(lambda: env.end_all("shutdown"))
    tasks = _background(settings, router, prober)
    http = None
    try:
        http = await _listen(settings, srv, env, keys, metrics)
        await srv.wait_stopped()
    finally:
        await srv.abort()  # a start that failed midway (else stopped already: nothing)
        await (http.stop() if http else asyncio.sleep(0))
        await cancel_and_wait(tasks)
        await servicer.close()
        await prober.close()
        for c in (router.registry, router.index):
            if c is not None:
                await c.close()


def _model(settings: GatewaySettings):
    """(model id, model config, tokenizer) of ``settings.model``; a spec or folder that
    cannot be loaded: services.startup.StartError (exit 2)."""
    from engine.loader import load_config, load_tokenizer, resolve_spec
    from services.startup import StartError
    try:
        _, _, model_id = resolve_spec(settings.model)
        return model_id, load_config(settings.model), load_tokenizer(settings.model)
    except (ValueError, OSError) as e:
        logger.debug("the model did not load", exc_info=True)
        raise StartError(f"the model's configuration and tokenizer cannot be loaded: "
                         f"{e}") from None


async def _listen(settings: GatewaySettings, srv, env, keys, metrics):
    """Serve the gRPC port, the OpenAI HTTP API and /metrics, then print the READY line;
    returns the HTTP server (None: off). A port that cannot be bound:
    services.startup.StartError naming it (what this started is stopped again)."""
    from gateway.openai.server import start_front
    from services.metrics import serve_metrics
    from services.startup import binding
    with binding(*LISTENS["port"](settings)):
        await srv.start()
    with binding(*LISTENS["http_port"](settings)):
        http = await start_front(settings, env, keys, srv)
    try:
        srv.install_signal_handlers()
        with binding(*LISTENS["metrics_port"](settings)):
            mport = serve_metrics(metrics.registry, settings.metrics_port, settings.host,
                                  settings)
    except BaseException:
        await (http.stop() if http else asyncio.sleep(0))
        raise
    print(f"READY gateway {srv.address}" + (f" metrics={mport}" if mport else "")
          + (f" http={http.port}" if http else ""), flush=True)
    return http


def _background(settings: GatewaySettings, router, prober) -> list[asyncio.Task]:
    """The gateway's loops: registry refresh, health probes, heap trims, index reaping."""
    from services.memory import trim_periodically
    tasks = [asyncio.create_task(router.run_refresh(settings.refresh_s)),
             asyncio.create_task(prober.run()), asyncio.create_task(trim_periodically())]
    if router.index is not None:
        tasks.append(asyncio.create_task(router.index.run_reaper(settings.reaper_interval_s)))
    return tasks


# what the gateway listens on: setting -> settings -> (what, host, port) (port 0: off, but
# the gRPC port's 0 is any free port)
LISTENS = {
    "port": lambda s: ("the gRPC port: --host, --port", s.host, s.port),
    "http_port": lambda s: ("the HTTP port: --host, --http-port", s.host, s.http_port),
    "metrics_port": lambda s: ("the metrics port: --host, --metrics-port", s.host,
                               s.metrics_port),
}


def _check_files(settings: GatewaySettings) -> None:
    """Certificates, secrets and addresses usable before anything starts (ValueError or
    services.startup.StartError saying which is not)."""
    from services.startup import check_service
    check_service(settings, "gateway", "the gateway",
                  [LISTENS["port"](settings)]
                  + [LISTENS[n](settings) for n in ("http_port", "metrics_port")
                     if getattr(settings, n)])


def main(argv=None) -> int:
    from services.config import ConfigError, gateway_settings
    from services.grpc_server import run
    from services.logging_setup import setup_logging
    from services.startup import BAD_VALUE, StartError
    from services.telemetry import setup_tracing, shutdown_tracing
    try:
        settings = gateway_settings(argv)
        _check_files(settings)
    except StartError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_VALUE
    setup_logging("gateway", settings.log_level, settings.log_format)
    from services.memory import limit_arenas
    limit_arenas(settings.malloc_arenas)  # before any thread: see services/memory.py
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    setup_tracing("gateway")
    try:
        run(serve_gateway(settings))
    except StartError as e:  # a model, a port: one line, no traceback (services/startup.py)
        logger.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return e.status
    finally:
        shutdown_tracing()
    return 0
