"""services/telemetry.py, services/metrics.py and trace ids in logs: exact values, no processes."""
from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest

from services import telemetry
from services.logging_setup import request_context, setup_logging
from services.metrics import GatewayMetrics, WorkerMetrics, route_mode


class FakeContext:
    def __init__(self, md=()):
        self.md = tuple(md)

    def invocation_metadata(self):
        return self.md


TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("env,on", [
    ({}, False),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4317"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
])
def test_tracing_requested(env, on):
    assert telemetry.tracing_requested(env) is on


def test_off_costs_nothing_and_keeps_incoming_headers():
    assert telemetry.setup_tracing("gateway", env={}) is False
    ctx = FakeContext([("traceparent", TP), ("other", "x")])
    span = telemetry.server_span("gateway.Generate", ctx, {"a": 1})
    assert span is telemetry.NOOP_SPAN
    assert telemetry.child(span, "route") is telemetry.NOOP_SPAN
    with telemetry.child(span, "x") as s:
        s.set_attribute("k", 1)
    assert telemetry.outgoing_metadata(span, ctx) == (("traceparent", TP),)
    assert telemetry.outgoing_metadata(span) == ()
    assert telemetry.trace_id(span, ctx) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert telemetry.trace_id(span, FakeContext()) == ""


@pytest.mark.parametrize("bad", [
    ("traceparent", "a\xffb"), ("traceparent", "a\tb"), ("traceparent", TP.upper()),
    ("traceparent", TP + "-00"), ("tracestate", "\u00e9"), ("tracestate", "x" * 20_000),
    ("tracestate", "a=b\nc")])
def test_malformed_trace_headers_are_dropped_not_passed_on(bad):
    """A client's trace header that is not W3C Trace Context never reaches the metadata of
    the calls made for it (such a value can fail the call: non-ASCII, a tab, 20 KB)."""
    telemetry.setup_tracing("gateway", env={})
    ctx = FakeContext([bad, ("tracestate", "vendor=ok")] if bad[0] == "traceparent"
                      else [("traceparent", TP), bad])
    md = dict(telemetry.outgoing_metadata(telemetry.NOOP_SPAN, ctx))
    assert md.get(bad[0]) is None
    assert len(md) == 1  # the valid one of the pair stays
    if bad[0] == "traceparent":
        assert telemetry.trace_id(telemetry.NOOP_SPAN, ctx) == ""


def test_on_parents_and_propagates(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "ENABLED", True)
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("t"))
    monkeypatch.setattr(telemetry, "_propagator", TraceContextTextMapPropagator())
    from opentelemetry import trace
    monkeypatch.setattr(telemetry, "_in_context", trace.set_span_in_context)
    monkeypatch.setattr(telemetry, "_SERVER", trace.SpanKind.SERVER)
    root = telemetry.server_span("gateway.Generate", FakeContext([("traceparent", TP)]))
    assert telemetry.trace_id(root) == "4bf92f3577b34da6a3ce929d0e0e4736"
    with telemetry.child(root, "route"):
        pass
    md = dict(telemetry.outgoing_metadata(root))
    downstream = telemetry.server_span("decode.generate", FakeContext(md.items()))
    downstream.end()
    telemetry.end_with_status(root, "UNAVAILABLE", "no workers")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    tid = int("4bf92f3577b34da6a3ce929d0e0e4736", 16)
    assert {s.context.trace_id for s in spans.values()} == {tid}
    assert spans["gateway.Generate"].parent.span_id == int("00f067aa0ba902b7", 16)
    assert spans["route"].parent.span_id == spans["gateway.Generate"].context.span_id
    assert spans["decode.generate"].parent.span_id == spans["gateway.Generate"].context.span_id
    assert spans["gateway.Generate"].status.status_code.name == "ERROR"


def test_logs_carry_request_and_trace_id():
    buf = io.StringIO()
    setup_logging("gateway", "INFO", "json", stream=buf)
    try:
        with request_context("r1", "ab" * 16):
            logging.getLogger("x").info("hello")
        logging.getLogger("x").info("outside")
    finally:
        setup_logging("test", "WARNING", "text")
    first, second = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert first["request_id"] == "r1" and first["trace_id"] == "ab" * 16
    assert "request_id" not in second and "trace_id" not in second


def _sample(m, name, **labels):
    return m.registry.get_sample_value(name, labels or None)


def test_gateway_timer_counts():
    m = GatewayMetrics()
    t = m.timer(prompt_tokens=10)
    assert _sample(m, "pdserve_inflight_requests") == 1
    t.tokens(1)
    t.tokens(2)  # one message carrying two tokens: two inter-token gaps
    t.tokens(1)
    t.done("OK")
    t.done("OK")  # idempotent
    assert _sample(m, "pdserve_requests_total", code="OK") == 1
    assert _sample(m, "pdserve_generation_tokens_total") == 4
    assert _sample(m, "pdserve_prompt_tokens_total") == 10
    assert _sample(m, "pdserve_time_to_first_token_seconds_count") == 1
    assert _sample(m, "pdserve_inter_token_latency_seconds_count") == 3
    assert _sample(m, "pdserve_time_per_output_token_seconds_count") == 1
    assert _sample(m, "pdserve_e2e_request_latency_seconds_count") == 1
    assert _sample(m, "pdserve_inflight_requests") == 0
    failed = m.timer(prompt_tokens=5)
    failed.done("RESOURCE_EXHAUSTED")
    assert _sample(m, "pdserve_requests_total", code="RESOURCE_EXHAUSTED") == 1
    assert _sample(m, "pdserve_e2e_request_latency_seconds_count") == 1


