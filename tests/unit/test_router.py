"""Router scoring: prefix overlap against load, decode by load, fallbacks (real Redis index)."""
from __future__ import annotations

import asyncio

import pytest

from gateway.router import NoWorkers, OverCapacity, Router
from pdcore.block_hash import BlockHasher
from services.metrics import route_mode
from services.prefix_index import PrefixIndex
from services.registry import WorkerInfo

BS = 16


def info(wid, role, running=0, cap=8):
    return WorkerInfo(worker_id=wid, address=f"{wid}:1", role=role, model="m", capacity=cap,
                      running=running, kv_total_blocks=100, kv_free_blocks=100)


def make_router(index=None, **kw):
    r = Router(model="m", block_size=BS, index=index, **kw)
    return r


def add(r, *infos):
    from gateway.router import Worker
    for i in infos:
        r.workers[i.worker_id] = Worker(i)


def test_prefix_hit_wins_over_small_load_difference(redis_server):
    async def go():
        idx = PrefixIndex(redis_server, "m")
        # the index only counts live workers: register them in the registry namespace
        from services.registry import WorkerRegistry
        reg = WorkerRegistry(redis_server)
        for wid in ("p1", "p2", "d1"):
            await reg.register(info(wid, "decode" if wid == "d1" else "prefill"))
        toks = list(range(BS * 10))
        hashes = BlockHasher("s", "m", BS).hash_blocks(toks)
        await idx.publish_stored("p2", hashes[:8])
        r = make_router(index=idx)
        add(r, info("p1", "prefill"), info("p2", "prefill", running=3), info("d1", "decode"))
        route = await r.route(len(toks), hashes)
        assert route.prefill.id == "p2" and route.cached_tokens == 8 * BS
        # p2's score: 0.8 - 3/8 = 0.425 > p1's 0; make p2 one full batch busier: p1 wins
        r.workers["p2"].info = info("p2", "prefill", running=8)
        route = await r.route(len(toks), hashes)
        assert route.prefill.id == "p1"
        await idx.close()
        await reg.close()
    asyncio.run(go())


def test_decode_by_load_and_colocated_fallback():
    async def go():
        r = make_router()
        add(r, info("p1", "prefill"), info("d1", "decode", running=5), info("d2", "decode", running=1))
        route = await r.route(32, [])
        assert route.decode.id == "d2" and route.prefill.id == "p1"
        # no prefill workers: colocated workers serve alone
        r2 = make_router()
        add(r2, info("c1", "colocated", running=2), info("c2", "colocated"))
        route = await r2.route(32, [])
        assert route.prefill is None and route.decode.id == "c2"
        with pytest.raises(NoWorkers):
            await make_router().route(32, [])
    asyncio.run(go())


def test_over_capacity_and_failed_workers():
    async def go():
        r = make_router(queue_factor=1.0)
        add(r, info("c1", "colocated", cap=2))
        route = await r.route(8, [])
        r.begin(route)
        r.begin(await r.route(8, []))
        with pytest.raises(OverCapacity):
            await r.route(8, [])
        r.end(route)
        assert (await r.route(8, [])).decode.id == "c1"
        r.mark_failed(r.workers["c1"])
        with pytest.raises(NoWorkers):
            await r.route(8, [])
    asyncio.run(go())


def test_capacity_holds_for_a_burst_that_awaits_the_index(redis_server):
    """Requests routed at once all await the Redis prefix lookup; each begins as soon as
    its route returns (as GatewayRequest does). Those over the pool's capacity are refused
    once the lookup returns: the check before it saw none of the others yet."""
    async def go():
        idx = PrefixIndex(redis_server, "m")
        r = make_router(index=idx, queue_factor=1.0)
        add(r, info("c1", "colocated", cap=4))
        hashes = BlockHasher("s", "m", BS).hash_blocks(list(range(BS * 3)))

        async def one():
            route = await r.route(BS * 3, hashes)
            r.begin(route)  # no await between the two, as in the gateway's pipeline

        res = await asyncio.gather(*(one() for _ in range(12)), return_exceptions=True)
        assert sum(x is None for x in res) == 4
        assert all(isinstance(x, OverCapacity) for x in res if x is not None)
        assert r.workers["c1"].inflight == 4
        await idx.close()
    asyncio.run(go())


