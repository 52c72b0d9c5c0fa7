"""A Redis connection that fails fast while Redis is down and recovers by itself.

The registry and the prefix index are routing hints: when Redis is unreachable the gateway must
keep serving with load-only routing, so a call must never hang. Every call here:

* uses short socket timeouts (connect and read, ``timeout_s``, default 0.25 s) and at most one
  retry, without back-off, of a *connection* error (a pooled connection broken by a Redis
  restart is replaced by the retry);
* raises :class:`RedisUnavailable` (or the subclass the caller chose) on any connection error,
  timeout, server still loading, or read-only replica (after a failover);
* authenticates (``auth``: ``password``, ``username``, and ``ssl_ca_certs`` for rediss://)
  from the service's settings, never from a URL on a command line; a URL is shown (logs,
  errors) with any password in it cut out (:func:`shown_url`);
* re-raises a cancellation that landed during the command even when redis-py swallowed it
  and returned the reply (a cancelled caller never goes on with a result);
* after a failure, fails immediately for ``cooldown_s`` (default 0.5 s) without touching the
  network (a small circuit breaker), so a black-holed Redis costs one timeout per cooldown, not
  one per request. The first call after the cooldown tries again: recovery is automatic.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
import logging
import time
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis import exceptions as rexc

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_NAMESPACE = "pdserve"


class RedisUnavailable(Exception):
    """Redis could not be reached (or answered too slowly); the caller should degrade."""


def shown_url(url: str) -> str:
    """``url`` with a password in it replaced by ``<redacted>`` (logs, errors)."""
    from pdcore.config_tree import redact_url
    return redact_url(url)


def worker_key(namespace: str, worker_id: str) -> str:
    """The registry key of one worker; its existence is the definition of "alive"."""
    return f"{namespace}:worker:{worker_id}"


class RedisConn:
    """One ``redis.asyncio.Redis`` pool plus the fail-fast policy above."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, cooldown_s: float = 0.5,
                 error_cls: type[RedisUnavailable] = RedisUnavailable, name: str = "redis",
                 auth: dict | None = None):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.url = shown_url(url)  # only ever shown; the client keeps the real one
        self.name = name
        self.cooldown_s = cooldown_s
        self.error_cls = error_cls
        self.client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
            decode_responses=True,
            **(auth or {}),
        )
        self._down_until = 0.0
        self._down_logged = False
        self._has_password = bool((auth or {}).get("password")) or "@" in url.split("//", 1)[-1]

    @property
    def available(self) -> bool:
        """False while in the cooldown after a failure (no network call is made)."""
        return time.monotonic() >= self._down_until

    async def call(self, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """Run ``fn(client)``; translate every availability failure into ``error_cls``."""
        if not self.available:
            raise self.error_cls(f"{self.name}: Redis at {self.url} is unavailable (cooling down)")
        try:
            result = await fn(self.client)
        except rexc.AuthenticationError as e:  # wrong or missing password: say so, degrade
            self._down_until = time.monotonic() + self.cooldown_s
            # Redis's own words for a missing password ("HELLO must be called with the
            # client already authenticated ...") do not say what to set
            why = e if self._has_password else "it requires a password and none is set"
            if not self._down_logged:
                logger.error("%s: Redis at %s refused our credentials: %s", self.name,
                             self.url, why)
                self._down_logged = True
            err = self.error_cls(f"{self.name}: Redis at {self.url} refused our "
                                 f"credentials: {why}")
            err.credentials_refused = True  # a configuration error, where a start can say so
            raise err from e
        except (rexc.ConnectionError, rexc.TimeoutError, rexc.ReadOnlyError, OSError) as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # We were cancelled and redis-py's cleanup turned that into a timeout (its
                # disconnect runs under asyncio.timeout): stop, do not retry as if Redis were slow.
                raise asyncio.CancelledError() from e
            self._down_until = time.monotonic() + self.cooldown_s
            if not self._down_logged:
                logger.warning("%s: Redis at %s unavailable: %s", self.name, self.url, e)
                self._down_logged = True
            raise self.error_cls(f"{self.name}: Redis at {self.url} is unavailable: {e}") from e
        if self._down_logged:
            logger.info("%s: Redis at %s is reachable again", self.name, self.url)
            self._down_logged = False
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # redis-py (8.1) can swallow a cancellation that lands during a command and
            # return its reply: the caller was cancelled (a client gone, say) and must not
            # go on with the result
            raise asyncio.CancelledError()
        return result

    async def close(self) -> None:
        await self.client.aclose()
