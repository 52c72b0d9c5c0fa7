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

``enforce`` False (``--insecure``) admits every target.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

KINDS = {"prefill": ("prefill", "colocated"), "receiver": ("decode", "colocated")}
MIN_REFRESH_S = 0.2  # most often an unknown target makes us re-read the registry


class NotMember(Exception):
    """The target is not a member of this cluster (PERMISSION_DENIED)."""


class Membership:
    def __init__(self, registry=None, static: tuple[str, ...] = (), *, enforce: bool = True,
                 model: str | None = None, refresh_s: float = 1.0):
        self.registry = registry
        self.static = frozenset(static)
        self.enforce = enforce
        self.model = model
        self.refresh_s = refresh_s
        self._known: dict[str, frozenset[str]] = {k: frozenset() for k in KINDS}
        self._read_at = -1e9

    async def admit(self, target: str, kind: str) -> None:
        """Return when this worker may dial ``target`` (a ``kind`` of peer); NotMember
        saying why otherwise."""
        if not self.enforce or target in self.static:
            return
        if self.registry is None:
            if not self.static:
                return  # static cluster: the peer's certificate is the check
            raise NotMember(f"{kind} {target!r} is not in peer_addrs")
        if target in self._known[kind] and time.monotonic() - self._read_at < self.refresh_s:
            return
        if time.monotonic() - self._read_at >= MIN_REFRESH_S:
            await self._read()
        if target not in self._known[kind]:
            logger.warning("refused to dial %s %s: not a registered cluster member", kind,
                           target)
            raise NotMember(f"{kind} {target!r} is not a registered member of this cluster")

    async def _read(self) -> None:
        from services.registry import RegistryUnavailable
        try:
            workers = await self.registry.list_workers(model=self.model)
        except RegistryUnavailable:
            return  # keep what we knew: members stay members while Redis is away
        self._read_at = time.monotonic()
        self._known = {
            "prefill": frozenset(w.address for w in workers if w.role in KINDS["prefill"]),
            "receiver": frozenset(e for w in workers if w.role in KINDS["receiver"]
                                  for e in w.endpoints()),
        }
