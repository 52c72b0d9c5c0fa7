"""Registry and prefix index against a real redis-server (no mocks)."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis

from pdcore.block_hash import hash_prompt
from services.prefix_index import IndexUnavailable, PrefixIndex
from services.registry import Heartbeat, RegistryUnavailable, WorkerInfo, WorkerLoad, WorkerRegistry

MODEL = "dummy:tiny"
H = hash_prompt(list(range(8 * 4)), "seed", MODEL, 4)  # 8 chained block hashes (bytes)


def run(coro):
    return asyncio.run(coro)


def info(worker_id: str, role: str = "prefill", model: str = MODEL) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, address=f"127.0.0.1:{1000 + len(worker_id)}",
                      role=role, model=model, kv_endpoint="tcp://127.0.0.1:9", capacity=8)


async def wait_for(pred, timeout_s: float, step_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        if await pred():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step_s)


def test_registry_register_list_by_role_and_deregister(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=5)
        await reg.register(info("p1").with_load(WorkerLoad(2, 1, 90, 100)))
        await reg.register(info("d1", "decode"))
        await reg.register(info("c1", "colocated", model="other"))
        assert [w.worker_id for w in await reg.list_workers()] == ["c1", "d1", "p1"]
        assert [w.worker_id for w in await reg.list_workers(role="decode")] == ["d1"]
        assert [w.worker_id for w in await reg.list_workers(model=MODEL)] == ["d1", "p1"]
        p1 = await reg.get("p1")
        assert (p1.running, p1.waiting, p1.kv_free_blocks, p1.kv_total_blocks) == (2, 1, 90, 100)
        assert p1.capacity == 8 and p1.kv_endpoint == "tcp://127.0.0.1:9" and p1.updated_ms > 0
        await reg.deregister("d1")
        assert [w.worker_id for w in await reg.list_workers()] == ["c1", "p1"]
        assert await reg.get("d1") is None
        await reg.close()

    run(main())


def test_registry_ttl_expiry_after_heartbeats_stop(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=0.6)
        loads = iter(range(1000))
        hb = Heartbeat(reg, info("p1"), interval_s=0.1,
                       load_fn=lambda: WorkerLoad(running=next(loads)))
        await hb.start()
        await asyncio.sleep(1.0)  # longer than the TTL: only heartbeats keep it alive
        w = await reg.get("p1")
        assert w is not None and w.running >= 5  # load refreshed by each beat
        await hb.stop(deregister=False)  # a crash: no deregistration
        stopped = time.monotonic()
        gone = await wait_for(lambda: _absent(reg, "p1"), timeout_s=1.5)
        assert gone - stopped <= 0.6 + 0.2
        assert await reg.list_workers() == []  # and the listing set was cleaned lazily
        assert not await reg.conn.client.sismember("pdserve:workers", "p1")
        await reg.close()

    run(main())


async def _absent(reg, worker_id):
    return await reg.get(worker_id) is None


def test_heartbeat_calls_on_lost_when_its_key_vanished(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=1.0)
        lost = []
        hb = Heartbeat(reg, info("p1"), interval_s=0.1, on_lost=lambda: lost.append(1))
        await hb.start()
        await asyncio.sleep(0.25)
        assert lost == []
        await reg.conn.client.delete(reg.key("p1"))  # as after a Redis restart
        await wait_for(lambda: _present(reg, "p1"), timeout_s=1.0)
        await asyncio.sleep(0.05)
        assert lost == [1]
        await hb.stop()
        assert await reg.get("p1") is None  # clean shutdown deregisters at once
        await reg.close()

    run(main())


def test_deregistration_outlasts_a_short_redis_stall(redis_proc):
    """A worker shutting down while Redis stalls (SIGSTOP for 0.6 s: each call times out)
    is still deregistered once Redis answers within half a TTL: it is not left listed
    while it drains (one try used to give up at the first timeout)."""
    import os

    async def main():
        reg = WorkerRegistry(redis_proc.url, ttl_s=3.0, timeout_s=0.2, cooldown_s=0.1)
        hb = Heartbeat(reg, info("d1", role="decode"))
        await hb.start()
        assert await reg.get("d1") is not None
        pid = redis_proc.proc.pid
        os.kill(pid, signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        loop.call_later(0.6, os.kill, pid, signal.SIGCONT)
        try:
            t0 = time.monotonic()
            await hb.stop()
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await reg.get("d1") is None, took
        assert took < 1.5 + 0.5  # half the TTL, and one call's timeout
        await reg.close()

    run(main())


async def _present(reg, worker_id):
    return await reg.get(worker_id) is not None


def test_longest_prefix_exact_counts_with_partial_overlap(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=30)
        idx = PrefixIndex(redis_server, MODEL)
        for w in ("A", "B", "C", "E"):
            await reg.register(info(w))
        await idx.publish_stored("A", H[:5])             # blocks 0-4
        await idx.publish_stored("B", H[:2] + H[3:4])    # 0, 1, 3 (gap at 2)
        await idx.publish_stored("C", H[1:4])            # 1-3, no block 0
        await idx.publish_stored("D", H)                 # everything, but never registered
        await idx.publish_stored("E", [H[0].hex()])      # hex strings work too
        assert await idx.longest_prefix(H) == {"A": 5, "B": 2, "E": 1}
        assert await idx.longest_prefix(H[:3]) == {"A": 3, "B": 2, "E": 1}
        assert await idx.longest_prefix([]) == {}
        other = hash_prompt(list(range(100, 132)), "seed", MODEL, 4)
        assert await idx.longest_prefix(other) == {}

        await idx.publish_removed("A", [H[2]])  # evicted in the middle: A stops at 2
        assert await idx.longest_prefix(H) == {"A": 2, "B": 2, "E": 1}
        await idx.publish_removed("B", [H[0]])
        assert await idx.longest_prefix(H) == {"A": 2, "E": 1}
        assert await idx.worker_hashes("A") == {h.hex() for h in (H[0], H[1], H[3], H[4])}

        assert await idx.clear_worker("A") == 4
        assert await idx.longest_prefix(H) == {"E": 1}
        assert await idx.worker_hashes("A") == set()
        assert "A" not in await idx.workers()
        r = idx.conn.client
        assert await r.smembers(f"pdserve:idx:{MODEL}:blk:{H[4].hex()}") == {"D"}
        assert await r.smembers(f"pdserve:idx:{MODEL}:blk:{H[0].hex()}") == {"D", "E"}
        await idx.close()
        await reg.close()

    run(main())


def test_models_never_share_entries(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=30)
        await reg.register(info("A"))
        m1, m2 = PrefixIndex(redis_server, "m1"), PrefixIndex(redis_server, "m2")
        await m1.publish_stored("A", H[:3])
        assert await m1.longest_prefix(H) == {"A": 3}
        assert await m2.longest_prefix(H) == {}
        await m2.clear_worker("A")
        assert await m1.longest_prefix(H) == {"A": 3}
        for c in (m1, m2, reg):
            await c.close()

    run(main())


def test_stale_worker_ignored_at_once_and_reaped(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=0.5)
        idx = PrefixIndex(redis_server, MODEL)
        dead = Heartbeat(reg, info("dead"), interval_s=0.1)
        live = Heartbeat(reg, info("live"), interval_s=0.1)
        await dead.start()
        await live.start()
        await idx.publish_stored("dead", H)
        await idx.publish_stored("live", H[:2])
        assert await idx.longest_prefix(H) == {"dead": 8, "live": 2}
        assert await idx.reap() == []  # nobody is dead yet

        await dead.stop(deregister=False)  # crash
        await wait_for(lambda: _absent(reg, "dead"), timeout_s=1.5)
        # Before any reaper ran, the dead worker is already invisible to lookups...
        assert await idx.longest_prefix(H) == {"live": 2}
        assert len(await idx.worker_hashes("dead")) == 8
        # ...and the reaper removes its entries physically, leaving the live worker alone.
        assert await idx.reap() == ["dead"]
        assert await idx.workers() == {"live"}
        assert await idx.worker_hashes("dead") == set()
        r = idx.conn.client
        assert sorted(await r.keys(f"pdserve:idx:{MODEL}:blk:*")) == sorted(
            f"pdserve:idx:{MODEL}:blk:{h.hex()}" for h in H[:2])
        assert await idx.clear_worker("live", only_if_dead=True) == 0  # alive: untouched
        assert await idx.longest_prefix(H) == {"live": 2}
        await live.stop()
        await idx.close()
        await reg.close()

    run(main())


def test_reaper_task_cleans_up_in_the_background(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=0.3)
        idx = PrefixIndex(redis_server, MODEL)
        await reg.register(info("w"))
        await idx.publish_stored("w", H)
        task = asyncio.create_task(idx.run_reaper(interval_s=0.1))
        await wait_for(lambda: _no_workers(idx), timeout_s=2.0)
        task.cancel()
        # only the {ns}:workers listing set and the registry's epoch are left
        assert sorted(await idx.conn.client.keys("*")) == ["pdserve:epoch", "pdserve:workers"]
        await idx.close()
        await reg.close()

    run(main())


async def _no_workers(idx):
    return not await idx.workers()


def test_redis_killed_fails_fast_with_typed_errors_then_recovers(redis_proc, redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=1.0, timeout_s=0.25, cooldown_s=0.3)
        idx = PrefixIndex(redis_server, MODEL, timeout_s=0.25, cooldown_s=0.3)

        async def republish():
            await idx.publish_stored("p1", H[:4])

        hb = Heartbeat(reg, info("p1"), interval_s=0.1, on_lost=republish)
        await hb.start()
        await republish()
        assert await idx.longest_prefix(H) == {"p1": 4}

        redis_proc.kill()
        for call in (lambda: idx.longest_prefix(H), lambda: idx.publish_stored("p1", H[:1]),
                     lambda: idx.reap()):
            t0 = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await call()
            assert time.monotonic() - t0 < 0.6
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            await reg.list_workers()
        assert time.monotonic() - t0 < 0.6
        await asyncio.sleep(0.3)  # the heartbeat keeps failing quietly meanwhile

        redis_proc.start()  # same port, empty: the heartbeat re-registers, on_lost republishes
        t0 = time.monotonic()
        await wait_for(lambda: _prefix_is(idx, {"p1": 4}), timeout_s=3.0, step_s=0.05)
        assert time.monotonic() - t0 < 2.0
        assert [w.worker_id for w in await reg.list_workers()] == ["p1"]
        await hb.stop()
        await idx.close()
        await reg.close()

    run(main())


async def _prefix_is(idx, expected):
    try:
        return await idx.longest_prefix(H) == expected
    except IndexUnavailable:
        return False


def test_unresponsive_redis_times_out_quickly(redis_proc, redis_server):
    async def main():
        idx = PrefixIndex(redis_server, MODEL, timeout_s=0.2, cooldown_s=0.2)
        assert await idx.longest_prefix(H) == {}  # connected
        redis_proc.proc.send_signal(signal.SIGSTOP)  # alive but not answering
        try:
            t0 = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await idx.longest_prefix(H)
            assert time.monotonic() - t0 < 0.7
            t0 = time.monotonic()
            with pytest.raises(IndexUnavailable, match="cooling down"):
                await idx.longest_prefix(H)  # circuit open: no network wait at all
            assert time.monotonic() - t0 < 0.05
        finally:
            redis_proc.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.25)
        assert await idx.longest_prefix(H) == {}
        await idx.close()

    run(main())


def test_lookup_is_one_round_trip_and_fast_for_long_prompts(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=30)
        idx = PrefixIndex(redis_server, MODEL)
        long = hash_prompt(list(range(16 * 2000)), "seed", MODEL, 16)  # 2000 blocks
        for i in range(8):
            await reg.register(info(f"w{i}"))
            await idx.publish_stored(f"w{i}", long[: 250 * (i + 1)])
        await idx.longest_prefix(long)  # loads the script
        r = idx.conn.client
        before = await r.info("commandstats")
        t0 = time.monotonic()
        got = await idx.longest_prefix(long)
        elapsed = time.monotonic() - t0
        after = await r.info("commandstats")
        assert got == {f"w{i}": 250 * (i + 1) for i in range(8)}
        # one command from the client (the EVALSHA): every read ran inside the script
        assert after["cmdstat_evalsha"]["calls"] - before["cmdstat_evalsha"]["calls"] == 1
        assert elapsed < 0.5
        await idx.close()
        await reg.close()

    run(main())


def test_sync_client_sees_the_documented_key_layout(redis_server):
    async def main():
        reg = WorkerRegistry(redis_server, ttl_s=30)
        idx = PrefixIndex(redis_server, MODEL)
        await reg.register(info("A"))
        await idx.publish_stored("A", H[:1])
        await idx.close()
        await reg.close()

    run(main())
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    assert sorted(r.keys("*")) == sorted([
        "pdserve:worker:A", "pdserve:workers", "pdserve:epoch", f"pdserve:idx:{MODEL}:workers",
        f"pdserve:idx:{MODEL}:wrk:A", f"pdserve:idx:{MODEL}:blk:{H[0].hex()}"])
    assert 0 < r.pttl("pdserve:worker:A") <= 30_000
    assert r.pttl(f"pdserve:idx:{MODEL}:wrk:A") == -1  # no TTL: kept until reaped
    r.close()


def test_a_cancellation_redis_py_turned_into_a_timeout_still_cancels(redis_server):
    """redis-py's cleanup runs under asyncio.timeout, which can replace our CancelledError
    with a TimeoutError; a retry loop would then never stop. RedisConn re-raises the
    cancellation, and Heartbeat.stop is bounded either way."""
    from redis import exceptions as rexc

    from services.redis_client import RedisConn

    async def main():
        conn = RedisConn(redis_server)

        async def swallowing(client):
            await client.ping()  # a real round trip first
            asyncio.current_task().cancel()  # our cancellation arrives...
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                raise rexc.TimeoutError("Timeout reading from socket")  # ...and is converted

        with pytest.raises(asyncio.CancelledError):
            await conn.call(swallowing)
        asyncio.current_task().uncancel()
        assert conn.available  # a cancellation is not an outage: no cooldown
        assert await conn.call(lambda c: c.ping())
        await conn.close()

        # A heartbeat whose loop swallows a cancellation (as it did before the guard) still stops
        reg = WorkerRegistry(redis_server, ttl_s=2.0)
        hb = Heartbeat(reg, info("p1"), interval_s=0.01)
        await hb.start()
        real_beat, swallowed = hb.beat, []

        async def beat_swallowing_once():
            try:
                await real_beat()
                await asyncio.sleep(0.3)  # where the cancellation lands
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)
                raise RegistryUnavailable("converted")

        hb.beat = beat_swallowing_once
        await asyncio.sleep(0.15)
        t0 = time.monotonic()
        await asyncio.wait_for(hb.stop(), timeout=5)
        assert time.monotonic() - t0 < 2.0 and swallowed == [1]
        assert await reg.get("p1") is None
        await reg.close()

    run(main())


def test_a_cancellation_during_a_command_is_never_lost(redis_server):
    """A task cancelled while its command is in flight raises CancelledError, even where
    redis-py swallows the cancellation and returns the reply (it did for 150 of 200 such
    cancels here before the guard: the gateway then routed, and served to the end, requests
    whose HTTP client had already gone)."""
    from services.redis_client import RedisConn

    async def main():
        conn = RedisConn(redis_server)
        script = conn.client.register_script("return redis.call('ECHO', ARGV[1])")
        assert await conn.call(lambda c: script(args=["warm"])) == "warm"
        outcomes = {"cancelled": 0, "returned": 0}
        for i in range(80):
            t = asyncio.ensure_future(conn.call(lambda c: script(args=["x"])))
            for _ in range(i % 4):  # let the command get to different points first
                await asyncio.sleep(0)
            if not t.cancel():
                continue  # finished before the cancel: nothing to lose
            try:
                await t
                outcomes["returned"] += 1
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
        assert outcomes["returned"] == 0 and outcomes["cancelled"] > 0, outcomes
        assert conn.available and await conn.call(lambda c: c.ping())  # no cooldown
        await conn.close()
    run(main())
