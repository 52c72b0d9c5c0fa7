"""Traces, metrics and logs of a real cluster (dummy:tiny, 1 prefill + 1 decode + gateway).

Spans go over OTLP/gRPC to a collector running inside the test (pdserve.otlp_receiver); metrics
are scraped from each service's /metrics port.
"""
from __future__ import annotations

import pytest

from pdserve import client
from pdserve.cluster import LocalCluster
from pdserve.otlp_receiver import OtlpReceiver
from tests.integration.helpers import gen_many, run, scrape, wait_all_free

MODEL = "dummy:tiny"


@pytest.fixture(scope="module")
def traced():
    with OtlpReceiver() as rx:
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
        with LocalCluster(MODEL, prefill=1, decode=1, env=env, metrics=True,
                          worker_args=("--log-level", "INFO")) as c:
            yield c, rx


def delta(after, before, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def total(samples, name) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _by_kind(cluster, kind):
    return next(s for s in [cluster.gateway, *cluster.workers] if s.kind == kind)


def test_one_trace_per_request_across_three_services(traced):
    cluster, rx = traced
    rids = [f"trace-req-{i}" for i in range(4)]
    reqs = [client.make_request(f"Tell me about topic {i}.", request_id=rid, max_tokens=6,
                                temperature=0.0, ignore_eos=True) for i, rid in enumerate(rids)]
    outs = run(gen_many(cluster.address, reqs))
    assert all(o.completion_tokens == 6 for o in outs)

    def complete(spans):
        # the client's request_id labels the gateway's span; the workers' spans carry the
        # gateway's own id for the request, and the same trace
        gw = {s.attributes.get("pdserve.request_id"): s.trace_id for s in spans
              if s.name == "gateway.Generate"}
        if not set(rids) <= set(gw):
            return False
        traces = {gw[r] for r in rids}
        # the decode worker's spans end after its stream does, and the KV transfer's may
        # end after the prefill answered: wait for all of them
        for name in ("prefill", "decode.generate", "kv.transfer"):
            if not traces <= {s.trace_id for s in spans if s.name == name}:
                return False
        return True
    spans = rx.wait_for(complete, timeout_s=15)
    assert complete(spans), sorted({(s.service, s.name) for s in spans})

    trace_ids = set()
    for rid in rids:
        gw = [s for s in spans if s.name == "gateway.Generate"
              and s.attributes.get("pdserve.request_id") == rid]
        assert len(gw) == 1
        g = gw[0]
        assert g.parent_span_id == ""  # the client sent no traceparent: a new trace
        assert g.attributes["pdserve.prompt_tokens"] > 0
        assert g.attributes["pdserve.routing_mode"] in ("prefix", "load")
        assert g.attributes["pdserve.prefill_worker"] and g.attributes["pdserve.decode_worker"]
        assert "pdserve.cached_tokens_predicted" in g.attributes
        tr = [s for s in spans if s.trace_id == g.trace_id]
        trace_ids.add(g.trace_id)
        # every span carrying this request's ids is in this one trace
        ids = {rid, g.attributes["pdserve.internal_id"]}
        assert all(s.trace_id == g.trace_id for s in spans
                   if s.attributes.get("pdserve.request_id") in ids)
        assert {s.service for s in tr} == {"pdserve-gateway", "pdserve-decode", "pdserve-prefill"}
        one = {}
        for s in tr:
            assert s.name not in one, f"two {s.name} spans in one trace"
            one[s.name] = s
        expect_parent = {
            "route": "gateway.Generate", "decode.generate": "gateway.Generate",
            "prefill.remote": "decode.generate", "kv.receive": "decode.generate",
            "decode": "decode.generate", "prefill": "prefill.remote", "queue": "prefill",
            "prefill.compute": "prefill", "kv.transfer": "prefill"}
        assert set(one) == set(expect_parent) | {"gateway.Generate"}
        for name, parent in expect_parent.items():
            assert one[name].parent_span_id == one[parent].span_id, (name, parent)
        for s in tr:
            assert s.start_ns <= s.end_ns
        assert one["decode.generate"].service == "pdserve-decode"
        assert one["prefill"].service == "pdserve-prefill"
        kv = one["kv.transfer"].attributes
        assert kv["pdserve.kv.backend"] == "tcp" and kv["pdserve.kv.bytes"] > 0
        assert kv["pdserve.kv.state"] == "done" and kv["pdserve.kv.gbps"] >= 0
        span_ms = (one["kv.transfer"].end_ns - one["kv.transfer"].start_ns) / 1e6
        assert 0 <= kv["pdserve.kv.tail_ms"] <= span_ms + 0.01
        assert one["decode"].attributes["pdserve.completion_tokens"] == 6
        assert one["queue"].end_ns <= one["prefill.compute"].start_ns + 1
    assert len(trace_ids) == len(rids)

    # structured logs carry the gateway's id of the request on every hop, and the trace id
    # (prefill logs each request at INFO)
    prefill_log = "\n".join(_by_kind(cluster, "prefill").log)
    for rid in rids:
        g = next(s for s in spans if s.name == "gateway.Generate"
                 and s.attributes.get("pdserve.request_id") == rid)
        assert f"rid={g.attributes['pdserve.internal_id']} trace={g.trace_id}" in prefill_log


def test_client_traceparent_is_the_parent(traced):
    cluster, rx = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def go():
        async with client.channel(cluster.address) as ch:
            from protos.pdserve.v1 import gateway_pb2_grpc
            stub = gateway_pb2_grpc.GatewayStub(ch)
            req = client.make_request("hello", request_id="client-traced", max_tokens=2)
            async for _ in stub.Generate(req, timeout=60, metadata=(
                    ("traceparent", f"00-{trace_id}-{parent}-01"),)):
                pass
    run(go())
    # spans of the three services are exported independently: wait for all of them
    want = {"prefill", "decode.generate", "gateway.Generate"}
    spans = rx.wait_for(lambda sp: want <= {s.name for s in sp if s.trace_id == trace_id},
                        timeout_s=15)
    g = next(s for s in spans if s.name == "gateway.Generate"
             and s.attributes.get("pdserve.request_id") == "client-traced")
    assert g.trace_id == trace_id and g.parent_span_id == parent
    assert {s.service for s in spans if s.trace_id == trace_id} == {
        "pdserve-gateway", "pdserve-decode", "pdserve-prefill"}


def test_metrics_count_a_known_workload(traced):
    cluster, _ = traced
    gw, pre, dec = (_by_kind(cluster, k) for k in ("gateway", "prefill", "decode"))
    assert gw.metrics_port and pre.metrics_port and dec.metrics_port
    n, m = 5, 7
    run(wait_all_free([w.address for w in cluster.workers]))
    before = {k: scrape(s.metrics_port) for k, s in (("gw", gw), ("pre", pre), ("dec", dec))}
    reqs = [client.make_request(f"Metrics request {i}: count the sheep.", max_tokens=m,
                                temperature=0.0, ignore_eos=True) for i in range(n)]
    outs = run(gen_many(cluster.address, reqs))
    assert all(o.completion_tokens == m for o in outs)
    run(wait_all_free([w.address for w in cluster.workers]))
    import time

    def settled(a) -> bool:
        """Worker gauges and prefix counters follow engine stats every 0.25 s: wait until
        they show the finished workload (a fixed 0.6 s was short on a loaded machine)."""
        return (delta(a["dec"], before["dec"], "pdserve_worker_generated_tokens_total") == n * m
                and delta(a["pre"], before["pre"], "pdserve_prefix_cache_query_tokens_total") > 0
                and all(a[k].get((g, ()), 1) == 0 for k in ("pre", "dec")
                        for g in ("pdserve_running_requests", "pdserve_queue_depth",
                                  "pdserve_kv_blocks_used")))
    deadline = time.monotonic() + 15
    while True:
        after = {k: scrape(s.metrics_port) for k, s in (("gw", gw), ("pre", pre), ("dec", dec))}
        if settled(after) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    g0, g1 = before["gw"], after["gw"]
    assert delta(g1, g0, "pdserve_requests_total", code="OK") == n
    assert delta(g1, g0, "pdserve_generation_tokens_total") == n * m
    assert delta(g1, g0, "pdserve_prompt_tokens_total") == sum(o.prompt_tokens for o in outs)
    assert delta(g1, g0, "pdserve_routed_prompt_tokens_total") == sum(o.prompt_tokens for o in outs)
    assert delta(g1, g0, "pdserve_time_to_first_token_seconds_count") == n
    assert delta(g1, g0, "pdserve_e2e_request_latency_seconds_count") == n
    assert delta(g1, g0, "pdserve_time_per_output_token_seconds_count") == n
    assert delta(g1, g0, "pdserve_inter_token_latency_seconds_count") == n * (m - 1)
    assert total(g1, "pdserve_routing_decisions_total") - total(
        g0, "pdserve_routing_decisions_total") == n
    assert delta(g1, g0, "pdserve_routing_decisions_total", mode="colocated") == 0
    assert g1[("pdserve_redis_up", ())] == 1
    assert g1[("pdserve_inflight_requests", ())] == 0
    assert g1[("pdserve_workers", (("role", "prefill"),))] == 1
    assert g1[("pdserve_workers", (("role", "decode"),))] == 1
    assert ("pdserve_health_probes_late_total", ()) in g1  # exported from the start

    p0, p1 = before["pre"], after["pre"]
    assert delta(p1, p0, "pdserve_worker_requests_total", kind="prefill", outcome="ok") == n
    assert delta(p1, p0, "pdserve_worker_generated_tokens_total") == n
    assert delta(p1, p0, "pdserve_kv_transfers_total", direction="sent", state="done") == n
    assert delta(p1, p0, "pdserve_kv_transfer_seconds_count", direction="sent") == n
    assert delta(p1, p0, "pdserve_prefill_seconds_count") == n
    sent = delta(p1, p0, "pdserve_kv_transfer_bytes_total", direction="sent")
    assert sent > 0
    assert delta(p1, p0, "pdserve_prefix_cache_query_tokens_total") > 0

    d0, d1 = before["dec"], after["dec"]
    assert delta(d1, d0, "pdserve_worker_requests_total", kind="decode_remote", outcome="ok") == n
    assert delta(d1, d0, "pdserve_worker_generated_tokens_total") == n * m
    assert delta(d1, d0, "pdserve_kv_transfers_total", direction="received", state="done") == n
    assert delta(d1, d0, "pdserve_kv_transfer_bytes_total", direction="received") == sent
    for w in (p1, d1):
        assert w[("pdserve_running_requests", ())] == 0
        assert w[("pdserve_queue_depth", ())] == 0
        assert w[("pdserve_kv_blocks_used", ())] == 0
        assert w[("pdserve_kv_blocks_free", ())] > 0


def test_every_service_exports_its_resolved_configuration(traced):
    """pdserve_config_info: one sample whose labels are the settings the service runs with,
    as resolved at start (a worker's device, dtype, KV blocks, max_model_len)."""
    cluster, _ = traced
    infos = {}
    for svc in (cluster.gateway, *cluster.workers):
        samples = scrape(svc.metrics_port)
        (labels, value), = [(dict(k[1]), v) for k, v in samples.items()
                            if k[0] == "pdserve_config_info"]
        assert value == 1
        infos[svc.kind] = labels
    gw, pre, dec = infos["gateway"], infos["prefill"], infos["decode"]
    assert gw["model"] == MODEL and gw["static_capacity"] == "64" and "max_num_seqs" not in gw
    for role, w in (("prefill", pre), ("decode", dec)):
        assert (w["role"], w["model"], w["device"], w["dtype"]) == (role, MODEL, "cpu", "float32")
        assert w["kv_backend"] == "tcp" and w["max_num_seqs"] == "64"
        assert w["max_model_len"] == "2048" and int(w["num_blocks"]) > 0
        assert w["log_level"] == "INFO"
