"""Worker registry in Redis: which workers are alive, where they are, and how loaded they are.

Key layout (``ns`` = namespace, default ``pdserve``)::

    {ns}:worker:{worker_id}   HASH  address, role, model, kv_endpoint, capacity, running,
                                    waiting, kv_free_blocks, kv_total_blocks, updated_ms
                                    PEXPIRE ttl (default 3 s)
                                    (+ expires_ms, cert, sig: signed entries, below)
    {ns}:workers              SET   worker ids ever registered (an index for listing; members
                                    whose hash has expired are removed lazily by list_workers)
    {ns}:epoch                STRING  a random id set by the first registration after the
                                    registry was empty: a reader that sees it change (or vanish)
                                    knows Redis lost its data, not that workers left

A worker is alive exactly while its hash exists. :class:`Heartbeat` rewrites the hash and its
TTL every ``interval_s`` (default 1 s), so a worker that stops heart-beating disappears within
``ttl_s``. A clean shutdown deletes the hash at once. When a heartbeat finds its hash gone (the
worker stalled longer than the TTL, or Redis restarted empty) it calls ``on_lost`` so the worker
can re-publish state that went with it (e.g. its prefix-index entries).

Listing is one round trip (a Lua script reads every member's hash). Worker ids must be unique per
process incarnation (:func:`new_worker_id` appends a random suffix to host:port) so a restarted
worker never inherits the index entries of its previous life.

Signed entries (every cluster with certificates): the worker signs each write with its
certificate's key (``signer``, a :class:`services.tls.ClusterTls`): the signature covers every
field, the certificate included, and ``expires_ms`` (a few TTLs ahead). A reader with a
``verifier`` lists only entries whose certificate the cluster CA signed, whose role is the
certificate's, whose signature holds and whose expiry has not passed: a Redis writer without
a cluster key can neither add a worker nor change where one is, and a replayed entry dies
with its expiry.

Redis being down never raises anything but :class:`RegistryUnavailable`, quickly
(see services/redis_client.py); the heartbeat keeps retrying and re-registers on recovery.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, fields, replace
import logging
import time
import uuid

from services.redis_client import DEFAULT_NAMESPACE, RedisConn, RedisUnavailable, worker_key
from pdcore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


class RegistryUnavailable(RedisUnavailable):
    """The registry's Redis is unreachable."""


@dataclass(frozen=True)
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    address: str  # host:port of the worker's gRPC server
    role: str  # "prefill" | "decode" | "colocated"
    model: str
    kv_endpoint: str = ""  # KV receiver endpoint (decode/colocated), backend specific
    kv_endpoints: str = ""  # every KV receiver's endpoint (one per backend), comma-separated
    capacity: int = 0  # max running requests
    max_model_len: int = 0  # context limit (prompt + output tokens); 0: unknown
    running: int = 0
    waiting: int = 0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    updated_ms: int = 0  # wall-clock ms of the last write
    expires_ms: int = 0  # signed entries: not to be believed after this wall-clock ms
    cert: str = ""  # signed entries: the worker's certificate (PEM)
    sig: str = ""  # signed entries: its signature over every other field

    def __post_init__(self) -> None:
        if not self.worker_id or not self.address:
            raise ValueError("worker_id and address are required")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def endpoints(self) -> set[str]:
        """Every KV endpoint this worker receives on."""
        return {e for e in (self.kv_endpoint, *self.kv_endpoints.split(",")) if e}

    def with_load(self, load: WorkerLoad) -> WorkerInfo:
        return replace(self, **asdict(load))

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> WorkerInfo:
        kw: dict[str, object] = {}
        for f in fields(cls):
            if f.name in h:
                kw[f.name] = int(h[f.name]) if f.type == "int" else h[f.name]
        return cls(**kw)  # type: ignore[arg-type]


def new_worker_id(address: str) -> str:
    """A unique id: ``host:port-<8 hex>``."""
    return f"{address}-{uuid.uuid4().hex[:8]}"


