"""Global prefix index in Redis: which workers hold which KV blocks (by chained block hash).

Hashes come from pdcore/block_hash.py (a hash names a whole prefix, so "worker holds block i"
implies it held blocks 0..i-1 when it stored it; evictions can break that, hence the lookup rule
below). Workers publish ``stored`` / ``removed`` events; gateways ask ``longest_prefix``.

Key layout (``ns`` = namespace, default ``pdserve``; ``m`` = model id, so two models never share
entries even though their hashes already differ)::

    {ns}:idx:{m}:blk:{hex}        SET  ids of workers holding the block (hex of the 16-byte hash)
    {ns}:idx:{m}:wrk:{worker_id}  SET  hex hashes that worker holds (the reverse map)
    {ns}:idx:{m}:workers          SET  ids of workers that have entries in this index
    {ns}:worker:{worker_id}       the registry key (services/registry.py): alive iff it exists

Staleness: entries never outlive their worker's registry key (TTL 3 s, heart-beaten every 1 s).

1. Lookups ignore dead workers at once: the lookup script checks ``EXISTS {ns}:worker:{id}`` for
   every candidate, so a crashed worker stops attracting traffic when its registry key expires.
2. Physical removal is done by the reaper (:meth:`PrefixIndex.reap`, run every ~2 s by every
   gateway via :meth:`run_reaper`): for each member of ``workers`` whose registry key is gone it
   removes the worker from each ``blk`` set listed in its reverse map, in batches of 5,000 (one
   short Lua script per batch, so Redis never blocks long), then drops the reverse map.
   The reverse map deliberately has NO TTL: if it expired before a reaper ran, the forward
   entries could never be found again and would leak. Keeping it until reaped means any later
   reaper (even a gateway started an hour later) can clean up completely. Each batch re-checks
   that the registry key is still absent, so a worker that comes back is never stripped.
3. A clean shutdown calls :meth:`clear_worker` directly; a worker that finds its registry key had
   expired (Heartbeat.on_lost) re-publishes its blocks. Empty sets vanish by themselves (Redis
   deletes empty aggregates), so removing the last holder removes the block key.

Lookup (``longest_prefix``) is one EVALSHA: the script takes the holders of block 0 that are
alive, then walks blocks 1, 2, ... with one SMISMEMBER per block over the workers still in the
running, dropping a worker at its first missing block; it returns ``worker -> k`` where the
worker holds every block 0..k-1 (workers with k = 0 are absent). Cost: O(k * live holders).

The scripts build key names from arguments, so they need a single Redis (or a Sentinel
primary), not Redis Cluster. Redis down: every call raises :class:`IndexUnavailable` quickly
(services/redis_client.py); callers fall back to load-only routing.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
import logging

from services.redis_client import DEFAULT_NAMESPACE, RedisConn, RedisUnavailable, worker_key

logger = logging.getLogger(__name__)

PUBLISH_BATCH = 2000
CLEAR_BATCH = 5000


class IndexUnavailable(RedisUnavailable):
    """The prefix index's Redis is unreachable."""


# ARGV: [1] block key prefix, [2] worker key prefix, [3..] hex hashes in prompt order.
_LOOKUP_LUA = """
local bp, wp = ARGV[1], ARGV[2]
local active, counts = {}, {}
for _, id in ipairs(redis.call('SMEMBERS', bp .. ARGV[3])) do
  if redis.call('EXISTS', wp .. id) == 1 then
    active[#active + 1] = id
    counts[id] = 1
  end
end
local i = 4
while #active > 0 and i <= #ARGV do
  local present = redis.call('SMISMEMBER', bp .. ARGV[i], unpack(active))
  local still = {}
  for j, id in ipairs(active) do
    if present[j] == 1 then
      counts[id] = i - 2
      still[#still + 1] = id
    end
  end
  active = still
  i = i + 1
end
local out = {}
for id, c in pairs(counts) do
  out[#out + 1] = id
  out[#out + 1] = c
end
return out
"""

# ARGV: [1] index prefix, [2] worker id, [3] 1 = stored / 0 = removed, [4..] hex hashes.
_PUBLISH_LUA = """
local p, id = ARGV[1], ARGV[2]
local rev = p .. 'wrk:' .. id
if ARGV[3] == '1' then
  redis.call('SADD', p .. 'workers', id)
  for i = 4, #ARGV do
    redis.call('SADD', p .. 'blk:' .. ARGV[i], id)
    redis.call('SADD', rev, ARGV[i])
  end
else
  for i = 4, #ARGV do
    redis.call('SREM', p .. 'blk:' .. ARGV[i], id)
    redis.call('SREM', rev, ARGV[i])
  end
end
return 1
"""