def test_workers_survive_a_registry_that_lost_them_but_not_a_departure(redis_proc):
    """Redis restarted empty (killed and started again, nothing kept, or flushed between
    two listings): the known workers are missing from the listing after it. Those still
    answering their probes keep serving for registry_grace_s while they re-register, then
    are retired if they did not. Workers leaving the registry on their own (the registry's
    epoch unchanged) are retired at once, all of them too."""
    from services.registry import WorkerRegistry

    async def go():
        reg = WorkerRegistry(redis_proc.url, timeout_s=0.5, cooldown_s=0.05)
        for wid in ("d1", "d2", "d3"):
            await reg.register(info(wid, "decode"))
        r = make_router(registry_grace_s=0.8)
        r.registry = reg
        await r.refresh()
        assert {w.id for w in r._pool("decode")} == {"d1", "d2", "d3"}
        await reg.deregister("d3")  # a departure: the others are still listed
        await r.refresh()
        assert {w.id for w in r._pool("decode")} == {"d1", "d2"}
        redis_proc.kill()
        await r.refresh()  # unreachable: the last known workers stay
        assert not r.registry_ok and len(r._pool("decode")) == 2
        redis_proc.start()  # empty
        await asyncio.sleep(0.1)  # the client's cool-down after the failure
        await r.refresh()
        assert r.registry_ok and {w.id for w in r._pool("decode")} == {"d1", "d2"}
        assert (await r.route(8, [])).decode.id in ("d1", "d2")
        r.set_health(r.workers["d2"], False)  # one stopped answering meanwhile: retired
        await reg.register(info("d1", "decode"))  # d1 re-registers within the grace
        await r.refresh()
        assert {w.id for w in r._pool("decode")} == {"d1"} and "d2" not in r.workers
        await asyncio.sleep(0.9)
        await r.refresh()
        assert {w.id for w in r._pool("decode")} == {"d1"}
        # a wipe without an outage the gateway saw (FLUSHALL between two refreshes): the
        # registry's epoch tells it from the workers leaving
        await reg.register(info("d4", "decode"))
        await r.refresh()
        await reg.conn.call(lambda c: c.flushall())
        await r.refresh()
        assert {w.id for w in r._pool("decode")} == {"d1", "d4"}
        await asyncio.sleep(0.9)
        await r.refresh()  # the grace is over and they never came back
        assert r._pool("decode") == []
        # every worker leaving on its own (the epoch stays): retired at once
        for wid in ("d5", "d6"):
            await reg.register(info(wid, "decode"))
        await r.refresh()
        assert {w.id for w in r._pool("decode")} == {"d5", "d6"}
        await reg.deregister("d5")
        await reg.deregister("d6")
        await r.refresh()
        assert r._pool("decode") == []
        await reg.close()
    asyncio.run(go())


def test_a_worker_leaving_right_after_the_gateway_started_is_retired_at_once(redis_proc):
    """The gateway's first listing is no recovery from an outage: a worker that leaves the
    registry (SIGTERM: draining) a second after the gateway started is retired at once, so
    the prober that then finds it refusing calls lets its streams drain there. (The first
    listing started the registry grace: the worker stayed 'registered' for 3 s and its
    streams were moved -- a CI failure of test_faults' SIGTERM test on a slow machine.)"""
    from services.registry import WorkerRegistry

    async def go():
        reg = WorkerRegistry(redis_proc.url, timeout_s=0.5, cooldown_s=0.05)
        for wid in ("d1", "d2"):
            await reg.register(info(wid, "decode"))
        r = make_router(registry=reg)  # as gateway.main builds it (default grace, 3 s)
        await r.refresh()
        assert r.registry_ok and {w.id for w in r._pool("decode")} == {"d1", "d2"}
        await reg.deregister("d2")
        await r.refresh()
        assert {w.id for w in r._pool("decode")} == {"d1"}
        w = r.workers.get("d2")
        assert w is None or not w.registered
        await reg.close()
    asyncio.run(go())