# KEYS[1] = workers set, KEYS[2] = epoch; ARGV[1] = worker key prefix. Returns {epoch or
# false, list of flat HGETALL replies}.
_LIST_LUA = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local h = redis.call('HGETALL', ARGV[1] .. id)
  if #h == 0 then redis.call('SREM', KEYS[1], id) else out[#out + 1] = h end
end
return {redis.call('GET', KEYS[2]), out}
"""


SIGNED_TTLS = 3  # a signed entry expires this many TTLs after it was written
DEREGISTER_RETRY_S = 0.2  # Heartbeat.stop: between tries to deregister


class WorkerRegistry:
    """``auth``: Redis credentials (:meth:`ServiceSettings.redis_auth`); ``signer``: signs
    what :meth:`register` writes; ``verifier``: :meth:`list_workers` keeps only entries it
    accepts (both :class:`services.tls.ClusterTls`)."""

    def __init__(self, url: str, *, namespace: str = DEFAULT_NAMESPACE, ttl_s: float = 3.0,
                 timeout_s: float = 0.25, cooldown_s: float = 0.5, auth: dict | None = None,
                 signer=None, verifier=None):
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.namespace = namespace
        self.ttl_ms = int(ttl_s * 1000)
        self.signer = signer
        self.verifier = verifier
        self.refused: dict[str, str] = {}  # worker id -> why its entry was not believed
        self.conn = RedisConn(url, timeout_s=timeout_s, cooldown_s=cooldown_s,
                              error_cls=RegistryUnavailable, name="registry", auth=auth)
        self._set_key = f"{namespace}:workers"
        self._epoch_key = f"{namespace}:epoch"
        self._list = self.conn.client.register_script(_LIST_LUA)
        # the registry's epoch at the latest listing (None: no worker registered since Redis
        # last started empty); see the module's key layout
        self.epoch: str | None = None

    def key(self, worker_id: str) -> str:
        return worker_key(self.namespace, worker_id)

    async def register(self, info: WorkerInfo) -> bool:
        """Write (or refresh) ``info`` with the TTL. Returns whether the key already existed."""
        now_ms = int(time.time() * 1000)
        info = replace(info, updated_ms=now_ms)
        if self.signer is not None:
            from services.tls import entry_payload
            info = replace(info, expires_ms=now_ms + SIGNED_TTLS * self.ttl_ms, sig="",
                           cert=self.signer.cert_pem())
            info = replace(info, sig=self.signer.sign(entry_payload(info.to_hash()))[1])
        key = self.key(info.worker_id)

        async def op(r):
            async with r.pipeline(transaction=True) as p:
                p.exists(key)
                p.hset(key, mapping=info.to_hash())
                p.pexpire(key, self.ttl_ms)
                p.sadd(self._set_key, info.worker_id)
                p.set(self._epoch_key, uuid.uuid4().hex, nx=True)
                res = await p.execute()
            return bool(res[0])

        return await self.conn.call(op)

    async def deregister(self, worker_id: str) -> None:
        async def op(r):
            async with r.pipeline(transaction=True) as p:
                p.delete(self.key(worker_id))
                p.srem(self._set_key, worker_id)
                await p.execute()

        await self.conn.call(op)

    async def get(self, worker_id: str) -> WorkerInfo | None:
        h = await self.conn.call(lambda r: r.hgetall(self.key(worker_id)))
        return WorkerInfo.from_hash(h) if h else None

    async def list_workers(self, role: str | None = None, model: str | None = None
                           ) -> list[WorkerInfo]:
        """Alive workers, optionally of one role and/or model, sorted by id."""
        prefix = worker_key(self.namespace, "")
        epoch, rows = await self.conn.call(
            lambda r: self._list(keys=[self._set_key, self._epoch_key], args=[prefix]))
        self.epoch = epoch or None
        out = []
        for flat in rows:
            h = dict(zip(flat[::2], flat[1::2]))
            try:
                info = WorkerInfo.from_hash(h)
            except (ValueError, TypeError) as e:
                logger.warning("ignoring malformed registry entry %s: %s", h.get("worker_id"), e)
                continue
            if self.verifier is not None and not self._believed(info, h):
                continue
            if (role is None or info.role == role) and (model is None or info.model == model):
                out.append(info)
        return sorted(out, key=lambda w: w.worker_id)

    def _believed(self, info: WorkerInfo, h: dict[str, str]) -> bool:
        """Whether the verifier accepts the entry (a refusal is logged once per worker)."""
        from services.tls import TlsError, entry_payload
        try:
            self.verifier.check_entry(info.cert, entry_payload(h), info.sig, info.role,
                                      info.expires_ms)
        except TlsError as e:
            if self.refused.get(info.worker_id) != str(e):
                logger.warning("ignoring registry entry %s (address %s): %s", info.worker_id,
                               info.address, e)
            if len(self.refused) > 1024:
                self.refused.clear()
            self.refused[info.worker_id] = str(e)
            return False
        self.refused.pop(info.worker_id, None)
        return True

    async def close(self) -> None:
        await self.conn.close()


class Heartbeat:
    """Keeps one worker registered: writes ``info`` (with fresh load) every ``interval_s``.

    ``load_fn`` returns the current :class:`WorkerLoad`; ``on_lost`` (sync or async) runs after
    a heartbeat re-created a key that had disappeared (not on the first registration).
    """

    def __init__(self, registry: WorkerRegistry, info: WorkerInfo, *, interval_s: float = 1.0,
                 load_fn: Callable[[], WorkerLoad] | None = None,
                 on_lost: Callable[[], Awaitable[None] | None] | None = None):
        if interval_s <= 0 or interval_s * 1000 >= registry.ttl_ms:
            raise ValueError("heartbeat interval must be positive and shorter than the TTL")
        self.registry = registry
        self.info = info
        self.interval_s = interval_s
        self.load_fn = load_fn
        self.on_lost = on_lost
        self._task: asyncio.Task | None = None
        self._registered_once = False

    async def beat(self) -> None:
        """One heartbeat; raises RegistryUnavailable when Redis is down."""
        info = self.info.with_load(self.load_fn()) if self.load_fn else self.info
        existed = await self.registry.register(info)
        if self._registered_once and not existed:
            logger.warning("registry key of %s had expired; re-registered", info.worker_id)
            if self.on_lost is not None:
                res = self.on_lost()
                if asyncio.iscoroutine(res):
                    await res
        self._registered_once = True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
            except RegistryUnavailable:
                pass  # logged once by RedisConn; keep trying
            except Exception:  # a bug in load_fn/on_lost must not kill the heartbeat
                logger.exception("heartbeat of %s failed", self.info.worker_id)

    async def start(self) -> None:
        """Register now and keep beating. Redis down is tolerated (registered when it is
        back); Redis refusing our credentials raises RegistryUnavailable (with
        ``credentials_refused``): the settings are wrong."""
        if self._task is not None:
            return
        try:
            await self.beat()
        except RegistryUnavailable as e:
            if getattr(e, "credentials_refused", False):
                raise  # a wrong or missing password is the worker's settings, not an outage
            logger.warning("registry unavailable at start; %s will register when it is back",
                           self.info.worker_id)
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.info.worker_id}")

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if deregister:
            # tried for up to half a TTL (by then the key is about to expire anyway): one
            # slow answer, or the client's cool-down after one, must not leave the worker
            # listed while it drains
            deadline = time.monotonic() + self.registry.ttl_ms / 2000
            while True:
                try:
                    await self.registry.deregister(self.info.worker_id)
                    return
                except RegistryUnavailable:
                    if time.monotonic() + DEREGISTER_RETRY_S >= deadline:
                        break
                    await asyncio.sleep(DEREGISTER_RETRY_S)
            logger.warning("could not deregister %s; its key expires by TTL",
                           self.info.worker_id)
