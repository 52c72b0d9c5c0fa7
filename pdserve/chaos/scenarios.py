"""The chaos scenarios. Each takes a model spec, starts its own cluster, injects its fault
and returns a :class:`Result`: the checks it made (all must hold), figures, and what the
clients saw. ``SCENARIOS`` maps names to functions (``pdserve chaos --scenario NAME``).

Greedy outputs are compared with an undisturbed run of the same requests on the same
cluster, before the fault.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
import time

from pdserve.chaos.proxy import ChaosProxy
from pdserve.chaos.streams import greedy_requests, run_streams, settle, stats, until
from pdserve.cluster import LocalCluster, free_port

FAST = ("--health-interval-s", "0.5")  # gateway: notice a hung worker quickly


@dataclass
class Result:
    scenario: str
    checks: dict[str, bool] = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _outcomes(streams) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in streams:
        key = s.code if s.code != "OK" else f"OK/{s.finish_reason or 'no-finish'}"
        out[key] = out.get(key, 0) + 1
    return out


def _same_tokens(streams, ref) -> int:
    return sum(s.tokens == r.tokens for s, r in zip(streams, ref))


async def _busiest_decode(cluster) -> object:
    """The decode worker running the most requests now."""
    best, n = None, -1
    for w in cluster.workers:
        if w.kind == "decode" and w.alive:
            st = await stats(w.address, "decode")
            if st.num_running > n:
                best, n = w, st.num_running
    return best


def _finish(res: Result, streams, ref, settled: dict) -> Result:
    res.figures["client_outcomes"] = _outcomes(streams)
    res.figures["identical_to_undisturbed"] = f"{_same_tokens(streams, ref)}/{len(streams)}"
    res.figures["workers_after"] = settled
    res.checks["every stream completed"] = all(s.code == "OK" and s.finish_reason
                                               for s in streams)
    res.checks["greedy tokens unchanged"] = _same_tokens(streams, ref) == len(streams)
    res.checks["no block stranded or in use"] = all(
        v.get("stranded") == 0 and v.get("used") == 0 for v in settled.values())
    return res


# ---------------------------------------------------------------- decode faults
async def _decode_fault(cluster, fault, res: Result, n: int = 8, max_tokens: int = 224,
                        min_streamed: int = 16, min_left: int = 64) -> Result:
    """8 greedy streams; once each has ``min_streamed`` tokens, ``fault`` hits the busiest
    decode worker. The check that the fault hit every stream mid-way wants ``min_left``
    tokens still to come in each; 224 tokens leave room for a loaded machine, which spreads
    the streams' starts (the first was seen 72 tokens ahead of the last)."""
    reqs = greedy_requests(n, max_tokens, tag=res.scenario + ": ")
    ref = await run_streams(cluster.address, reqs)
    victim = {}

    async def inject(streams):
        ok = await until(lambda: all(len(s.tokens) >= min_streamed for s in streams), 120)
        res.figures["streamed_at_fault"] = sorted(len(s.tokens) for s in streams)
        res.checks["fault hit streams mid-way"] = ok and all(
            len(s.tokens) <= max_tokens - min_left for s in streams)
        victim["w"] = await _busiest_decode(cluster)
        victim["t"] = time.monotonic()
        await fault(victim["w"])

    streams = await run_streams(cluster.address, reqs, during=inject)
    res.figures["max_gap_s"] = round(max(max(s.gaps, default=0) for s in streams), 3)
    survivors = [w for w in cluster.workers if w.alive and w is not victim.get("w")]
    return _finish(res, streams, ref, await settle(survivors))


def kill_decode(model: str = "smollm2-135m") -> Result:
    """kill -9 of a decode worker during 8 greedy streams (1P2D): every stream resumes on
    the other decode worker with the same tokens."""
    res = Result("kill-decode")
    with LocalCluster(model, prefill=1, decode=2) as c:
        async def fault(w):
            c.kill(w)
        return asyncio.run(_decode_fault(c, fault, res))


