"""Prometheus metrics of every service, served on an HTTP ``/metrics`` port (``--metrics-port``,
0 = off). Names and meanings are listed in docs/metrics.md; every name starts with ``pdserve_``.

Each service builds one object over its own registry (tests build several in one process)::

    m = GatewayMetrics()             # or WorkerMetrics(role)
    port = serve_metrics(m.registry, settings.metrics_port)

Latencies are recorded by :class:`RequestTimer` (gateway side: what a client sees):
TTFT = first token - request start; inter-token latency = gap between two streamed tokens
(a message carrying k tokens counts k gaps of gap/k); TPOT = (end - first token) / (tokens - 1);
end-to-end = end - start.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 1.0, 2.5)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
ROUTE_MODES = ("prefix", "load", "load_only", "colocated", "local_prefill")


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0",
                  settings=None) -> int | None:
    """Serve ``registry`` on http://host:port/metrics in a daemon thread; None when port is 0.
    With ``settings.metrics_tls_cert_file`` (and _key_file) it is https, and with
    ``metrics_tls_ca_file`` only a scraper with a client certificate of that CA gets in."""
    if not port:
        return None
    from pdcore.hostport import bare_host
    host = bare_host(host)  # [::1] -> ::1: what sockets take
    cert = getattr(settings, "metrics_tls_cert_file", "")
    if cert:
        ca = settings.metrics_tls_ca_file
        start_http_server(port, addr=host, registry=registry, certfile=cert,
                          keyfile=settings.metrics_tls_key_file, client_cafile=ca or None,
                          client_auth_required=bool(ca))
    else:
        start_http_server(port, addr=host, registry=registry)
    return port


def export_config(registry: CollectorRegistry, settings: dict[str, str]) -> Info:
    """``pdserve_config_info``: one sample whose labels are the service's resolved settings
    (flat names; secrets already redacted by the caller, pdcore.config_tree.redacted_flat)."""
    info = Info("pdserve_config", "The resolved configuration this service runs with (one "
                "label per setting, secrets redacted)", registry=registry)
    info.info({k: str(v) for k, v in settings.items()})
    return info


def route_mode(route) -> str:
    """How a gateway route was chosen: colocated, local_prefill (the decode worker prefills a
    short prompt because its prefill worker was backed up), load_only (index down), prefix (a
    predicted prefix hit decided the prefill worker) or load (no hit anywhere: least loaded)."""
    if route.prefill is None:
        return "local_prefill" if route.local else "colocated"
    if not route.index_ok:
        return "load_only"
    return "prefix" if route.cached_tokens > 0 else "load"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Finished gateway requests by gRPC status "
                                "code", ["code"], registry=r)
        self.inflight = Gauge("pdserve_inflight_requests", "Requests open at the gateway",
                              registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of routed requests",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens",
                                         "Tokens streamed to clients", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Mean time per output "
                              "token after the first, per request", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between two streamed "
                             "tokens", buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request start to last "
                             "token", buckets=LATENCY_BUCKETS, registry=r)
        self.routes = Counter("pdserve_routing_decisions", "Routing decisions by mode",
                              ["mode"], registry=r)
        self.routed_prompt_tokens = Counter("pdserve_routed_prompt_tokens", "Prompt tokens "
                                            "routed (denominator of the as-routed hit rate)",
                                            registry=r)
        self.routed_cached_tokens = Counter("pdserve_routed_cached_tokens", "Prompt tokens "
                                            "the router predicted cached on the chosen worker",
                                            registry=r)
        self.redis_up = Gauge("pdserve_redis_up", "1 when the registry and the prefix index "
                              "answered at the last attempt, else 0", registry=r)
        self.workers = Gauge("pdserve_workers", "Workers known to the gateway", ["role"],
                             registry=r)
        self.pending_prefill_tokens = Gauge(
            "pdserve_pending_prefill_tokens", "Uncached prompt tokens this gateway sent to "
            "be prefilled (by prefill workers, or by decode workers prefilling locally) whose "
            "first token has not come back yet (all workers)",
            registry=r)
        self.migrations = Counter("pdserve_request_migrations", "Requests resumed on another "
                                  "decode worker after the one streaming them failed, by "
                                  "what failed (code of the broken stream, or 'lost': the "
                                  "worker stopped answering its probes)", ["reason"],
                                  registry=r)
        self.workers_unhealthy = Gauge("pdserve_workers_unhealthy", "Workers failing their "
                                       "health probes (routed around)", registry=r)
        self.workers_draining = Gauge("pdserve_workers_draining", "Decode workers shutting "
                                      "down: no new requests, their streams finish there",
                                      registry=r)
        self.probes_late = Counter("pdserve_health_probes_late", "Health probes that timed "
                                   "out while the worker's decode streams delivered: not "
                                   "counted against it (a worker too busy to answer in "
                                   "time)", registry=r)
        self.tokenize_pending = Gauge("pdserve_tokenize_pending", "Prompts being tokenized "
                                      "or waiting for a tokenizer thread", registry=r)
        self.rejections = Counter("pdserve_admission_rejections", "Requests refused before "
                                  "routing, by reason (key_concurrency, key_rate, "
                                  "tokenizer_queue, capacity)", ["reason"], registry=r)
        self.http_requests = Counter("pdserve_http_requests", "Answers of the OpenAI HTTP "
                                     "front by route (chat, completion, models, other) and "
                                     "HTTP status", ["route", "status"], registry=r)
        for mode in ROUTE_MODES:
            self.routes.labels(mode)  # exported as 0 before the first decision

    def export_config(self, settings: dict[str, str]) -> None:
        export_config(self.registry, settings)

    def watch_router(self, router) -> None:
        """Redis availability, worker counts and pending prefill tokens read from ``router``
        at scrape time."""
        self.redis_up.set_function(lambda: float(router.registry_ok and router.index_ok))
        for role in ("prefill", "decode", "colocated"):
            self.workers.labels(role).set_function(
                lambda role=role: sum(1 for w in list(router.workers.values())
                                      if w.info.role == role))
        self.pending_prefill_tokens.set_function(
            lambda: sum(w.pending_prefill_tokens for w in list(router.workers.values())))
        self.workers_unhealthy.set_function(
            lambda: sum(1 for w in list(router.workers.values()) if not w.healthy))
        self.workers_draining.set_function(
            lambda: sum(1 for w in list(router.workers.values()) if w.draining))

    def routed(self, route, prompt_tokens: int) -> None:
        self.routes.labels(route_mode(route)).inc()
        self.routed_prompt_tokens.inc(prompt_tokens)
        self.routed_cached_tokens.inc(min(route.cached_tokens, prompt_tokens))

    def timer(self, prompt_tokens: int) -> "RequestTimer":
        return RequestTimer(self, prompt_tokens)


class RequestTimer:
    """Latencies of one gateway request; ``tokens(n)`` per streamed message, ``done(code)`` once."""

    __slots__ = ("m", "start", "first", "last", "n", "prompt_tokens", "finished")

    def __init__(self, metrics: GatewayMetrics, prompt_tokens: int):
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first = 0.0
        self.n = 0
        self.prompt_tokens = prompt_tokens
        self.finished = False
        metrics.inflight.inc()

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if not self.n:
            self.first = now
            self.m.ttft.observe(now - self.start)
            if n > 1:
                for _ in range(n - 1):
                    self.m.itl.observe(0.0)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.m.itl.observe(gap)
        self.last = now
        self.n += n
        self.m.generation_tokens.inc(n)

    def done(self, code_name: str) -> None:
        if self.finished:
            return
        self.finished = True
        m = self.m
        m.inflight.dec()
        m.requests.labels(code_name).inc()
        if code_name == "OK" and self.n:
            m.prompt_tokens.inc(self.prompt_tokens)
            m.e2e.observe(self.last - self.start)
            m.tpot.observe((self.last - self.first) / (self.n - 1) if self.n > 1 else 0.0)


class WorkerMetrics:
    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.role = role
        self.queue_depth = Gauge("pdserve_queue_depth", "Requests waiting: for the scheduler, "
                                 "for their KV to arrive or for KV blocks to free", registry=r)
        self.kv_block_waiters = Gauge("pdserve_kv_block_waiters", "Decode role: requests "
                                      "waiting for KV blocks to free before their prompt's KV "
                                      "can be received", registry=r)
        self.running = Gauge("pdserve_running_requests", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge("pdserve_waiting_requests", "Requests waiting for the scheduler",
                             registry=r)
        self.kv_used = Gauge("pdserve_kv_blocks_used", "KV blocks referenced by requests",
                             registry=r)
        self.kv_free = Gauge("pdserve_kv_blocks_free", "KV blocks free (cached prefixes "
                             "included: they are evictable)", registry=r)
        self.kv_usage = Gauge("pdserve_kv_cache_usage_ratio", "kv_blocks_used / total",
                              registry=r)
        self.kv_stranded = Gauge("pdserve_kv_blocks_stranded", "KV blocks held for no live "
                                 "request: referenced by no request, or by one whose caller "
                                 "let go over a second ago (0 unless something leaked)",
                                 registry=r)
        self.prefix_query = Counter("pdserve_prefix_cache_query_tokens", "Prompt tokens looked "
                                    "up in the local prefix cache", registry=r)
        self.prefix_hit = Counter("pdserve_prefix_cache_hit_tokens", "Prompt tokens found in "
                                  "the local prefix cache", registry=r)
        self.preemptions = Counter("pdserve_preemptions", "Requests preempted by the "
                                   "scheduler", registry=r)
        self.steps = Counter("pdserve_engine_steps", "Model runs by path: decode_graph "
                             "(CUDA graph, decode only), mixed_graph (CUDA graph, decodes plus "
                             "short prompt chunks), eager", ["path"], registry=r)
        self.steps_ahead = Counter("pdserve_engine_steps_launched_ahead", "Steps launched "
                                   "before the step before them was read (async_decode: their "
                                   "host work overlapped the device's)", registry=r)
        self.requests = Counter("pdserve_worker_requests", "Requests served by this worker, by "
                                "kind (prefill, decode_remote, decode_local) and outcome",
                                ["kind", "outcome"], registry=r)
        self.tokens = Counter("pdserve_worker_generated_tokens", "Tokens this worker streamed "
                              "(decode) or sampled as a first token (prefill)", registry=r)
        self.prefill_seconds = Histogram("pdserve_prefill_seconds", "Prefill RPC: engine queue "
                                         "+ compute of the prompt", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved, by "
                                      "direction (sent by prefill, received by decode)",
                                      ["direction"], registry=r)
        self.transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "KV transfer time "
                                          "added after the prompt was computed (sender: last "
                                          "blocks handed over -> acked; receiver: prefill RPC "
                                          "done -> KV landed wait)", ["direction"],
                                          buckets=TRANSFER_BUCKETS, registry=r)
        self.transfer_pieces = Histogram(
            "pdserve_kv_transfer_pieces", "Pieces contiguous in both caches per received KV "
            "transfer (one copy / NCCL segment / NIXL descriptor run each; GPU backends): "
            "how fragmented the workers' KV blocks are", ["direction"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.transfers = Counter("pdserve_kv_transfers", "KV transfers by direction and final "
                                 "state", ["direction", "state"], registry=r)
        self._last = None

    def export_config(self, settings: dict[str, str]) -> None:
        export_config(self.registry, settings)

    def observe_engine(self, st, kv_block_waiters: int = 0) -> None:
        """Update gauges and counters from an ``EngineStats`` snapshot (cumulative fields)
        and the decode role's requests waiting for KV blocks."""
        used = st.kv_blocks_total - st.kv_blocks_free
        self.queue_depth.set(st.num_waiting + st.num_awaiting_kv + kv_block_waiters)
        self.kv_block_waiters.set(kv_block_waiters)
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_used.set(used)
        self.kv_free.set(st.kv_blocks_free)
        self.kv_usage.set(used / st.kv_blocks_total if st.kv_blocks_total else 0.0)
        last = self._last
        for counter, field in (
                (self.prefix_query, "prefix_query_tokens"),
                (self.prefix_hit, "prefix_hit_tokens"),
                (self.preemptions, "num_preemptions"),
                (self.steps.labels("decode_graph"), "graph_steps"),
                (self.steps.labels("mixed_graph"), "mixed_graph_steps"),
                (self.steps.labels("eager"), "eager_steps"),
                (self.steps_ahead, "chained_steps")):
            now = getattr(st, field, 0)
            before = getattr(last, field, 0) if last is not None else 0
            if now > before:
                counter.inc(now - before)
        self._last = st

    def transfer(self, direction: str, state: str, num_bytes: int, seconds: float,
                 pieces: int | None = None) -> None:
        self.transfers.labels(direction, state).inc()
        if num_bytes:
            self.transfer_bytes.labels(direction).inc(num_bytes)
        self.transfer_seconds.labels(direction).observe(seconds)
        if pieces:
            self.transfer_pieces.labels(direction).observe(pieces)