def test_route_modes_and_routed_counters():
    m = GatewayMetrics()
    p = SimpleNamespace(id="p")
    routes = [SimpleNamespace(prefill=None, local=False, index_ok=True, cached_tokens=16),
              SimpleNamespace(prefill=p, local=False, index_ok=False, cached_tokens=0),
              SimpleNamespace(prefill=p, local=False, index_ok=True, cached_tokens=32),
              SimpleNamespace(prefill=p, local=False, index_ok=True, cached_tokens=0),
              SimpleNamespace(prefill=None, local=True, index_ok=True, cached_tokens=0)]
    modes = ["colocated", "load_only", "prefix", "load", "local_prefill"]
    assert [route_mode(r) for r in routes] == modes
    for r in routes:
        m.routed(r, 40)
    for mode in modes:
        assert _sample(m, "pdserve_routing_decisions_total", mode=mode) == 1
    assert _sample(m, "pdserve_routed_prompt_tokens_total") == 200
    assert _sample(m, "pdserve_routed_cached_tokens_total") == 48
    router = SimpleNamespace(registry_ok=True, index_ok=False, workers={
        "a": SimpleNamespace(info=SimpleNamespace(role="prefill"), pending_prefill_tokens=300),
        "b": SimpleNamespace(info=SimpleNamespace(role="prefill"), pending_prefill_tokens=12)})
    m.watch_router(router)
    assert _sample(m, "pdserve_redis_up") == 0
    router.index_ok = True
    assert _sample(m, "pdserve_redis_up") == 1
    assert _sample(m, "pdserve_workers", role="prefill") == 2
    assert _sample(m, "pdserve_workers", role="decode") == 0
    assert _sample(m, "pdserve_pending_prefill_tokens") == 312
    router.workers["a"].pending_prefill_tokens = 0
    assert _sample(m, "pdserve_pending_prefill_tokens") == 12


def _stats(**kw):
    base = dict(num_running=0, num_waiting=0, num_awaiting_kv=0, num_held=0,
                kv_blocks_total=100, kv_blocks_free=100, prefix_query_tokens=0,
                prefix_hit_tokens=0, num_preemptions=0, steps=0)
    return SimpleNamespace(**{**base, **kw})


def test_worker_metrics_follow_engine_stats():
    m = WorkerMetrics("decode")
    m.observe_engine(_stats(num_running=3, num_waiting=2, num_awaiting_kv=1, kv_blocks_free=60,
                            prefix_query_tokens=64, prefix_hit_tokens=32), kv_block_waiters=4)
    assert _sample(m, "pdserve_queue_depth") == 7  # waiting for blocks counts as waiting
    assert _sample(m, "pdserve_kv_block_waiters") == 4
    m.observe_engine(_stats(num_running=1, kv_blocks_free=90, prefix_query_tokens=96,
                            prefix_hit_tokens=48, num_preemptions=2, graph_steps=7,
                            mixed_graph_steps=3, eager_steps=2))
    assert _sample(m, "pdserve_running_requests") == 1
    assert _sample(m, "pdserve_queue_depth") == 0
    assert _sample(m, "pdserve_kv_blocks_used") == 10
    assert _sample(m, "pdserve_kv_blocks_free") == 90
    assert _sample(m, "pdserve_kv_cache_usage_ratio") == pytest.approx(0.1)
    assert _sample(m, "pdserve_prefix_cache_query_tokens_total") == 96
    assert _sample(m, "pdserve_prefix_cache_hit_tokens_total") == 48
    assert _sample(m, "pdserve_preemptions_total") == 2
    assert _sample(m, "pdserve_engine_steps_total", path="decode_graph") == 7
    assert _sample(m, "pdserve_engine_steps_total", path="mixed_graph") == 3
    assert _sample(m, "pdserve_engine_steps_total", path="eager") == 2
    m.transfer("received", "done", 4096, 0.002)
    assert _sample(m, "pdserve_kv_transfer_bytes_total", direction="received") == 4096
    assert _sample(m, "pdserve_kv_transfers_total", direction="received", state="done") == 1
    assert _sample(m, "pdserve_kv_transfer_seconds_count", direction="received") == 1
    assert _sample(m, "pdserve_kv_transfer_pieces_count", direction="received") is None
    m.transfer("received", "done", 8192, 0.003, pieces=3)  # a backend that counts pieces
    assert _sample(m, "pdserve_kv_transfer_pieces_count", direction="received") == 1
    assert _sample(m, "pdserve_kv_transfer_pieces_sum", direction="received") == 3
