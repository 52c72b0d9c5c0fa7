"""Which peers a worker may dial: cluster members only.

A DecodeRequest names the prefill worker to call (``prefill_address``) and a PrefillRequest
the KV receiver to send to (``receiver_endpoint``): without a check, whoever may send those
requests could make a worker connect anywhere (request forgery). A worker dials a target only
when it is a member:

* with Redis, a registered worker's address (``prefill``: a prefill or colocated worker's
  gRPC address) or KV endpoint (``receiver``: a decode or colocated worker's), read through
  the registry's verifier, so a forged entry makes nothing a member (services/registry.py);
  a target not seen yet re-reads the registry once (a worker that registered a moment ago);
* without Redis, the ``peer_addrs`` setting, when given;
* in every case, the peer then has to show a cluster certificate of the right role (TLS).

While Redis cannot be read, members seen before stay members; a target never seen waits up to
``unknown_wait_s`` for a read and is then refused as UNAVAILABLE (retry), not as a non-member.

``enforce`` False (``--insecure``) admits every target.
"""
from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)

KINDS = {"prefill": ("prefill", "colocated"), "receiver": ("decode", "colocated")}
MIN_REFRESH_S = 0.2  # most often an unknown target makes us re-read the registry
UNKNOWN_WAIT_S = 2.0  # how long a target not known yet waits for an unreadable registry
RETRY_S = 0.1  # between reads while the registry cannot be read


class NotMember(Exception):
    """The target is not a member of this cluster (PERMISSION_DENIED)."""


class MembershipUnknown(Exception):
    """The registry could not be read, so whether a target not seen before is a member is not
    known (UNAVAILABLE: retry; a member seen before stays one while Redis is away)."""


class Membership:
    """Reads of the registry are shared: the requests that find a target unknown at one moment
    wait on one read, not one read each (a burst of them would time out on a busy host and
    trip the Redis breaker). A known member is admitted at once; when what we know is older
    than ``refresh_s`` a read starts in the background (a member removed from the registry
    is refused once it completes). :meth:`refresh` at start reads before the first request."""

    def __init__(self, registry=None, static: tuple[str, ...] = (), *, enforce: bool = True,
                 model: str | None = None, refresh_s: float = 1.0,
                 unknown_wait_s: float = UNKNOWN_WAIT_S):
        self.registry = registry
        self.static = frozenset(static)
        self.enforce = enforce
        self.model = model
        self.refresh_s = refresh_s
        self.unknown_wait_s = unknown_wait_s
        self._known: dict[str, frozenset[str]] = {k: frozenset() for k in KINDS}
        self._read_at = -1e9
        self._reading: asyncio.Future | None = None

    async def admit(self, target: str, kind: str) -> None:
        """Return when this worker may dial ``target`` (a ``kind`` of peer); NotMember
        saying why otherwise, MembershipUnknown when the registry stays unreadable."""
        if not self.enforce or target in self.static:
            return
        if self.registry is None:
            if not self.static:
                return  # static cluster: the peer's certificate is the check
            raise NotMember(f"{kind} {target!r} is not in peer_addrs")
        if target in self._known[kind]:
            if time.monotonic() - self._read_at >= self.refresh_s and self._reading is None:
                self._start_read()  # re-read in the background: no request waits on Redis
            return
        give_up = time.monotonic() + self.unknown_wait_s
        while True:
            read = True
            if time.monotonic() - self._read_at >= MIN_REFRESH_S:
                read = await self.refresh()
            if target in self._known[kind]:
                return  # a member, or one seen before while Redis is away
            if read:
                logger.warning("refused to dial %s %s: not a registered cluster member", kind,
                               target)
                raise NotMember(f"{kind} {target!r} is not a registered member of this cluster")
            if time.monotonic() >= give_up:
                raise MembershipUnknown(f"cannot tell whether {kind} {target!r} is a member of "
                                        "this cluster: the registry cannot be read; retry")
            await asyncio.sleep(RETRY_S)

    async def refresh(self) -> bool:
        """Re-read the registry (joining a read under way); whether the read succeeded."""
        if self.registry is None or not self.enforce:
            return True
        if self._reading is None:
            self._start_read()
        # shielded: a waiter cancelled (its client gone) must not cancel the others' read
        return await asyncio.shield(self._reading)

    def _start_read(self) -> None:
        self._reading = asyncio.ensure_future(self._read())
        self._reading.add_done_callback(self._read_done)

    def _read_done(self, fut: asyncio.Future) -> None:
        self._reading = None
        if not fut.cancelled() and fut.exception() is not None:
            logger.error("reading the cluster's members failed: %r", fut.exception())

    async def close(self) -> None:
        """Stop a read under way (the worker is stopping)."""
        if self._reading is not None:
            self._reading.cancel()
            try:
                await self._reading
            except BaseException:  # noqa: BLE001 - cancelled, or failed: logged already
                pass

    async def _read(self) -> bool:
        from services.registry import RegistryUnavailable
        try:
            workers = await self.registry.list_workers(model=self.model)
        except RegistryUnavailable:
            return False  # keep what we knew: members stay members while Redis is away
        self._read_at = time.monotonic()
        self._known = {
            "prefill": frozenset(w.address for w in workers if w.role in KINDS["prefill"]),
            "receiver": frozenset(e for w in workers if w.role in KINDS["receiver"]
                                  for e in w.endpoints()),
        }
        return True