def test_a_draining_worker_gets_no_new_work_and_keeps_its_streams(redis_proc, monkeypatch):
    """A decode worker that said it is draining (on its GenerateMany stream) is routed
    around, and when its server then refuses probes its streams are not moved -- even while
    the registry still lists it (Redis was unreachable for its deregistration, or the
    gateway's listing failed). A worker that stops answering without saying so still has
    its streams moved. One still serving streams DRAIN_MARGIN_S after its grace period
    (hung while draining) has them moved. A configured worker that drained is routable
    again only once a probe sent after it said so finds it not draining (a new process);
    answering probes is not enough (the old one answers during its drain delay)."""
    import time

    import gateway.router as router_mod
    from gateway.router import Worker
    from services.registry import WorkerRegistry

    monkeypatch.setattr(router_mod, "DRAIN_MARGIN_S", 0.05)

    async def go():
        reg = WorkerRegistry(redis_proc.url, timeout_s=0.5, cooldown_s=0.05)
        for wid in ("d1", "d2", "d3", "d4"):
            await reg.register(info(wid, "decode"))
        r = make_router(registry=reg)
        await r.refresh()
        cut: dict[str, list[str]] = {"d1": [], "d2": [], "d4": []}
        for wid in cut:
            r.workers[wid].watchers.add(cut[wid].append)
        r.draining("d1:1", grace_s=30)  # d1's address
        r.draining("d4:1", grace_s=0.05)  # d4 then hangs: its streams never end
        assert {w.id for w in r._pool("decode")} == {"d2", "d3"}
        await r.refresh()  # still listed
        assert r.workers["d1"].registered
        r.set_health(r.workers["d1"], False)
        r.set_health(r.workers["d2"], False)  # stopped answering, said nothing
        assert cut == {"d1": [], "d2": ["lost"], "d4": []}
        await asyncio.sleep(0.3)  # d4's grace and the margin are over
        assert cut == {"d1": [], "d2": ["lost"], "d4": ["lost"]}
        assert (await r.route(8, [])).decode.id == "d3"
        s = Worker(info("s1", "decode"), static=True)
        r.workers["s1"] = s
        before = time.monotonic()
        r.draining("s1:1", grace_s=30)
        r.learn_draining(s, False, sent=before)  # a probe it answered before it drained
        r.set_health(s, True)
        assert not s.routable
        r.set_health(s, False)
        r.set_health(s, True)  # answers again: still the old process, as far as known
        assert not s.routable
        r.learn_draining(s, False, sent=time.monotonic())  # a new process at that address
        assert s.routable
        r.learn_draining(s, True, sent=time.monotonic())  # draining, said in Stats
        assert not s.routable
        await reg.close()
    asyncio.run(go())


def test_index_down_falls_back_to_load_only(redis_proc):
    async def go():
        idx = PrefixIndex(redis_proc.url, "m")
        redis_proc.kill()
        r = make_router(index=idx)
        add(r, info("p1", "prefill", running=4), info("p2", "prefill"), info("d1", "decode"))
        route = await r.route(64, BlockHasher("s", "m", BS).hash_blocks(list(range(64))))
        assert route.prefill.id == "p2" and not route.index_ok
        assert r.stats["load_only"] == 1
        await idx.close()
    asyncio.run(go())


# ------------------------------------------------ conditional disaggregation (local prefill)
def busy_pair(pending=10_000, **kw):
    r = make_router(**kw)
    add(r, info("p1", "prefill"), info("d1", "decode"))
    r.workers["p1"].pending_prefill_tokens = pending
    return r


def test_local_prefill_is_off_by_default():
    async def go():
        r = busy_pair()
        route = await r.route(32, [])
        assert route.prefill.id == "p1" and not route.local
        assert route_mode(route) == "load_only"  # no prefix index in these tests
        assert route.prefill_tokens == 32 and r.stats["local_prefill"] == 0
    asyncio.run(go())


def test_short_prompt_prefills_on_the_decode_worker_while_the_prefill_worker_is_busy():
    async def go():
        r = busy_pair(pending=8192, local_prefill_max_tokens=512,
                      local_prefill_queue_tokens=8192)
        route = await r.route(512, [])
        assert route.prefill is None and route.local and route.decode.id == "d1"
        assert route.cached_tokens == 0 and route.prefill_tokens == 512  # charged to d1
        assert route_mode(route) == "local_prefill"
        assert r.stats == {"routed": 1, "prefix_routed": 0, "load_only": 1, "colocated": 0,
                           "local_prefill": 1}
        # longer than the limit: the prefill worker, however busy
        route = await r.route(513, [])
        assert route.prefill.id == "p1" and not route.local and route.prefill_tokens == 513
        # the prefill worker's queue below the threshold: remote
        r.workers["p1"].pending_prefill_tokens = 8191
        route = await r.route(32, [])
        assert route.prefill.id == "p1" and not route.local
        assert r.stats["local_prefill"] == 1 and r.stats["routed"] == 3
    asyncio.run(go())


def test_a_decode_worker_backed_up_with_local_prefills_gets_no_more():
    """--local-prefill-decode-tokens caps the uncached tokens a decode worker prefills
    locally at once: a route charges them to it from begin() until its first token comes
    back (prefilled() or end()), and a prompt that would exceed the cap goes to the
    prefill worker, however busy that one is."""
    async def go():
        r = busy_pair(pending=0, local_prefill_max_tokens=512, local_prefill_queue_tokens=0,
                      local_prefill_decode_tokens=600)
        d = r.workers["d1"]
        first = await r.route(400, [])
        assert first.local and first.prefill_tokens == 400
        r.begin(first)
        assert d.pending_prefill_tokens == 400 and r.workers["p1"].pending_prefill_tokens == 0
        second = await r.route(300, [])  # 400 + 300 > 600
        assert second.prefill.id == "p1" and not second.local
        assert (await r.route(200, [])).local  # 400 + 200 fits
        r.prefilled(first)  # its first token: the decode worker has room again
        assert d.pending_prefill_tokens == 0
        third = await r.route(300, [])
        assert third.local
        r.begin(third)
        r.end(third)  # ended before any token: released too, and only once
        r.prefilled(third)
        r.end(first)
        assert d.pending_prefill_tokens == 0 and d.inflight == 0
    asyncio.run(go())


