"""Probing the workers: who answers, and (for workers configured by address) what they hold.

Every ``interval_s`` each known worker gets a Stats call with a ``timeout_s`` deadline (Stats
answers from the engine's latest counters, so a busy worker answers at once). After
``failures`` failed probes in a row the worker is unhealthy: the router routes around it and
its streams end so that their requests resume elsewhere (Router.set_health); one answer
makes it healthy again. A worker that stopped (SIGSTOP, a hung host, a partition) is thus
out of rotation within about ``interval_s * failures + timeout_s`` (3 s by default).

A probe that times out while the worker's decode streams delivered a response is no strike:
the worker is alive, its answer only late (an overloaded host: its event loop shares the
cores with the engine). Counting it made a busy worker "lost" and ended every stream it
served, with nowhere else to go when it was the only decode worker. A stopped or cut-off
worker delivers nothing, so it is judged as before.

Each answer also updates what the router knows of the worker: its role, capacity and context
limit, and -- for a worker configured by address, which has no registry heartbeat -- its
load, so shedding and routing follow the real worker, not an assumed one.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
import logging
import time

import grpc

from protos.pdserve.v1 import common_pb2, worker_pb2_grpc
from services.grpc_server import ChannelPool

logger = logging.getLogger(__name__)

ROLE_NAMES = {common_pb2.WORKER_ROLE_PREFILL: "prefill", common_pb2.WORKER_ROLE_DECODE: "decode",
              common_pb2.WORKER_ROLE_COLOCATED: "colocated"}


class HealthProber:
    def __init__(self, router, *, interval_s: float = 1.0, timeout_s: float = 1.0,
                 failures: int = 2, tls=None, late_counter=None):
        """``late_counter``: a metric's counter, incremented for each late probe that is no
        strike (a worker that streams but answers slowly: overloaded)."""
        self.router = router
        self.late_counter = late_counter
        self.interval_s, self.timeout_s, self.failures = interval_s, timeout_s, failures
        self._strikes: dict[str, int] = {}
        self._decode = ChannelPool(worker_pb2_grpc.DecodeWorkerStub, tls=tls)
        self._prefill = ChannelPool(worker_pb2_grpc.PrefillWorkerStub, tls=tls)

    async def run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # noqa: BLE001 - probing must never die
                logger.exception("health probe round failed")
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        workers = list(self.router.workers.values())
        await asyncio.gather(*(self.probe(w) for w in workers))
        for wid in list(self._strikes):
            if wid not in self.router.workers:
                del self._strikes[wid]

    async def probe(self, worker) -> bool:
        pool = self._prefill if worker.info.role == "prefill" else self._decode
        sent = time.monotonic()
        try:
            st = await pool.stub(worker.info.address).Stats(common_pb2.StatsRequest(),
                                                            timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED and worker.heard_at >= sent:
                # late, but its streams delivered meanwhile: alive (see the module)
                logger.debug("probe of %s timed out while its streams delivered: alive",
                             worker.id)
                self._strikes[worker.id] = 0
                if self.late_counter is not None:
                    self.late_counter.inc()
                return True
            n = self._strikes[worker.id] = self._strikes.get(worker.id, 0) + 1
            logger.debug("probe of %s failed (%d): %s", worker.id, n, e.code().name)
            if n >= self.failures:
                if worker.healthy:  # did it leave the registry (draining)? read it first
                    try:
                        await self.router.refresh()
                    except Exception:  # noqa: BLE001 - judged on what is known
                        logger.debug("registry refresh before a verdict failed", exc_info=True)
                self.router.set_health(worker, False)
            return False
        self._strikes[worker.id] = 0
        self._learn(worker, st)
        self.router.learn_draining(worker, st.draining, sent)
        self.router.set_health(worker, True)
        return True

    def _learn(self, worker, st: common_pb2.StatsResponse) -> None:
        info = worker.info
        kw = {}
        if st.capacity:
            kw["capacity"] = st.capacity
        if st.max_model_len:
            kw["max_model_len"] = st.max_model_len
        if worker.static:  # no heartbeat: the probe is its load report
            kw.update(running=st.num_running, waiting=st.num_waiting,
                      kv_free_blocks=st.kv_blocks_free, kv_total_blocks=st.kv_blocks_total)
            role = ROLE_NAMES.get(st.role)
            if role and role != info.role and info.role != "prefill":
                kw["role"] = role  # a static "decode" address that is colocated
        if kw:
            worker.info = replace(info, **kw)

    async def close(self) -> None:
        await self._decode.close()
        await self._prefill.close()
