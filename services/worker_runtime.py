"""What every worker process shares, whatever its role: engine settings, registry heartbeat,
publishing block events to the global prefix index, and the Stats RPC payload.

Imports no torch: it talks to the engine only through an ``AsyncEngine``-like object.
"""
from __future__ import annotations

import asyncio
import logging

from engine.config import EngineConfig
from protos.pdserve.v1 import common_pb2
from services.config import WorkerSettings
from services.prefix_index import IndexUnavailable, PrefixIndex
from services.membership import Membership
from services.registry import (Heartbeat, RegistryUnavailable, WorkerInfo, WorkerLoad,
                               WorkerRegistry, new_worker_id)
from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

ROLE_PB = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE,
           "colocated": common_pb2.WORKER_ROLE_COLOCATED}


def engine_config(s: WorkerSettings) -> EngineConfig:
    """The engine a worker runs: its settings' ``engine`` section (one tree, no copy)."""
    return s.engine


class WorkerRuntime:
    """Registry membership, index publishing and stats of one worker process."""

    def __init__(self, settings: WorkerSettings, aengine, model_id: str, metrics=None,
                 tls=None):
        """``tls``: this worker's :class:`services.tls.ClusterTls` (signs its registry
        entry, checks the others'); None without certificates."""
        self.settings = settings
        self.tls = tls
        self.metrics = metrics  # services.metrics.WorkerMetrics: gauges follow engine stats
        self.aengine = aengine
        self.model_id = model_id
        self.address = ""
        self.worker_id = settings.worker_id
        self.transferred_bytes = 0
        self.active_transfers = 0
        self._load = WorkerLoad()
        self._tasks: list[asyncio.Task] = []
        self.registry = self.heartbeat = self.index = None
        self.members = Membership(static=settings.peer_addrs, enforce=not settings.insecure)
        self._resync = True  # publish every cached block on the first successful round

    @property
    def capacity(self) -> int:
        """Requests this worker runs at once: its engine's resolved max_num_seqs."""
        engine = getattr(self.aengine, "engine", None)
        config = getattr(engine, "config", None) or self.settings.engine
        return config.scheduler.max_num_seqs or 1

    def _connect(self, address: str, kv_endpoints: tuple[str, ...]) -> None:
        settings = self.settings
        self.address = address
        self.worker_id = settings.worker_id or new_worker_id(address)
        if settings.redis_url:
            kw = dict(namespace=settings.namespace, timeout_s=settings.redis_timeout_s,
                      auth=settings.redis_auth())
            self.registry = WorkerRegistry(settings.redis_url, ttl_s=settings.registry_ttl_s,
                                           signer=self.tls, verifier=self.tls, **kw)
            self.members = Membership(self.registry, settings.peer_addrs,
                                      enforce=not settings.insecure, model=self.model_id)
            info = WorkerInfo(worker_id=self.worker_id, address=address, role=settings.role,
                              model=self.model_id,
                              kv_endpoint=kv_endpoints[0] if kv_endpoints else "",
                              kv_endpoints=",".join(kv_endpoints),
                              capacity=self.capacity,
                              max_model_len=self.aengine.engine.max_model_len)
            self.heartbeat = Heartbeat(self.registry, info, interval_s=settings.heartbeat_s,
                                       load_fn=lambda: self._load, on_lost=self._on_lost)
            if settings.role in ("prefill", "colocated"):
                kw.pop("auth")
                self.index = PrefixIndex(settings.redis_url, self.model_id,
                                         auth=settings.redis_auth(), **kw)

    def _on_lost(self) -> None:
        self._resync = True  # our key expired: the reaper may have dropped our index entries

    async def start(self, address: str, kv_endpoints: tuple[str, ...] | str = ()) -> None:
        """Register as ``address`` (host:port others dial) with the endpoints of its KV
        receivers (preferred first) and start publishing."""
        if isinstance(kv_endpoints, str):
            kv_endpoints = (kv_endpoints,) if kv_endpoints else ()
        self._connect(address, tuple(kv_endpoints))
        await self._refresh_load()
        await self.members.refresh()  # know the members before the first request needs them
        if self.heartbeat is not None:
            await self.heartbeat.start()
        self._tasks.append(asyncio.create_task(self._load_loop(), name="load"))
        if self.index is not None:
            self._tasks.append(asyncio.create_task(self._publish_loop(), name="index-publish"))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        await self.members.close()
        if self.heartbeat is not None:
            await self.heartbeat.stop(deregister=True)
        if self.index is not None:
            try:
                await self.index.clear_worker(self.worker_id)
            except IndexUnavailable:
                pass
            await self.index.close()
        if self.registry is not None:
            await self.registry.close()

    # ------------------------------------------------------------------ load
    async def _refresh_load(self) -> None:
        st = await self.aengine.stats()
        kv_waiters = self.aengine.kv_block_waiters
        if self.metrics is not None:
            self.metrics.observe_engine(st, kv_waiters)
        self._load = WorkerLoad(running=st.num_running,
                                waiting=st.num_waiting + st.num_awaiting_kv + kv_waiters,
                                kv_free_blocks=st.kv_blocks_free, kv_total_blocks=st.kv_blocks_total)

    async def _load_loop(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(min(0.25, self.settings.heartbeat_s))
            try:
                await self._refresh_load()
                n += 1
                if n % 4 == 0:  # about once a second: who holds which blocks
                    await self.aengine.refresh_audit()
                    if self.metrics is not None:
                        self.metrics.kv_stranded.set(self.aengine.stranded())
            except Exception:  # noqa: BLE001 - engine dead; the heartbeat keeps the last load
                logger.exception("could not read engine stats")
                await asyncio.sleep(1.0)

    # ----------------------------------------------------------- prefix index
    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            try:
                await self.publish_once()
            except IndexUnavailable:
                self._resync = True  # events were lost: republish the whole cache later
            except RegistryUnavailable:
                self._resync = True
            except Exception:  # noqa: BLE001
                logger.exception("publishing block events failed")
                self._resync = True

    async def publish_once(self) -> None:
        resync = self._resync
        if resync:
            def snapshot(e):
                e.block_manager.drain_events()
                return list(e.block_manager.hash_to_block)
            held = await self.aengine.call(snapshot)
            await self.index.clear_worker(self.worker_id)
            await self.index.publish_stored(self.worker_id, held)
            self._resync = False
            logger.info("prefix index resynced: %d blocks", len(held))
            return
        ev = await self.aengine.call(lambda e: e.block_manager.drain_events())
        if ev.removed:
            await self.index.publish_removed(self.worker_id, ev.removed)
        if ev.stored:
            await self.index.publish_stored(self.worker_id, ev.stored)

    # ----------------------------------------------------------------- stats
    async def stats_proto(self, receivers=()) -> common_pb2.StatsResponse:
        st = await self.aengine.stats()
        active, nbytes = self.active_transfers, self.transferred_bytes
        for receiver in receivers:
            rs = receiver.stats()
            active += rs.active_transfers
            nbytes += rs.bytes_received
        return common_pb2.StatsResponse(
            worker_id=self.worker_id, role=ROLE_PB[self.settings.role], model=self.model_id,
            kv_blocks_total=st.kv_blocks_total, kv_blocks_free=st.kv_blocks_free,
            kv_blocks_used=st.kv_blocks_total - st.kv_blocks_free,
            block_size=self.settings.block_size, num_running=st.num_running,
            num_waiting=st.num_waiting + st.num_awaiting_kv,
            prefix_cache_query_tokens=st.prefix_query_tokens,
            prefix_cache_hit_tokens=st.prefix_hit_tokens, active_transfers=active,
            transferred_bytes=nbytes, capacity=self.capacity,
            max_model_len=self.aengine.engine.max_model_len,
            kv_blocks_stranded=self.aengine.stranded())
