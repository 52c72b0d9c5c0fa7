"""Which peers a worker may dial (services/membership.py), against a real redis-server: a burst
of requests for a target shares one registry read; while Redis cannot be read a member seen
before stays one and a target never seen is UNAVAILABLE (retry), not PERMISSION_DENIED.
(A chaos run on 2 cores found 80 concurrent first requests each reading the registry, the
reads timing out, the Redis breaker opening and requests refused as non-members.)"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from services.membership import Membership, MembershipUnknown, NotMember
from services.registry import WorkerInfo, WorkerRegistry

PREFILL = WorkerInfo("p1", "127.0.0.1:7001", "prefill", "m")
DECODE = WorkerInfo("d1", "127.0.0.1:7002", "decode", "m", kv_endpoint="tcp://127.0.0.1:7102")


class CountingRegistry:
    """The real registry, counting the reads that reach Redis."""

    def __init__(self, reg: WorkerRegistry):
        self.reg, self.reads = reg, 0

    async def list_workers(self, **kw):
        self.reads += 1
        return await self.reg.list_workers(**kw)


async def _setup(url: str):
    reg = WorkerRegistry(url, ttl_s=30)
    await reg.register(PREFILL)
    await reg.register(DECODE)
    return reg, CountingRegistry(reg)


def test_a_burst_of_admits_shares_one_read(redis_server):
    async def go():
        reg, counting = await _setup(redis_server)
        m = Membership(counting, model="m")
        await asyncio.gather(*(m.admit(PREFILL.address, "prefill") for _ in range(80)))
        assert counting.reads == 1
        await m.admit("tcp://127.0.0.1:7102", "receiver")  # fresh: no read
        assert counting.reads == 1
        with pytest.raises(NotMember, match="not a registered member"):
            await m.admit("10.0.0.9:1", "prefill")
        with pytest.raises(NotMember):  # a decode worker is no prefill target
            await m.admit(DECODE.address, "prefill")
        await reg.close()
    asyncio.run(go())


def test_a_waiter_cancelled_does_not_cancel_the_shared_read(redis_server):
    async def go():
        reg, counting = await _setup(redis_server)
        m = Membership(counting, model="m")
        first = asyncio.ensure_future(m.admit(PREFILL.address, "prefill"))
        second = asyncio.ensure_future(m.admit(PREFILL.address, "prefill"))
        await asyncio.sleep(0)
        first.cancel()
        await second  # still admitted, by the one read
        assert first.cancelled() and counting.reads == 1
        await reg.close()
    asyncio.run(go())


def test_registry_unreadable_known_members_stay_unknown_targets_wait_then_unavailable(
        redis_proc):
    async def go():
        reg, counting = await _setup(redis_proc.client_url)
        m = Membership(counting, model="m", refresh_s=0.01, unknown_wait_s=1.0)
        assert await m.refresh()
        os.kill(redis_proc.proc.pid, signal.SIGSTOP)  # reads now time out
        try:
            await asyncio.sleep(0.3)  # past MIN_REFRESH_S: admits read again
            t = time.monotonic()
            await m.admit(PREFILL.address, "prefill")  # seen before: at once, still a member
            assert time.monotonic() - t < 0.1
            await asyncio.sleep(0)
            assert counting.reads == 2  # the re-read runs in the background
            t = time.monotonic()
            with pytest.raises(MembershipUnknown, match="registry cannot be read"):
                await m.admit("127.0.0.1:7999", "prefill")
            assert 0.9 < time.monotonic() - t < 3.0
        finally:
            os.kill(redis_proc.proc.pid, signal.SIGCONT)
        # a target that registers while Redis is slow is admitted once a read succeeds
        late = WorkerInfo("p2", "127.0.0.1:7003", "prefill", "m")
        for _ in range(50):  # the breaker's cooldown passes
            try:
                await reg.register(late)
                break
            except Exception:  # noqa: BLE001 - RegistryUnavailable while cooling down
                await asyncio.sleep(0.1)
        await m.admit(late.address, "prefill")
        await m.close()
        await reg.close()
    asyncio.run(go())


def test_without_enforcement_or_registry():
    async def go():
        await Membership(None, enforce=False).admit("anything:1", "prefill")
        await Membership(None).admit("anything:1", "prefill")  # certificates decide
        await Membership(None, ("a:1",)).admit("a:1", "prefill")
        with pytest.raises(NotMember, match="peer_addrs"):
            await Membership(None, ("a:1",)).admit("b:1", "prefill")
    asyncio.run(go())


def test_a_member_removed_from_the_registry_is_refused_after_the_background_read(redis_server):
    async def go():
        reg, counting = await _setup(redis_server)
        m = Membership(counting, model="m", refresh_s=0.05)
        await m.admit(PREFILL.address, "prefill")
        await reg.deregister(PREFILL.worker_id)
        await asyncio.sleep(0.3)
        await m.admit(PREFILL.address, "prefill")  # stale: admitted, a re-read starts
        while m._reading is not None:
            await asyncio.sleep(0.01)
        with pytest.raises(NotMember):
            await m.admit(PREFILL.address, "prefill")
        await m.close()
        await reg.close()
    asyncio.run(go())
