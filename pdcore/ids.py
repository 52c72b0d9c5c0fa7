"""Process-unique identities for calls and transfers, cheap enough for every request.

``uuid.uuid4()`` reads the kernel's random source each time; profiled on a GPU worker at
concurrency 512 it cost more than the rest of a call's set-up. An ``IdSource`` draws 64
random bits once per process and counts after them, so ids stay unique across processes
and workers (a prefill worker sees transfer ids from many decode workers) without a
system call per id.
"""
from __future__ import annotations

import itertools
import os
import threading


class IdSource:
    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:  # itertools.count is atomic under the GIL; the lock keeps it so
            n = next(self._count)
        return f"{self._prefix}{n:x}"


_SOURCE = IdSource()


def new_id() -> str:
    """An id no other call of this process, or of any other process, gets."""
    return _SOURCE.next()
