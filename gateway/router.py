"""KV-aware routing: which prefill worker (prefix overlap vs load) and which decode worker (load).

Scores (higher wins; scores within ``TIE`` of the best count as tied, and ties go to fewer
pending prefill tokens, then fewer in-flight requests, then the next worker in turn)::

    load(w)          = max(inflight_w, running_w + waiting_w) / capacity_w + kv_usage_w
    prefill_score(w) = prefix_weight * cached_w / prompt_tokens - load(w)
    decode_score(w)  = -load(w)

``inflight_w`` is this gateway's own count of open requests on w (exact, instant);
``running/waiting/kv_usage`` come from w's registry heartbeat (up to a second stale);
``cached_w`` is the number of leading prompt tokens w holds, from one Redis prefix-index
lookup. With the default weight 1, a worker holding the whole prompt wins unless it is about
one full batch (its capacity) busier than the others. If Redis is down, ``cached_w`` is 0 for
everyone (load-only routing) and the last known worker list is kept.

Only workers that are registered (or configured), healthy (gateway.health: answering their
probes) and not routed around after a failed call are candidates; a worker that left the
registry keeps its in-flight requests but gets no new ones.

Placement: the best prefill worker ``p`` and the best decode worker ``d``; with no prefill
worker, a colocated one alone. Conditional disaggregation (``local_prefill_max_tokens`` > 0;
0, the default, is off): the request goes to ``d`` alone, which prefills it itself, when

    uncached_d = prompt_tokens - cached_d <= local_prefill_max_tokens
    and pending_prefill_tokens_p >= local_prefill_queue_tokens
    and (local_prefill_decode_tokens == 0
         or pending_prefill_tokens_d + uncached_d <= local_prefill_decode_tokens)

``pending_prefill_tokens_w`` is this gateway's own count of uncached prompt tokens it sent to
``w`` to prefill (a prefill worker, or a decode worker prefilling locally) whose first token
has not come back yet (exact, instant, like ``inflight_w``): a short prompt is computed on the
decode worker instead of queueing behind a backed-up prefill worker, as long as the decode
worker is not itself backed up with such prompts (a decode worker that falls behind returns
first tokens late, its count grows, and short prompts go back to the prefill pool).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
import logging
import math
import time

from services.prefix_index import IndexUnavailable, PrefixIndex
from services.registry import RegistryUnavailable, WorkerInfo, WorkerRegistry

logger = logging.getLogger(__name__)


TIE = 0.05  # scores closer than this (5% of a worker's capacity) are a tie
RECENT_S = 10.0  # time constant of the prompt tokens a worker was recently given
# a draining worker's streams still open this long after its grace period (which it ends
# itself) move: it hung while draining
DRAIN_MARGIN_S = 5.0


@dataclass
class Worker:
    info: WorkerInfo
    inflight: int = 0
    pending_prefill_tokens: int = 0  # uncached prompt tokens sent here to prefill, first
    #                                  token not back (a decode worker: local prefills)
    failures_until: float = 0.0  # routed around until then, after a failed call
    registered: bool = True  # listed by the registry (or configured); False: leaving
    draining: bool = False  # it said it is shutting down: no new work, its streams stay
    draining_since: float = 0.0  # time.monotonic() when the gateway learnt it
    healthy: bool = True  # answering its probes (gateway.health)
    static: bool = False  # configured by address (learns capacity and load by probing)
    # called with "lost" when it stops answering: the streams it serves end and resume
    watchers: set = field(default_factory=set)
    recent_tokens: float = 0.0  # prompt tokens routed here, decaying with RECENT_S
    recent_at: float = 0.0
    # time.monotonic() of the latest response its decode streams delivered: a worker that
    # streams is alive, however slow its probes' answers (gateway.health)
    heard_at: float = 0.0

    def recent(self, now: float) -> float:
        return self.recent_tokens * math.exp(-(now - self.recent_at) / RECENT_S)

    def add_recent(self, tokens: int, now: float) -> None:
        self.recent_tokens, self.recent_at = self.recent(now) + tokens, now

    @property
    def id(self) -> str:
        return self.info.worker_id

    @property
    def routable(self) -> bool:
        return (self.registered and self.healthy and not self.draining
                and self.failures_until <= time.monotonic())

    def load(self) -> float:
        cap = max(self.info.capacity, 1)
        queue = max(self.inflight, self.info.running + self.info.waiting)
        kv = 1.0 - self.info.kv_free_blocks / self.info.kv_total_blocks \
            if self.info.kv_total_blocks else 0.0
        return queue / cap + kv


@dataclass
class Route:
    decode: Worker
    prefill: Worker | None  # None: the decode (colocated) worker prefills itself
    cached_tokens: int  # predicted prefix hit on the worker that prefills
    index_ok: bool
    scores: dict[str, float] = field(default_factory=dict)
    local: bool = False  # prefill None because the prefill pool was busy (not colocated)
    prefill_tokens: int = 0  # uncached prompt tokens charged to the worker that prefills
    #                          (``prefill``, or ``decode`` when local) while it works
    prefilled: bool = False  # the charge was released (first token back, or the end)


class NoWorkers(Exception):
    pass


class OverCapacity(Exception):
    pass


class Router:
    def __init__(self, *, model: str, block_size: int, prefix_weight: float = 1.0,
                 registry: WorkerRegistry | None = None, index: PrefixIndex | None = None,
                 static_prefill: tuple[str, ...] = (), static_decode: tuple[str, ...] = (),
                 static_capacity: int = 64, queue_factor: float = 2.0,
                 local_prefill_max_tokens: int = 0, local_prefill_queue_tokens: int = 0,
                 local_prefill_decode_tokens: int = 0, model_max_len: int = 0,
                 registry_grace_s: float = 3.0):
        """``model_max_len``: the model's own context limit, used until a worker reports its
        own (:meth:`context_limit`). ``registry_grace_s``: see :meth:`refresh`."""
        self.model = model
        self.model_max_len = model_max_len
        self.block_size = block_size
        self.prefix_weight = prefix_weight
        self.registry = registry
        self.index = index
        self.queue_factor = queue_factor
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.local_prefill_queue_tokens = local_prefill_queue_tokens
        self.local_prefill_decode_tokens = local_prefill_decode_tokens
        self.workers: dict[str, Worker] = {}
        self.registry_grace_s = registry_grace_s
        self._grace_until = 0.0  # monotonic: missing workers that answer probes stay
        self._epoch: str | None = None  # the registry's epoch (services.registry) last seen
        self._outage = False  # the last listing failed (Redis unreachable)
        self._turns: dict[tuple[str, ...], int] = {}
        self.registry_ok = registry is None
        self.index_ok = index is None
        self.stats = {"routed": 0, "prefix_routed": 0, "load_only": 0, "colocated": 0,
                      "local_prefill": 0}
        for addr in static_prefill:
            self._add_static(addr, "prefill", static_capacity)
        for addr in static_decode:
            self._add_static(addr, "decode", static_capacity)

    def _add_static(self, addr: str, role: str, capacity: int) -> None:
        self.workers[addr] = Worker(WorkerInfo(worker_id=addr, address=addr, role=role,
                                               model=self.model, capacity=capacity),
                                    static=True)

    # ---------------------------------------------------------------- limits
    def context_limit(self) -> int:
        """Prompt + output tokens every worker that may serve a request accepts: the
        smallest limit the workers reported, else the model's."""
        known = [w.info.max_model_len for w in self.workers.values()
                 if w.registered and w.info.max_model_len > 0]
        return min(known) if known else self.model_max_len

    def seats(self) -> int:
        """Requests the routable decode pool runs at once (its capacity)."""
        pool = self._pool("decode") or self._pool("colocated")
        return sum(max(w.info.capacity, 1) for w in pool)

    # -------------------------------------------------------------- discovery
    async def refresh(self) -> None:
        """Follow the registry: discover workers, retire those that left it. A worker that
        leaves on its own (shutdown, or its heartbeat stopped) is retired at once. But a
        listing right after Redis was unreachable, or after the registry's epoch changed
        (Redis restarted empty: services.registry), says nothing about them: workers re-register within
        a heartbeat, so for ``registry_grace_s`` those that still answer their probes keep
        serving (the gateway failed every request in the second between a Redis restart
        and the workers' heartbeats). The gateway's first listing is neither: it starts no
        grace, so a worker leaving right after the gateway started is retired at once."""
        if self.registry is None:
            return
        try:
            infos = await self.registry.list_workers(model=self.model)
        except RegistryUnavailable:
            self.registry_ok, self._outage = False, True
            return  # keep the last known workers
        now = time.monotonic()
        epoch = getattr(self.registry, "epoch", None)
        wiped = self._epoch is not None and epoch != self._epoch  # Redis lost its data
        if self._outage or wiped:  # not the first listing: it retires no one it knew
            self._grace_until = now + self.registry_grace_s
        self._epoch = epoch
        self.registry_ok, self._outage = True, False
        seen = set()
        for info in infos:
            seen.add(info.worker_id)
            w = self.workers.get(info.worker_id)
            if w is None:
                self.workers[info.worker_id] = Worker(info)
                logger.info("discovered %s worker %s at %s", info.role, info.worker_id, info.address)
            else:
                w.info, w.registered = info, True
        for wid, w in list(self.workers.items()):
            if wid in seen or w.static:
                continue
            if w.registered and w.healthy and now < self._grace_until:
                continue  # the registry lost it, not the worker (see above)
            if w.registered:
                logger.info("worker %s left the registry: no new requests", wid)
                w.registered = False
            if w.inflight == 0:
                del self.workers[wid]

    async def run_refresh(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - discovery must never die
                logger.exception("registry refresh failed")
            await asyncio.sleep(interval_s)

    # ---------------------------------------------------------------- routing
    def _pool(self, *roles: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.info.role in roles and w.routable]

    def _best(self, pool: list[Worker], score) -> tuple[Worker, dict[str, float]]:
        """The best-scoring worker; near-ties (within TIE) go to the one with the fewest
        pending prefill tokens, then the fewest prompt tokens given recently (so equal load
        spreads tokens, not only requests), then the fewest requests in flight, then to
        each worker in turn."""
        scores = {w.id: score(w) for w in pool}
        top = max(scores.values())
        now = time.monotonic()

        def key(w: Worker) -> tuple:
            return (w.pending_prefill_tokens, round(w.recent(now)), w.inflight)
        tied = [w for w in pool if scores[w.id] >= top - TIE]
        least = min(key(w) for w in tied)
        tied = sorted((w for w in tied if key(w) == least), key=lambda w: w.id)
        group = tuple(w.id for w in tied)  # each group of tied workers takes its own turns
        turn = self._turns.get(group, 0)
        self._turns[group] = turn + 1
        if len(self._turns) > 4096:  # groups come and go with the workers
            self._turns.clear()
        return tied[turn % len(tied)], scores

    async def route(self, prompt_len: int, hashes: list[bytes],
                    exclude: frozenset[str] = frozenset()) -> Route:
        """``exclude``: decode workers not to use (those a request already failed on)."""
        decode_pool = [w for w in self._pool("decode") if w.id not in exclude]
        prefill_pool = self._pool("prefill")
        colocated = False
        if not decode_pool or not prefill_pool:
            # no disaggregated pair possible: colocated workers serve alone (also the fallback)
            decode_pool = [w for w in self._pool("colocated") if w.id not in exclude] \
                or decode_pool
            prefill_pool = []
            colocated = True
        if not decode_pool:
            raise NoWorkers("no workers available for model " + self.model)
        self._check_capacity(decode_pool)
        cached, index_ok = await self._cached(hashes, decode_pool)

        def prefix_score(w: Worker) -> float:
            hit = min(cached.get(w.id, 0) * self.block_size, prompt_len)
            return self.prefix_weight * hit / max(prompt_len, 1) - w.load()

        self.stats["routed"] += 1
        if colocated:
            self.stats["colocated"] += 1
            d, scores = self._best(decode_pool, prefix_score)
            hit = cached.get(d.id, 0) * self.block_size
            self._count(hit, index_ok)
            return Route(decode=d, prefill=None, cached_tokens=hit, index_ok=index_ok, scores=scores)
        p, scores = self._best(prefill_pool, prefix_score)
        d, _ = self._best(decode_pool, lambda w: -w.load())
        d_hit = min(cached.get(d.id, 0) * self.block_size, prompt_len)
        if self._prefill_locally(p, d, prompt_len - d_hit):
            self.stats["local_prefill"] += 1
            self._count(d_hit, index_ok)
            return Route(decode=d, prefill=None, cached_tokens=d_hit, index_ok=index_ok,
                         scores=scores, local=True, prefill_tokens=prompt_len - d_hit)
        hit = cached.get(p.id, 0) * self.block_size
        self._count(hit, index_ok)
        return Route(decode=d, prefill=p, cached_tokens=hit, index_ok=index_ok, scores=scores,
                     prefill_tokens=prompt_len - min(hit, prompt_len))

    async def _cached(self, hashes: list[bytes], decode_pool: list[Worker]
                      ) -> tuple[dict[str, int], bool]:
        """(worker id -> cached prefix blocks, whether the index answered)."""
        cached: dict[str, int] = {}
        index_ok = self.index is not None
        if self.index is not None and hashes:
            try:
                cached = await self.index.longest_prefix(hashes)
                self.index_ok = True
            except IndexUnavailable:
                self.index_ok = index_ok = False
            # requests routed while this one awaited Redis are counted now (Router.begin
            # follows route() without an await): judge the capacity again
            self._check_capacity(decode_pool)
        return cached, index_ok

    def _check_capacity(self, decode_pool: list[Worker]) -> None:
        cap = sum(max(w.info.capacity, 1) * self.queue_factor for w in decode_pool)
        if sum(w.inflight for w in decode_pool) >= cap:
            raise OverCapacity("all workers are at capacity; retry later")

    def _prefill_locally(self, p: Worker, d: Worker, uncached_on_decode: int) -> bool:
        """Conditional disaggregation: a short prompt while ``p`` is backed up and ``d``
        is not (module docstring)."""
        cap = self.local_prefill_decode_tokens
        return (0 < self.local_prefill_max_tokens
                and uncached_on_decode <= self.local_prefill_max_tokens
                and p.pending_prefill_tokens >= self.local_prefill_queue_tokens
                and (not cap or d.pending_prefill_tokens + uncached_on_decode <= cap))

    def _count(self, hit: int, index_ok: bool) -> None:
        if not index_ok:
            self.stats["load_only"] += 1
        elif hit:
            self.stats["prefix_routed"] += 1

    def begin(self, route: Route) -> None:
        now = time.monotonic()
        route.decode.inflight += 1
        route.decode.add_recent(route.prefill_tokens, now)
        if route.prefill is not None:
            route.prefill.inflight += 1
            route.prefill.add_recent(route.prefill_tokens, now)
        _prefiller(route).pending_prefill_tokens += route.prefill_tokens

    def prefilled(self, route: Route) -> None:
        """The prompt of a begun ``route`` is computed (its first token came back): release
        the prefill worker's pending tokens. Idempotent; :meth:`end` calls it too."""
        if route.prefilled:
            return
        route.prefilled = True
        _prefiller(route).pending_prefill_tokens -= route.prefill_tokens

    def end(self, route: Route) -> None:
        self.prefilled(route)
        route.decode.inflight -= 1
        if route.prefill is not None:
            route.prefill.inflight -= 1

    def mark_failed(self, worker: Worker, seconds: float = 2.0) -> None:
        """Route around a worker whose call failed, for ``seconds``."""
        worker.failures_until = time.monotonic() + seconds

    def draining(self, address: str, grace_s: float = 0.0) -> None:
        """The decode worker at ``address`` said (on its GenerateMany stream) that it is
        shutting down: no new work goes there, and its streams finish there -- when its
        server then refuses probes, :meth:`set_health` does not move them. (The registry
        tells the same, but later and not always: a listing that fails, or a deregistration
        that does, left such a worker 'registered' and its streams were moved.) At the end
        of its ``grace_s`` the worker ends what is still open itself (UNAVAILABLE: resumed
        elsewhere); streams still open DRAIN_MARGIN_S after that (a worker that hung while
        draining) move."""
        for w in list(self.workers.values()):
            if w.info.address == address:
                self._mark_draining(w, grace_s)

    def learn_draining(self, worker: Worker, draining: bool, sent: float) -> None:
        """A probe sent at ``sent`` (time.monotonic()) was answered: whether the worker
        said it is draining. A worker marked draining before that probe left that says it
        is not is another process now (restarted at a configured address)."""
        if draining:
            self._mark_draining(worker, 0.0)
        elif worker.draining and sent > worker.draining_since:
            worker.draining = False
            logger.info("worker %s serves again (not draining)", worker.id)

    def _mark_draining(self, w: Worker, grace_s: float) -> None:
        if not w.draining:
            w.draining, w.draining_since = True, time.monotonic()
            logger.info("worker %s is draining: no new requests, %d streams finish there",
                        w.id, len(w.watchers))
        if grace_s > 0:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            since = w.draining_since
            loop.call_later(grace_s + DRAIN_MARGIN_S, self._drain_overdue, w, since, grace_s)

    def _drain_overdue(self, w: Worker, since: float, grace_s: float) -> None:
        if not w.draining or w.draining_since != since or not w.watchers:
            return
        logger.warning("worker %s still serves %d streams %.0f s after it began draining "
                       "(its grace period: %.0f s): they move", w.id, len(w.watchers),
                       time.monotonic() - since, grace_s)
        _move_streams(w)

    def set_health(self, worker: Worker, healthy: bool) -> None:
        """gateway.health's verdict; a worker that stops answering has its ``watchers``
        called: the streams it serves end and their requests resume elsewhere -- unless it
        is draining (it said so, or it left the registry first)."""
        if healthy == worker.healthy:
            return
        worker.healthy = healthy
        if healthy:
            logger.info("worker %s answers again", worker.id)
            return
        if worker.draining or (not worker.registered and not worker.static):
            # a worker shutting down, whose server refuses new calls (probes) while its
            # streams drain within its grace period; they end there (a stream that breaks
            # meanwhile still resumes elsewhere)
            logger.info("worker %s is draining: %d streams finish there", worker.id,
                        len(worker.watchers))
            return
        logger.warning("worker %s stopped answering: routed around, %d streams move",
                       worker.id, len(worker.watchers))
        _move_streams(worker)


def _move_streams(worker: Worker) -> None:
    """End the streams ``worker`` serves as lost: their requests resume elsewhere."""
    for cut in list(worker.watchers):
        cut("lost")


def _prefiller(route: Route) -> Worker:
    """The worker that computes ``route``'s prompt (charged its pending prefill tokens)."""
    return route.prefill if route.prefill is not None else route.decode
