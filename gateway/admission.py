"""Per-API-key limits, so that one client cannot take every seat or every token.

A key may have at most ``max_concurrent`` requests in flight -- or, when that is 0 and the
gateway accepts two or more keys, ``seat_share`` of the decode pool's capacity -- and spend
at most ``tokens_per_s`` prompt + completion tokens per second, averaged over
``WINDOW_S`` (a token bucket that a request may overdraw; new requests of the key wait for
it to refill). A request over a limit ends with RESOURCE_EXHAUSTED before anything is
routed. Without API keys (one anonymous client) nothing is limited per key.

Keys are known here only by a short hash (:func:`key_id`), never in clear.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import hashlib
import math
import time

WINDOW_S = 10.0


def key_id(key: str | None) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12] if key else ""


class OverLimit(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Key:
    inflight: int = 0
    tokens: float = 0.0  # bucket level
    at: float = field(default_factory=time.monotonic)


class Admission:
    def __init__(self, *, num_keys: int, max_concurrent: int = 0, seat_share: float = 0.5,
                 tokens_per_s: float = 0.0):
        self.num_keys = num_keys
        self.max_concurrent, self.seat_share = max_concurrent, seat_share
        self.tokens_per_s = tokens_per_s
        self._keys: dict[str, _Key] = {}

    def concurrency_limit(self, seats: int) -> int:
        """Requests one key may have in flight with ``seats`` seats in the decode pool
        (0: no limit)."""
        if self.max_concurrent:
            return self.max_concurrent
        if self.num_keys >= 2 and self.seat_share < 1:
            return max(1, math.floor(self.seat_share * seats))
        return 0

    def enter(self, key: str, prompt_tokens: int, seats: int) -> "Ticket":
        """Admit a request of ``key`` or raise :class:`OverLimit`."""
        if not key:
            return Ticket(self, None)
        k = self._keys.setdefault(key, _Key(tokens=self.tokens_per_s * WINDOW_S))
        limit = self.concurrency_limit(seats)
        if limit and k.inflight >= limit:
            raise OverLimit("key_concurrency", f"this API key already has {k.inflight} "
                            f"requests in flight (limit {limit}); retry later")
        if self.tokens_per_s:
            self._refill(k)
            if k.tokens <= 0:
                wait = -k.tokens / self.tokens_per_s
                raise OverLimit("key_rate", f"this API key is over its {self.tokens_per_s:g} "
                                f"tokens/s; retry in {max(wait, 0.1):.1f} s")
        k.inflight += 1
        ticket = Ticket(self, k)
        ticket.spend(prompt_tokens)
        return ticket

    def _refill(self, k: _Key) -> None:
        now = time.monotonic()
        k.tokens = min(self.tokens_per_s * WINDOW_S,
                       k.tokens + (now - k.at) * self.tokens_per_s)
        k.at = now


class Ticket:
    """One admitted request: spends tokens as they stream; ``close`` once, at the end."""

    __slots__ = ("admission", "key", "closed")

    def __init__(self, admission: Admission, key: _Key | None) -> None:
        self.admission, self.key, self.closed = admission, key, False

    def spend(self, tokens: int) -> None:
        if self.key is not None and self.admission.tokens_per_s:
            self.admission._refill(self.key)
            self.key.tokens -= tokens

    def close(self) -> None:
        if not self.closed and self.key is not None:
            self.key.inflight -= 1
        self.closed = True