# ARGV: [1] index prefix, [2] worker id, [3] batch size, [4] registry key or '' (unconditional).
# Returns -1 if the worker is alive (nothing done), else the number of entries removed.
_CLEAR_BATCH_LUA = """
local p, id = ARGV[1], ARGV[2]
if ARGV[4] ~= '' and redis.call('EXISTS', ARGV[4]) == 1 then return -1 end
local rev = p .. 'wrk:' .. id
local hs = redis.call('SPOP', rev, tonumber(ARGV[3]))
for _, h in ipairs(hs) do redis.call('SREM', p .. 'blk:' .. h, id) end
if redis.call('EXISTS', rev) == 0 then redis.call('SREM', p .. 'workers', id) end
return #hs
"""

# ARGV: [1] index prefix, [2] worker key prefix. Returns ids in `workers` with no registry key.
_DEAD_LUA = """
local dead = {}
for _, id in ipairs(redis.call('SMEMBERS', ARGV[1] .. 'workers')) do
  if redis.call('EXISTS', ARGV[2] .. id) == 0 then dead[#dead + 1] = id end
end
return dead
"""


def _hex(h: bytes | str) -> str:
    return h.hex() if isinstance(h, (bytes, bytearray)) else h


class PrefixIndex:
    """Client of the index of one model. Safe to share within one event loop."""

    def __init__(self, url: str, model: str, *, namespace: str = DEFAULT_NAMESPACE,
                 timeout_s: float = 0.25, cooldown_s: float = 0.5, auth: dict | None = None):
        if not model:
            raise ValueError("model is required (it namespaces the index)")
        self.model = model
        self.namespace = namespace
        self.prefix = f"{namespace}:idx:{model}:"
        self._worker_prefix = worker_key(namespace, "")
        self.conn = RedisConn(url, timeout_s=timeout_s, cooldown_s=cooldown_s,
                              error_cls=IndexUnavailable, name="prefix-index", auth=auth)
        c = self.conn.client
        self._lookup = c.register_script(_LOOKUP_LUA)
        self._publish = c.register_script(_PUBLISH_LUA)
        self._clear_batch = c.register_script(_CLEAR_BATCH_LUA)
        self._dead = c.register_script(_DEAD_LUA)

    async def longest_prefix(self, hashes: Sequence[bytes | str]) -> dict[str, int]:
        """For each live worker holding block 0: how many leading blocks it holds in a row."""
        if not hashes:
            return {}
        args = [self.prefix + "blk:", self._worker_prefix, *map(_hex, hashes)]
        flat = await self.conn.call(lambda r: self._lookup(args=args))
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def _publish_events(self, worker_id: str, hashes: Iterable[bytes | str],
                              stored: bool) -> None:
        hexes = [_hex(h) for h in hashes]
        flag = "1" if stored else "0"
        for i in range(0, len(hexes), PUBLISH_BATCH):
            args = [self.prefix, worker_id, flag, *hexes[i:i + PUBLISH_BATCH]]
            await self.conn.call(lambda r: self._publish(args=args))

    async def publish_stored(self, worker_id: str, hashes: Iterable[bytes | str]) -> None:
        """``worker_id`` now holds these blocks. Register the worker before publishing."""
        await self._publish_events(worker_id, hashes, stored=True)

    async def publish_removed(self, worker_id: str, hashes: Iterable[bytes | str]) -> None:
        await self._publish_events(worker_id, hashes, stored=False)

    async def clear_worker(self, worker_id: str, *, only_if_dead: bool = False) -> int:
        """Remove every entry of ``worker_id``; returns how many were removed. With
        ``only_if_dead`` it stops (between batches) as soon as the worker's registry key exists."""
        guard = worker_key(self.namespace, worker_id) if only_if_dead else ""
        total = 0
        while True:
            args = [self.prefix, worker_id, CLEAR_BATCH, guard]
            n = int(await self.conn.call(lambda r: self._clear_batch(args=args)))
            if n < 0:
                logger.info("index: %s is alive again; stopped clearing it", worker_id)
                return total
            total += n
            if n < CLEAR_BATCH:
                return total

    async def reap(self) -> list[str]:
        """Clear the entries of every worker whose registry key has expired."""
        dead = await self.conn.call(lambda r: self._dead(args=[self.prefix, self._worker_prefix]))
        for worker_id in dead:
            n = await self.clear_worker(worker_id, only_if_dead=True)
            logger.info("index: reaped %d entries of dead worker %s", n, worker_id)
        return list(dead)

    async def run_reaper(self, interval_s: float = 2.0) -> None:
        """Reap forever (cancel to stop); Redis outages are waited out."""
        while True:
            try:
                await self.reap()
            except IndexUnavailable:
                pass  # logged once by RedisConn
            except Exception:
                logger.exception("index reaper failed")
            await asyncio.sleep(interval_s)

    async def worker_hashes(self, worker_id: str) -> set[str]:
        """Hex hashes the index attributes to ``worker_id`` (for stats and tests)."""
        return set(await self.conn.call(lambda r: r.smembers(self.prefix + "wrk:" + worker_id)))

    async def workers(self) -> set[str]:
        """Ids with entries in this model's index (alive or not yet reaped)."""
        return set(await self.conn.call(lambda r: r.smembers(self.prefix + "workers")))

    async def close(self) -> None:
        await self.conn.close()