def stop_decode(model: str = "smollm2-135m") -> Result:
    """SIGSTOP of a decode worker during 8 greedy streams: the gateway's probes notice,
    the streams move, the tokens stay the same; resumed later, the worker frees what the
    cancelled streams held."""
    res = Result("stop-decode")
    with LocalCluster(model, prefill=1, decode=2, gateway_args=FAST) as c:
        stopped = []

        async def fault(w):
            c.pause(w)
            stopped.append(w)

        try:
            res = asyncio.run(_decode_fault(c, fault, res))
        finally:
            for w in stopped:
                c.resume(w)
        after = asyncio.run(settle(stopped))
        res.figures["stopped_worker_after_resume"] = after
        res.checks["stopped worker frees its blocks once resumed"] = all(
            v.get("used") == 0 and v.get("stranded") == 0 for v in after.values())
        return res


def _behind_proxy(cluster, role: str) -> tuple[object, ChaosProxy]:
    """Start a worker whose advertised address is a proxy in front of its port."""
    port = free_port()
    proxy = ChaosProxy(port)
    pport = proxy.start()
    w = cluster.start_worker(role, extra=("--port", str(port), "--advertise-port", str(pport)))
    return w, proxy


def partition_decode(model: str = "smollm2-135m") -> Result:
    """Two decode workers behind proxies; the busiest one's proxy starts swallowing all
    traffic (no resets): the gateway's keepalives and probes notice, the streams move, the
    tokens stay the same; healed, the worker frees what the cut streams held."""
    res = Result("partition-decode")
    with LocalCluster(model, prefill=1, decode=0, gateway_args=FAST) as c:
        proxies = dict(_behind_proxy(c, "decode") for _ in range(2))
        c.wait_workers_registered()
        cut = []

        async def fault(w):
            proxies[w].set_mode("blackhole")
            cut.append(w)

        try:
            res = asyncio.run(_decode_fault(c, fault, res))
        finally:
            for p in proxies.values():
                p.set_mode("pass")
        after = asyncio.run(settle(cut))
        res.figures["partitioned_worker_after_heal"] = after
        res.checks["partitioned worker frees its blocks once healed"] = all(
            v.get("used") == 0 and v.get("stranded") == 0 for v in after.values())
        for p in proxies.values():
            p.stop()
        return res


def shutdown_decode(model: str = "smollm2-135m") -> Result:
    """SIGTERM of a decode worker with a 1 s grace period during long streams: at the end of
    the grace the worker ends them with UNAVAILABLE and the gateway resumes them."""
    res = Result("shutdown-decode")
    with LocalCluster(model, prefill=1, decode=2,
                      role_args={"decode": ("--grace-s", "1", "--drain-delay-s", "0")}) as c:
        async def fault(w):
            import os
            os.killpg(w.proc.pid, 15)
        return asyncio.run(_decode_fault(c, fault, res))


# --------------------------------------------------------------- prefill faults
def stop_prefill(model: str = "smollm2-135m") -> Result:
    """SIGSTOP of the only prefill worker: a new request still completes within 10 s (the
    decode worker prefills it locally), as do later ones; resumed, the worker is used again."""
    with LocalCluster(model, prefill=1, decode=1, gateway_args=FAST, metrics=True) as c:
        return _stop_prefill(c, Result("stop-prefill"))


def stop_prefill_unnoticed(model: str = "smollm2-135m") -> Result:
    """As stop-prefill, but the gateway does not notice (it probes once a minute and the
    worker's registry entry lives a minute): it keeps routing to the stopped worker, and only
    the decode worker's own deadlines (keepalive, connection timeout) keep each request
    within 10 s."""
    with LocalCluster(model, prefill=1, decode=1, metrics=True,
                      gateway_args=("--health-interval-s", "60"),
                      role_args={"prefill": ("--registry-ttl-s", "60")}) as c:
        return _stop_prefill(c, Result("stop-prefill-unnoticed"))


def _stop_prefill(c, res: Result, n: int = 4) -> Result:
    pre = next(w for w in c.workers if w.kind == "prefill")
    reqs = greedy_requests(n, 24, tag="stop-prefill: ")
    ref = asyncio.run(run_streams(c.address, reqs))
    c.pause(pre)
    streams, took = [], []
    try:
        for r in reqs:  # one at a time: each meets the stopped worker afresh
            t0 = time.monotonic()
            streams += asyncio.run(run_streams(c.address, [r], timeout=30))
            took.append(round(time.monotonic() - t0, 2))
    finally:
        c.resume(pre)
    res.figures["request_s"] = took
    res.checks["each request during the stop completes within 10 s"] = all(
        s.code == "OK" for s in streams) and max(took) <= 10
    res = _finish(res, streams, ref, asyncio.run(settle(c.workers)))
    t0 = time.monotonic()
    res.checks["resumed, the worker prefills again within 15 s"] = _prefills_again(c, pre, 15)
    res.figures["prefilling_again_after_s"] = round(time.monotonic() - t0, 2)
    return res


