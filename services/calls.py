"""The calls a server is serving, by the label their caller gave them.

Labels (a client's ``request_id``) are not identities: several calls may share one, and each
call has its own internal id. Abort ends every call of a label; shutdown ends them all.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

C = TypeVar("C")


class CallRegistry(Generic[C]):
    def __init__(self) -> None:
        self._by_label: dict[str, list[C]] = {}

    @contextmanager
    def track(self, label: str, call: C) -> Iterator[C]:
        self._by_label.setdefault(label, []).append(call)
        try:
            yield call
        finally:
            calls = self._by_label.get(label, [])
            if call in calls:
                calls.remove(call)
            if not calls:
                self._by_label.pop(label, None)

    def with_label(self, label: str) -> list[C]:
        return list(self._by_label.get(label, ()))

    def all(self) -> list[C]:
        return [c for calls in self._by_label.values() for c in calls]

    def __len__(self) -> int:
        return sum(len(c) for c in self._by_label.values())