def test_no_queue_threshold_sends_every_short_prompt_local():
    async def go():
        r = busy_pair(pending=0, local_prefill_max_tokens=64, local_prefill_queue_tokens=0)
        assert (await r.route(64, [])).local
        assert (await r.route(65, [])).prefill.id == "p1"
    asyncio.run(go())


def test_decode_workers_cached_prefix_counts_toward_local_prefill(redis_server):
    async def go():
        from services.registry import WorkerRegistry
        idx = PrefixIndex(redis_server, "m")
        reg = WorkerRegistry(redis_server)
        for wid, role in (("p1", "prefill"), ("d1", "decode")):
            await reg.register(info(wid, role))
        toks = list(range(BS * 40))  # 640 tokens
        hashes = BlockHasher("s", "m", BS).hash_blocks(toks)
        await idx.publish_stored("p1", hashes[:10])
        await idx.publish_stored("d1", hashes[:30])  # 160 tokens left to compute on d1
        r = busy_pair(index=idx, local_prefill_max_tokens=100)
        route = await r.route(len(toks), hashes)
        assert route.prefill.id == "p1" and route.prefill_tokens == 640 - 10 * BS
        await idx.publish_stored("d1", hashes[30:36])  # 64 tokens left
        route = await r.route(len(toks), hashes)
        assert route.prefill is None and route.local and route.decode.id == "d1"
        assert route.cached_tokens == 36 * BS and route_mode(route) == "local_prefill"
        assert r.stats["prefix_routed"] == 2 and r.stats["local_prefill"] == 1
        await idx.close()
        await reg.close()
    asyncio.run(go())


def test_pending_prefill_tokens_are_charged_once_and_released_once():
    async def go():
        r = busy_pair(pending=0)
        p = r.workers["p1"]
        a, b = await r.route(100, []), await r.route(40, [])
        r.begin(a)
        r.begin(b)
        assert p.pending_prefill_tokens == 140 and p.inflight == 2
        r.prefilled(a)  # a's first token
        r.prefilled(a)
        assert p.pending_prefill_tokens == 40 and a.prefilled
        r.end(a)  # already released: only the in-flight count drops
        assert p.pending_prefill_tokens == 40 and p.inflight == 1
        r.end(b)  # ended before its first token (failed, cancelled): released here
        assert p.pending_prefill_tokens == 0 and p.inflight == 0 and b.prefilled
        r.prefilled(b)
        assert p.pending_prefill_tokens == 0
    asyncio.run(go())


def test_local_routes_charge_the_decode_worker_and_colocated_ones_nothing():
    async def go():
        r = busy_pair(pending=500, local_prefill_max_tokens=64, local_prefill_queue_tokens=1)
        local = await r.route(64, [])
        assert local.local
        r.begin(local)
        assert r.workers["p1"].pending_prefill_tokens == 500
        assert r.workers["d1"].pending_prefill_tokens == 64 and r.workers["d1"].inflight == 1
        r.end(local)
        assert r.workers["p1"].pending_prefill_tokens == 500
        assert r.workers["d1"].pending_prefill_tokens == 0 and r.workers["d1"].inflight == 0
        r2 = make_router()
        add(r2, info("c1", "colocated"))
        co = await r2.route(64, [])
        assert co.prefill is None and not co.local and co.prefill_tokens == 0
        assert route_mode(co) == "colocated"
        r2.begin(co)
        assert r2.workers["c1"].pending_prefill_tokens == 0
        r2.end(co)
    asyncio.run(go())


def test_local_prefill_settings():
    from services.config import ConfigError, gateway_settings
    base = ["--decode-addrs", "d:1"]
    s = gateway_settings(base, env={})
    assert (s.local_prefill_max_tokens, s.local_prefill_queue_tokens,
            s.local_prefill_decode_tokens) == (0, 8192, 0)
    s = gateway_settings(base + ["--local-prefill-max-tokens", "512",
                                 "--local-prefill-decode-tokens", "2048"],
                         env={"PDSERVE_LOCAL_PREFILL_QUEUE_TOKENS": "0"})
    assert (s.local_prefill_max_tokens, s.local_prefill_queue_tokens,
            s.local_prefill_decode_tokens) == (512, 0, 2048)
    for flag in ("--local-prefill-max-tokens", "--local-prefill-queue-tokens",
                 "--local-prefill-decode-tokens"):
        with pytest.raises(ConfigError, match=flag.strip("-").replace("-", "_") + " must be >= 0"):
            gateway_settings(base + [flag, "-1"], env={})