def _prefills_again(c, pre, timeout_s: float) -> bool:
    """Requests until one is prefilled on ``pre`` (its counter of prefills moves)."""
    labels = {"kind": "prefill", "outcome": "ok"}
    before = _metric(pre.metrics_port, "pdserve_worker_requests_total", labels)
    deadline = time.monotonic() + timeout_s
    i = 0
    while time.monotonic() < deadline:
        asyncio.run(run_streams(c.address, greedy_requests(1, 2, tag=f"again {i}: ")))
        if _metric(pre.metrics_port, "pdserve_worker_requests_total", labels) > before:
            return True
        i += 1
        time.sleep(0.2)
    return False


# ------------------------------------------------------------------ the others
def redis_restart(model: str = "smollm2-135m") -> Result:
    """Redis killed while requests stream and started again empty: clients see nothing."""
    res = Result("redis-restart")
    with LocalCluster(model, prefill=1, decode=1) as c:
        reqs = greedy_requests(6, 48, tag="redis: ")
        ref = asyncio.run(run_streams(c.address, reqs))

        async def fault(streams):
            await until(lambda: all(len(s.tokens) >= 4 for s in streams), 60)
            c.redis.kill()
            await asyncio.sleep(1.0)
            c.redis.start()
            t0 = time.monotonic()  # the registry is back once every worker's entry is
            await asyncio.to_thread(_registered, c, 15.0)
            res.figures["registry_recovered_s"] = round(time.monotonic() - t0, 2)

        streams = asyncio.run(run_streams(c.address, reqs, during=fault))
        c.wait_workers_registered(timeout_s=15)  # and the gateway has re-read it
        res.checks["registry back within 1 s"] = res.figures["registry_recovered_s"] <= 1.0
        after = asyncio.run(run_streams(c.address, reqs[:2]))
        res.checks["requests after the restart succeed"] = all(s.code == "OK" for s in after)
        return _finish(res, streams, ref, asyncio.run(settle(c.workers)))


def _registered(c, timeout_s: float) -> None:
    """Until the (restarted) Redis lists every live worker of ``c``, polled every 20 ms."""
    import redis as redis_sync
    want = {w.worker_id for w in c.workers if w.alive}
    deadline = time.monotonic() + timeout_s
    r = redis_sync.Redis.from_url(c.redis.client_url, socket_timeout=1.0)
    try:
        while time.monotonic() < deadline:
            try:
                have = {k.decode().split("pdserve:worker:", 1)[1]
                        for k in r.keys("pdserve:worker:*")}
            except redis_sync.RedisError:
                have = set()
            if want <= have:
                return
            time.sleep(0.02)
    finally:
        r.close()
    raise TimeoutError("workers did not register again")


