"""Router scoring: prefix overlap against load, decode by load, fallbacks (real Redis index)."""
from __future__ import annotations

import asyncio

import pytest

from gateway.router import NoWorkers, OverCapacity, Router
from services.block_hash import BlockHasher
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