def stop_redis(model: str = "smollm2-135m", stop_s: float = 6.0) -> Result:
    """SIGSTOP of Redis (hung: its port accepts, nothing answers) for longer than a registry
    entry lives, while requests stream and new ones arrive: every request completes with the
    same tokens (the gateway routes on what it read last, workers dial the members they
    know); resumed, Redis lists every worker again and requests keep succeeding."""
    import os
    import signal
    res = Result("stop-redis")
    with LocalCluster(model, prefill=1, decode=1) as c:
        reqs = greedy_requests(6, 48, tag="stop-redis: ")
        ref = asyncio.run(run_streams(c.address, reqs))
        pid = c.redis.proc.pid
        stopped = {}

        async def fault(streams):
            await until(lambda: all(len(s.tokens) >= 4 for s in streams), 60)
            os.kill(pid, signal.SIGSTOP)
            stopped["t"] = time.monotonic()

        fresh, took = [], []
        try:
            streams = asyncio.run(run_streams(c.address, reqs, during=fault, timeout=60))
            res.figures["streams_done_after_stop_s"] = round(time.monotonic() - stopped["t"], 2)
            # new requests, one at a time, for stop_s and at least one (on a loaded host the
            # streams can outlast stop_s); Redis stays stopped until the finally below
            while not fresh or time.monotonic() - stopped["t"] < stop_s:
                t0 = time.monotonic()
                fresh += asyncio.run(run_streams(c.address, [reqs[len(fresh) % 6]],
                                                 timeout=30))
                took.append(round(time.monotonic() - t0, 2))
        finally:
            os.kill(pid, signal.SIGCONT)
        res.figures["request_s_while_stopped"] = took
        res.checks["requests sent while Redis is stopped complete within 10 s"] = bool(
            fresh) and all(s.code == "OK" for s in fresh) and max(took) <= 10
        res.checks["same tokens while stopped"] = all(
            s.tokens == ref[i % 6].tokens for i, s in enumerate(fresh))
        after, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 5:  # right after the resume: entries expire, return
            after += asyncio.run(run_streams(c.address, [reqs[len(after) % 6]], timeout=30))
        res.figures["requests_after_resume"] = _outcomes(after)
        res.checks["requests right after the resume succeed"] = all(
            s.code == "OK" and s.tokens == ref[i % 6].tokens for i, s in enumerate(after))
        t0 = time.monotonic()
        _registered(c, 15.0)
        res.figures["registered_again_s"] = round(time.monotonic() - t0, 2)
        return _finish(res, streams, ref, asyncio.run(settle(c.workers)))


def kill_gateway(model: str = "smollm2-135m") -> Result:
    """kill -9 of the gateway during 8 long streams: the clients see UNAVAILABLE; the
    workers notice their callers are gone and free every block within 20 s; a restarted
    gateway serves the same greedy tokens."""
    res = Result("kill-gateway")
    with LocalCluster(model, prefill=1, decode=1) as c:
        reqs = greedy_requests(8, 224, tag="kill-gateway: ")
        ref = asyncio.run(run_streams(c.address, reqs))

        async def fault(streams):
            ok = await until(lambda: all(len(s.tokens) >= 8 for s in streams), 120)
            res.checks["fault hit streams mid-way"] = ok and all(
                len(s.tokens) < 224 for s in streams)
            c.kill(c.gateway)

        cut = asyncio.run(run_streams(c.address, reqs, during=fault, timeout=60))
        res.figures["client_outcomes_at_the_kill"] = _outcomes(cut)
        res.checks["clients see UNAVAILABLE, not a hang"] = all(
            s.code == "UNAVAILABLE" for s in cut)
        t0 = time.monotonic()
        freed = asyncio.run(settle(c.workers))
        res.figures["workers_idle_after_s"] = round(time.monotonic() - t0, 2)
        res.checks["workers idle, no block in use within 20 s"] = all(
            v.get("used") == 0 and v.get("stranded") == 0 and v.get("running", 0) == 0
            for v in freed.values())
        c.restart(c.gateway)
        streams = asyncio.run(run_streams(c.address, reqs))
        return _finish(res, streams, ref, asyncio.run(settle(c.workers)))


def partition_kv(model: str = "smollm2-135m") -> Result:
    """The decode worker's KV receiver behind a proxy that resets the connections open to it
    and then swallows every new one (gRPC between the workers still works): the prefill
    worker's new KV connection gives up after its 5 s connect bound, the decode worker
    prefills locally, and while that receiver counts as unreachable the requests do not
    wait for it; every request completes within 10 s with the same tokens; healed, the
    prefill worker is used again. (A connection kept open but silent, pooled before the
    fault, is bounded by the transfer's deadline only: not this scenario.)"""
    res = Result("partition-kv")
    with LocalCluster(model, prefill=1, decode=0, metrics=True) as c:
        port = free_port()
        proxy = ChaosProxy(port)
        c.start_worker("decode", extra=("--kv-port", str(port), "--kv-advertise-port",
                                        str(proxy.start())))
        c.wait_workers_registered()
        pre = next(w for w in c.workers if w.kind == "prefill")
        reqs = greedy_requests(4, 24, tag="partition-kv: ")
        ref = asyncio.run(run_streams(c.address, reqs))
        proxy.set_mode("refuse")  # the pooled KV connections go
        time.sleep(0.3)
        proxy.set_mode("blackhole")
        streams, took = [], []
        try:
            for r in reqs:  # one at a time, as in stop-prefill
                t0 = time.monotonic()
                streams += asyncio.run(run_streams(c.address, [r], timeout=30))
                took.append(round(time.monotonic() - t0, 2))
        finally:
            proxy.set_mode("pass")
        res.figures["request_s"] = took
        res.checks["each request during the partition completes within 10 s"] = all(
            s.code == "OK" for s in streams) and max(took) <= 10
        res.checks["a receiver known unreachable costs the next request nothing"] = (
            min(took[1:]) < 4)
        res = _finish(res, streams, ref, asyncio.run(settle(c.workers)))
        time.sleep(5.5)  # the unreachable mark lapses
        t0 = time.monotonic()
        res.checks["healed, the prefill worker is used again within 15 s"] = _prefills_again(
            c, pre, 15)
        res.figures["prefilling_again_after_s"] = round(time.monotonic() - t0, 2)
        proxy.stop()
        return res


def delay_decode(model: str = "smollm2-135m") -> Result:
    """100 ms added each way in front of a decode worker: streams slow down, stay correct."""
    res = Result("delay-decode")
    with LocalCluster(model, prefill=1, decode=0) as c:
        _, proxy = _behind_proxy(c, "decode")
        c.wait_workers_registered()
        reqs = greedy_requests(4, 32, tag="delay: ")
        ref = asyncio.run(run_streams(c.address, reqs))
        proxy.set_mode("delay", delay_ms=100)
        streams = asyncio.run(run_streams(c.address, reqs))
        proxy.set_mode("pass")
        res.figures["slowest_s"] = round(max(s.done_s for s in streams), 2)
        res = _finish(res, streams, ref, asyncio.run(settle(c.workers)))
        proxy.stop()
        return res


def kv_corruption(model: str = "smollm2-135m") -> Result:
    """Every KV transfer corrupted on the wire (fault injection: the prefill worker flips a
    byte of each one it sends): the decode worker's per-block checksums catch each, the
    request is prefilled locally instead, and no corrupted KV is ever decoded -- the greedy
    tokens stay those of an undisturbed cluster."""
    res = Result("kv-corruption")
    reqs = greedy_requests(6, 32, tag="corruption: ")
    with LocalCluster(model, prefill=1, decode=1) as c:
        ref = asyncio.run(run_streams(c.address, reqs))
    with LocalCluster(model, prefill=1, decode=1, metrics=True,
                      env={"PDSERVE_KV_CORRUPT_EVERY": "1"}) as c:
        streams = asyncio.run(run_streams(c.address, reqs))
        dec = next(w for w in c.workers if w.kind == "decode")
        failed = _metric(dec.metrics_port, "pdserve_kv_transfers_total",
                         {"direction": "received", "state": "failed"})
        done = _metric(dec.metrics_port, "pdserve_kv_transfers_total",
                       {"direction": "received", "state": "done"})
        res.figures["transfers_failed_by_checksum"] = failed
        res.figures["transfers_done"] = done
        local = _metric(dec.metrics_port, "pdserve_worker_requests_total",
                        {"kind": "decode_local", "outcome": "ok"})
        res.figures["prefilled_on_decode"] = local
        # a request the gateway sent straight to the decode worker (a prefill worker that a
        # loaded machine made miss its health probes is routed around) moves no KV at all
        res.checks["every corrupted transfer was caught"] = failed >= 1 and done == 0
        res.checks["every request prefilled on the decode worker"] = local == len(reqs)
        return _finish(res, streams, ref, asyncio.run(settle(c.workers)))


def _metric(port: int, name: str, labels: dict) -> float:
    """One sample of a service's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return sample.value
    return 0.0


SCENARIOS = {
    "kill-decode": kill_decode,
    "stop-decode": stop_decode,
    "partition-decode": partition_decode,
    "shutdown-decode": shutdown_decode,
    "stop-prefill": stop_prefill,
    "stop-prefill-unnoticed": stop_prefill_unnoticed,
    "redis-restart": redis_restart,
    "stop-redis": stop_redis,
    "kill-gateway": kill_gateway,
    "partition-kv": partition_kv,
    "delay-decode": delay_decode,
    "kv-corruption": kv_corruption,
}
